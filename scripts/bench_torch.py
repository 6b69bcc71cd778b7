#!/usr/bin/env python3
"""PyTorch DCP and safetensors on the state `dckpt bench` measures, against the same ceilings.

`dckpt bench` writes a manifest of every rank's pieces of its benchmark model (key, dtype,
global shape, offsets, local shape, whether the piece is the main replica) and runs this
script with a Python that has torch and safetensors. Never required: `dckpt bench` reports
these figures as null when no such Python is given.

    bench_torch.py --probe
        exits 0 and prints the versions as JSON when torch (with gloo and DCP) and
        safetensors import, else exits 3 with the reason on stderr.
    bench_torch.py --manifest FILE --dir DIR [--rounds N]
        measures and prints one JSON array of {name, value, ceiling, ratio, note}.

What is measured (values and ceilings in GB/s of the state's distinct bytes; ratios are
medians of per-round ratios over rounds that alternate which side goes first):

- dcp_save_vs_write, dcp_load_warm_vs_read: one process per rank, gloo on 127.0.0.1, the
  state as DTensors on a 1-D mesh over all ranks (Shard(axis) for pieces split along one
  axis, Replicate for replicated ones), `dcp.save` with the default FileSystemWriter
  (sync_files=True) and `dcp.load` into preallocated DTensors, page cache warm.
- safetensors_save_vs_write, safetensors_load_warm_vs_read: each rank `save_file`s its main
  pieces to its own file, then fsyncs it and the directory (save_file itself does not);
  each rank `load_file`s its own file and copies every tensor into a preallocated one.
- dcp_small_tensors_vs_large: one process without a process group, DCP save + load of
  20,000 tensors of 4 KiB vs one tensor of the same 78 MiB.

- dckpt_torch_save_vs_dcp, dckpt_torch_load_warm_vs_dcp, dckpt_dcp_reader_load_warm_vs_dcp,
  dckpt_torch_small_tensors_vs_dcp, dckpt_torch_save_vs_engine,
  dckpt_torch_load_warm_vs_engine: only when this Python imports dckpt's own package
  (`pip install .`), else null with the reason. On the same DTensors and processes,
  rounds alternating with DCP's own: `dckpt.torch.save` vs `dcp.save`, `dckpt.torch.load`
  vs `dcp.load` (warm), `dcp.load` through `dckpt.dcp.DckptStorageReader` vs through
  FileSystemReader, `dcp.save` through `dckpt.dcp.DckptStorageWriter` vs through
  FileSystemWriter (dckpt_dcp_writer_save_vs_dcp), and the 20,000 small tensors saved +
  loaded by `dckpt.torch` vs DCP, and saved by `dcp.save` with each writer
  (dckpt_dcp_writer_small_tensors_vs_dcp); the ratio is the speedup.
  load_warm_vs_safetensors: `dckpt.torch.load` of the same DTensors, every byte checked,
  vs each rank's safetensors `load_file` of its own file + copy into the same preallocated
  tensors (nothing checked), warm, alternating.
  dckpt_dcp_writer_us_per_item: the writer's own Python per write item (DCP's plan items
  mapped onto dckpt's pieces), in microseconds, on the 20,000 small tensors. dckpt_torch_save_vs_torch_dist, dckpt_torch_load_warm_vs_torch_dist:
  the same pieces as megatron-core ShardedTensors saved and loaded by its torch_dist strategy
  (its few CUDA calls sent to the CPU), against `dckpt.torch` with `Shard`s of the same
  replica ids; when megatron-core imports. The *_vs_engine figures: dckpt.torch against the
  engine driven from the same processes with descriptors built once (ratio = dckpt.torch's
  throughput over the engine's; target >= 0.9), over max(3 x rounds, 9) rounds since the
  two differ by far less than one round's noise. In the small-tensor comparison, dckpt's
  side of each round is the median of three runs (one is 50-80x shorter than DCP's).

`dckpt bench` runs this script with DCKPT_MAPPED_READS=1: dckpt.torch then loads as the CLI
does, copying out of mappings of the files (safetensors maps them too).

Ceilings, measured in the same run: one sequential write of the state's bytes to one file
from one process, then fsync of the file and the directory (rank 0 writes its own pieces and
as many random bytes as the other ranks' pieces); and one sequential read, by rank 0, of
every file the engine under test wrote, into one buffer.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
import zlib

MISSING_PACKAGES = 3
BAD_INPUT = 2
GB = 1e9
# Runs of dckpt.torch per round of the small-tensor comparison (see small_tensors).
SMALL_DCKPT_RUNS = 3


def probe():
    """The versions, or exit MISSING_PACKAGES with the reason."""
    try:
        import safetensors
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except Exception as e:  # any import failure means: not usable here
        print(f"cannot import torch, torch.distributed.checkpoint or safetensors: {e}", file=sys.stderr)
        sys.exit(MISSING_PACKAGES)
    if not dist.is_available() or not dist.is_gloo_available():
        print(f"torch {torch.__version__} was built without torch.distributed or gloo", file=sys.stderr)
        sys.exit(MISSING_PACKAGES)
    return {"torch": torch.__version__, "safetensors": safetensors.__version__}


# ---------------------------------------------------------------------------------------
# The manifest


class BadManifest(Exception):
    pass


DTYPES = {
    "bool": "bool",
    "u8": "uint8",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8_e4m3": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
}


def _dims(piece, field, ndim=None):
    v = piece.get(field)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise BadManifest(f"{piece.get('key')!r}: {field} must be a list of non-negative integers")
    if ndim is not None and len(v) != ndim:
        raise BadManifest(f"{piece.get('key')!r}: {field} has {len(v)} dimensions, global_shape {ndim}")
    return v


def read_manifest(path):
    """The manifest, checked: every field typed, every piece inside its tensor."""
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise BadManifest(f"cannot read {path}: {e}") from e
    if not isinstance(m, dict) or m.get("version") != 1:
        raise BadManifest("expected a JSON object with version 1")
    ranks, total = m.get("ranks"), m.get("bytes")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, list) for r in ranks):
        raise BadManifest("ranks must be a non-empty list of lists of pieces")
    if not isinstance(total, int) or total <= 0:
        raise BadManifest("bytes must be a positive integer")
    main_bytes = 0
    for r, pieces in enumerate(ranks):
        seen = set()
        for p in pieces:
            if not isinstance(p, dict) or not isinstance(p.get("key"), str):
                raise BadManifest(f"rank {r}: every piece needs a string key")
            if p.get("dtype") not in DTYPES:
                raise BadManifest(f"{p['key']!r}: unknown dtype {p.get('dtype')!r}")
            if not isinstance(p.get("main"), bool):
                raise BadManifest(f"{p['key']!r}: main must be true or false")
            g = _dims(p, "global_shape")
            o, s = _dims(p, "offsets", len(g)), _dims(p, "local_shape", len(g))
            if any(oi + si > gi for oi, si, gi in zip(o, s, g)):
                raise BadManifest(f"{p['key']!r}: offsets + local_shape exceed global_shape on rank {r}")
            if (p["key"], tuple(o)) in seen:
                raise BadManifest(f"rank {r}: {p['key']!r} at {o} appears twice")
            seen.add((p["key"], tuple(o)))
            if p["main"]:
                main_bytes += numel(s) * itemsize(p["dtype"])
    if main_bytes != total:
        raise BadManifest(f"the main pieces hold {main_bytes} bytes but the manifest says {total}")
    keys = [sorted(p["key"] for p in pieces) for pieces in ranks]
    if any(k != keys[0] for k in keys):
        raise BadManifest("every rank must hold a piece of every tensor (DTensors span the whole mesh)")
    return m


def one_tensor_per_part(ranks):
    """Each rank's pieces with at most one piece per key.

    A rank may hold several pieces of one tensor (Megatron's fused GLU weight: rows of the
    gate half and of the up half). A DTensor has one local piece per rank, so the i-th
    piece of every rank becomes its own tensor, `KEY.partI`, spanning those pieces. The
    bytes are the same; only the keys differ.
    """
    out = [[] for _ in ranks]
    for key in sorted({p["key"] for p in ranks[0]}):
        held = [sorted((p for p in pieces if p["key"] == key), key=lambda p: p["offsets"]) for pieces in ranks]
        if len({len(h) for h in held}) != 1:
            raise BadManifest(f"{key!r}: ranks hold different numbers of pieces")
        if len(held[0]) == 1:
            for r, h in enumerate(held):
                out[r].append(h[0])
            continue
        for i in range(len(held[0])):
            parts = [h[i] for h in held]
            g = parts[0]["global_shape"]
            axes = {d for p in parts for d in range(len(g)) if p["local_shape"][d] != g[d]}
            if len(axes) != 1 or any(p["global_shape"] != g for p in parts):
                raise BadManifest(f"{key!r}: piece {i} of each rank is not a split along one axis")
            d = axes.pop()
            lo = min(p["offsets"][d] for p in parts)
            hi = max(p["offsets"][d] + p["local_shape"][d] for p in parts)
            for r, p in enumerate(parts):
                gs, off = list(g), list(p["offsets"])
                gs[d], off[d] = hi - lo, off[d] - lo
                out[r].append(dict(p, key=f"{key}.part{i}", global_shape=gs, offsets=off))
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


ITEMSIZE = {"bool": 1, "u8": 1, "i8": 1, "f8_e4m3": 1, "f8_e5m2": 1, "i16": 2, "f16": 2, "bf16": 2}


def itemsize(dtype):
    return ITEMSIZE.get(dtype, 8 if dtype in ("i64", "f64") else 4)


def placement(piece, rank, world):
    """("replicate",) or ("shard", axis), or BadManifest when DTensor cannot express it."""
    g, o, s = piece["global_shape"], piece["offsets"], piece["local_shape"]
    if list(s) == list(g):
        return ("replicate",)
    split = [d for d in range(len(g)) if s[d] != g[d]]
    if len(split) != 1 or any(o[d] for d in range(len(g)) if d != split[0]):
        raise BadManifest(f"{piece['key']!r} on rank {rank} is split along more than one axis")
    d = split[0]
    chunk = -(-g[d] // world)  # torch.chunk's even split, the last piece shorter
    start = min(rank * chunk, g[d])
    if o[d] != start or s[d] != min(chunk, g[d] - start):
        raise BadManifest(
            f"{piece['key']!r} on rank {rank}: rows [{o[d]}, {o[d] + s[d]}) of {g[d]} are not "
            f"what Shard({d}) gives rank {rank} of {world}"
        )
    return ("shard", d)


# ---------------------------------------------------------------------------------------
# Plain IO: the ceilings


def as_bytes(t):
    """A tensor's bytes as a flat uint8 numpy array (no copy for contiguous tensors)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write(dir_, buffers):
    """One sequential write of `buffers` to one file, fsync of it and the directory; seconds."""
    fresh_dir(dir_)
    t = time.perf_counter()
    fd = os.open(os.path.join(dir_, "plain.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in buffers:
            mv = memoryview(b)
            while len(mv):
                mv = mv[os.write(fd, mv) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(dir_)
    return time.perf_counter() - t


def files_under(dir_):
    out = []
    for root, _, names in os.walk(dir_):
        out.extend(os.path.join(root, n) for n in names)
    return sorted(out)


def plain_read(dir_, buf):
    """Reads every file under `dir_` in turn into `buf` (a bytearray, grown if needed); seconds."""
    files = files_under(dir_)
    need = max((os.path.getsize(f) for f in files), default=0)
    if len(buf) < need:
        buf.extend(bytes(need - len(buf)))
    mv = memoryview(buf)
    t = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            n = os.fstat(f.fileno()).st_size
            got = 0
            while got < n:
                k = f.readinto(mv[got:n])
                if not k:
                    raise OSError(f"{path} ended at {got} of {n} bytes")
                got += k
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------
# The 2-process part


def fill(t, key, offsets):
    """Deterministic values per (key, offsets): replicated copies agree, pieces differ."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{key}@{offsets}".encode()))
    flat = t.reshape(-1)
    if t.dtype.is_floating_point and t.element_size() >= 2:
        flat.uniform_(-1.0, 1.0, generator=g)
    else:
        flat.view(torch.uint8).copy_(torch.randint(0, 256, (flat.numel() * t.element_size(),), dtype=torch.uint8, generator=g))


def worker(rank, world, port, manifest, workdir, rounds, result_path):
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.set_num_threads(1)  # one core per process, as the engine's ranks
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    try:
        mesh = init_device_mesh("cpu", (world,))
        pieces = sorted(manifest["ranks"][rank], key=lambda p: p["key"])
        total = manifest["bytes"]

        def dtensors(locals_):
            out = {}
            for p, t in zip(pieces, locals_):
                kind = placement(p, rank, world)
                pl = [Replicate()] if kind[0] == "replicate" else [Shard(kind[1])]
                g = p["global_shape"]
                stride = tuple(numel(g[d + 1 :]) for d in range(len(g)))
                out[p["key"]] = DTensor.from_local(t, mesh, pl, shape=torch.Size(g), stride=stride)
            return out

        dt = lambda p: getattr(torch, DTYPES[p["dtype"]])  # noqa: E731
        src = [torch.empty(p["local_shape"], dtype=dt(p)) for p in pieces]
        for p, t in zip(pieces, src):
            fill(t, p["key"], p["offsets"])
        dst = [torch.zeros(p["local_shape"], dtype=dt(p)) for p in pieces]
        state, targets = dtensors(src), dtensors(dst)
        mains = [(p["key"], s, d) for p, s, d in zip(pieces, src, dst) if p["main"]]

        def timed(fn):
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t

        def on_rank0(fn):
            return lambda: fn() if rank == 0 else None

        def prepare(path):
            if rank == 0:
                fresh_dir(path)
            dist.barrier()

        def alternating(engine, ceiling, n=None):
            out = []
            for i in range(n or rounds):
                if i % 2 == 0:
                    e = engine()
                    out.append((e, ceiling()))
                else:
                    c = ceiling()
                    out.append((engine(), c))
            return out

        def check(what):
            for (key, s, d) in mains:
                if not torch.equal(s.view(-1).view(torch.uint8), d.view(-1).view(torch.uint8)):
                    raise RuntimeError(f"{what}: {key!r} came back different on rank {rank}")
            for d in dst:
                d.zero_()

        # The ceiling's bytes on rank 0: its own main pieces, then random bytes for the rest.
        ceiling_buffers = []
        if rank == 0:
            own = [as_bytes(s) for (_, s, _) in mains]
            rest = total - sum(b.size for b in own)
            ceiling_buffers = own + [torch.randint(0, 256, (rest,), dtype=torch.uint8).numpy()]
        plain_dir = os.path.join(workdir, "plain")
        read_buf = bytearray()

        # DCP save vs a plain write + fsync.
        dcp_dir = os.path.join(workdir, "dcp")

        def dcp_save():
            prepare(dcp_dir)
            return timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir)))

        def write_ceiling():
            return timed(on_rank0(lambda: plain_write(plain_dir, ceiling_buffers)))

        dcp_save_rounds = alternating(dcp_save, write_ceiling)
        dcp_disk = sum(os.path.getsize(f) for f in files_under(dcp_dir))

        # DCP load, warm, vs a plain read of its files.
        dcp.load(targets, storage_reader=dcp.FileSystemReader(dcp_dir))
        check("DCP load")
        if rank == 0:
            plain_read(dcp_dir, read_buf)

        def dcp_load():
            return timed(lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(dcp_dir)))

        dcp_load_rounds = alternating(dcp_load, lambda: timed(on_rank0(lambda: plain_read(dcp_dir, read_buf))))

        # dckpt's Python package on the same DTensors, each round against DCP's own.
        dckpt_rounds = dckpt_figures_rounds(rank, rounds, state, targets, check, timed, prepare, alternating, dcp_dir, workdir)
        # Megatron's torch_dist strategy on the same pieces, against dckpt.torch.
        torch_dist = torch_dist_rounds(rank, world, pieces, src, dst, check, timed, prepare, alternating, workdir)
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)

        # safetensors: each rank its main pieces in its own file.
        st_dir = os.path.join(workdir, "safetensors")
        st_file = os.path.join(st_dir, f"rank-{rank}.safetensors")

        def st_save_rank():
            save_file({k: s for (k, s, _) in mains}, st_file)
            fd = os.open(st_file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(st_dir)

        def st_save():
            prepare(st_dir)
            return timed(st_save_rank)

        st_save_rounds = alternating(st_save, write_ceiling)
        st_disk = sum(os.path.getsize(f) for f in files_under(st_dir))
        if rank == 0:
            shutil.rmtree(plain_dir, ignore_errors=True)

        def st_load_rank():
            loaded = load_file(st_file)
            for (k, _, d) in mains:
                d.copy_(loaded[k])
            del loaded

        st_load_rank()
        check("safetensors load")
        if rank == 0:
            plain_read(st_dir, read_buf)
        st_load_rounds = alternating(
            lambda: timed(st_load_rank), lambda: timed(on_rank0(lambda: plain_read(st_dir, read_buf)))
        )
        vs_st = dckpt_vs_safetensors_rounds(rank, state, targets, check, timed, prepare, alternating, st_load_rank, workdir)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(st_dir, ignore_errors=True)
            with open(result_path, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "dcp_save": dcp_save_rounds,
                        "dcp_load": dcp_load_rounds,
                        "st_save": st_save_rounds,
                        "st_load": st_load_rounds,
                        "vs_st": vs_st,
                        "dcp_disk": dcp_disk,
                        "st_disk": st_disk,
                        "dckpt": dckpt_rounds,
                        "torch_dist": torch_dist,
                    },
                    f,
                )
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# dckpt's Python package (when the Python has it: `pip install .`)


def has_dckpt():
    """The reason dckpt's Python package is not usable here, or None."""
    try:
        import dckpt.dcp  # noqa: F401
        import dckpt.torch  # noqa: F401
    except Exception as e:  # any import failure means: not usable here
        return f"{type(e).__name__}: {e}"
    return None


def dckpt_vs_safetensors_rounds(rank, state, targets, check, timed, prepare, alternating, st_load, workdir):
    """Rounds of (dckpt.torch.load seconds, safetensors load seconds), warm: dckpt's load
    of the same DTensors, every byte checked, against `st_load` (each rank's load_file of
    its own file and the copy into the same preallocated tensors); None where dckpt is not
    installed."""
    if has_dckpt() is not None:
        return None
    import dckpt.torch as dt

    ck_dir = os.path.join(workdir, "dckpt-vs-safetensors")
    prepare(ck_dir)
    dt.save(state, ck_dir)
    dt.load(targets, ck_dir)
    check("dckpt.torch load")
    rounds = alternating(lambda: timed(lambda: dt.load(targets, ck_dir)), lambda: timed(st_load))
    check("dckpt.torch load and safetensors load")
    return rounds


def engine_rounds(rounds):
    """Rounds of the dckpt.torch-vs-engine pairs."""
    return max(3 * rounds, 9)


def dckpt_figures_rounds(rank, rounds, state, targets, check, timed, prepare, alternating, dcp_dir, workdir):
    """Rounds of (dckpt seconds, DCP seconds): dckpt.torch save vs dcp.save, dckpt.torch
    load vs dcp.load, and dcp.load through dckpt's DckptStorageReader vs through DCP's
    FileSystemReader; None where dckpt is not installed."""
    if has_dckpt() is not None:
        return None
    import torch.distributed.checkpoint as dcp

    import dckpt.torch as dt
    from dckpt.dcp import DckptStorageReader, DckptStorageWriter

    ck_dir = os.path.join(workdir, "dckpt")

    def dckpt_save():
        prepare(ck_dir)
        return timed(lambda: dt.save(state, ck_dir))

    def dcp_save():
        prepare(dcp_dir)
        return timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir)))

    save = alternating(dckpt_save, dcp_save)
    dt.load(targets, ck_dir)
    check("dckpt.torch load")
    dcp.load(targets, storage_reader=DckptStorageReader(ck_dir))
    check("dcp.load through DckptStorageReader")
    dcp.load(targets, storage_reader=dcp.FileSystemReader(dcp_dir))
    check("DCP load")
    dcp_load = lambda: timed(lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(dcp_dir)))  # noqa: E731
    load = alternating(lambda: timed(lambda: dt.load(targets, ck_dir)), dcp_load)
    reader = alternating(lambda: timed(lambda: dcp.load(targets, storage_reader=DckptStorageReader(ck_dir))), dcp_load)

    # dcp.save itself, its writer swapped: DckptStorageWriter vs FileSystemWriter.
    def writer_save():
        prepare(ck_dir)
        return timed(lambda: dcp.save(state, storage_writer=DckptStorageWriter(ck_dir)))

    writer = alternating(writer_save, dcp_save)
    dcp.load(targets, storage_reader=DckptStorageReader(ck_dir))
    check("dcp.load of DckptStorageWriter's checkpoint")

    # The engine itself from the same processes over the same gloo collective: descriptors
    # of the same DTensors' local tensors, built once, handed to the native checkpointer,
    # so only dckpt.torch's own Python work differs between the two sides.
    ckpt, _ = dt._checkpointer(None, None)

    from dckpt import tensor_piece

    def descriptors(sd):
        out = []
        for key, leaf in sd.items():
            local, offset, gshape, is_main = dt._dtensor_piece(key, leaf)
            ptr, nbytes = dt._descriptor_buffer(local)
            shape = list(local.shape)
            out.append(tensor_piece(key, dt.dtype_name(local.dtype), gshape, offset, shape, ptr, nbytes, main=is_main))
        return out

    save_desc, load_desc = descriptors(state), descriptors(targets)
    layout = {"world_size": str(ckpt.world_size)}

    def engine_save():
        prepare(ck_dir)
        return timed(lambda: ckpt.save(ck_dir, save_desc, [], layout=layout))

    # The two sides differ by a millisecond of Python on a large state, much less than one
    # round's disk noise: these pairs are cheap, so they get more rounds than the rest.
    n = engine_rounds(rounds)
    engine_vs_save = alternating(dckpt_save, engine_save, n)
    ckpt.load(ck_dir, load_desc, [])
    check("the engine's load")
    engine_load = lambda: timed(lambda: ckpt.load(ck_dir, load_desc, []))  # noqa: E731
    engine_vs_load = alternating(lambda: timed(lambda: dt.load(targets, ck_dir)), engine_load, n)
    if rank == 0:
        shutil.rmtree(ck_dir, ignore_errors=True)
    return {
        "save": save, "load": load, "reader": reader, "writer": writer,
        "engine_save": engine_vs_save, "engine_load": engine_vs_load,
    }


def has_megatron():
    """The reason megatron-core's torch_dist strategy is not usable here, or None."""
    try:
        import megatron.core.dist_checkpointing  # noqa: F401
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: F401
    except Exception as e:  # any import failure means: not usable here
        return f"{type(e).__name__}: {e}"
    return None


def torch_dist_rounds(rank, world, pieces, src, dst, check, timed, prepare, alternating, workdir):
    """Rounds of (dckpt seconds, torch_dist seconds) for save and for warm load of the same
    pieces as Megatron ShardedTensors (dckpt.torch gets them as dckpt.torch.Shard with the
    same replica ids); None without megatron-core or dckpt."""
    if has_megatron() is not None or has_dckpt() is not None:
        return None
    import torch
    import megatron.core.dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    import dckpt.torch as dt

    # torch_dist keeps a few flags and syncs on the current CUDA device; this bench has
    # none, so those calls go to the CPU (for this comparison only).
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    import warnings

    # torch_dist calls DCP's deprecated load_state_dict on every load: it is known.
    warnings.filterwarnings("ignore", message=".*load_state_dict.*deprecated")

    def sharded(tensors):
        out, ours = {}, {}
        for p, t in zip(pieces, tensors):
            rid = 0 if p["main"] else rank
            g, o = tuple(p["global_shape"]), tuple(p["offsets"])
            out[p["key"]] = ShardedTensor(
                key=p["key"], data=t, dtype=t.dtype, local_shape=tuple(t.shape), global_shape=g,
                global_offset=o, axis_fragmentations=None, replica_id=rid,
            )
            ours[p["key"]] = dt.Shard(t, g, o, replica_id=rid)
        return out, ours

    (m_src, d_src), (m_dst, d_dst) = sharded(src), sharded(dst)
    m_dir, d_dir = os.path.join(workdir, "torch_dist"), os.path.join(workdir, "dckpt-shards")

    def m_save():
        prepare(m_dir)
        return timed(lambda: mdc.save(m_src, m_dir, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1)))

    def d_save():
        prepare(d_dir)
        return timed(lambda: dt.save(d_src, d_dir))

    save = alternating(d_save, m_save)
    mdc.load(m_dst, m_dir)
    check("torch_dist load")
    dt.load(d_dst, d_dir)
    check("dckpt.torch load of Shards")
    load = alternating(lambda: timed(lambda: dt.load(d_dst, d_dir)), lambda: timed(lambda: mdc.load(m_dst, m_dir)))
    if rank == 0:
        shutil.rmtree(m_dir, ignore_errors=True)
        shutil.rmtree(d_dir, ignore_errors=True)
    return {"save": save, "load": load}


# ---------------------------------------------------------------------------------------
# Many small tensors, one process


def small_tensors(workdir, rounds):
    """Rounds of (seconds for 20,000 × 4 KiB, seconds for one 78 MiB tensor), DCP save + load."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    # Without a process group DCP warns on every call that it assumes one process: it is meant.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    n, elems = 20_000, 1024
    data = torch.rand(n, elems, generator=torch.Generator().manual_seed(7))
    cases = {
        "small": {f"small.{i:05d}": data[i].clone() for i in range(n)},
        "large": {"large": data.clone()},
    }
    targets = {k: {kk: torch.zeros_like(v) for kk, v in sd.items()} for k, sd in cases.items()}
    path = os.path.join(workdir, "small")

    def run(which):
        sd, tgt = cases[which], targets[which]
        fresh_dir(path)
        t = time.perf_counter()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        dcp.load(tgt, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        s = time.perf_counter() - t
        if not all(torch.equal(sd[k], tgt[k]) for k in sd):
            raise RuntimeError(f"DCP round trip of the {which} case changed the values")
        for v in tgt.values():
            v.zero_()
        return s

    def run_dckpt_once():
        import dckpt.torch as dt

        sd, tgt = cases["small"], targets["small"]
        fresh_dir(path)
        t = time.perf_counter()
        dt.save(sd, path)
        dt.load(tgt, path)
        s = time.perf_counter() - t
        if not all(torch.equal(sd[k], tgt[k]) for k in sd):
            raise RuntimeError("the dckpt.torch round trip of the small case changed the values")
        for v in tgt.values():
            v.zero_()
        return s

    def run_dckpt():
        # One DCP run is 8-10 s, a sum over 20,000 tensors that averages the disk's
        # hiccups away; one dckpt run is about 0.1 s, which a single hiccup (a first touch
        # of freshly reclaimed pages doubles the kernel's copy time on this VM) can double.
        # So dckpt's side of a round is the median of three runs, not the best of them.
        return statistics.median(run_dckpt_once() for _ in range(SMALL_DCKPT_RUNS))

    def save_small(writer):
        fresh_dir(path)
        t = time.perf_counter()
        dcp.save(cases["small"], storage_writer=writer(path), no_dist=True)
        return time.perf_counter() - t

    def writer_small():
        from dckpt.dcp import DckptStorageWriter

        return save_small(DckptStorageWriter)

    out, vs_dckpt, vs_writer = [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            a = run("small")
            out.append((a, run("large")))
        else:
            b = run("large")
            out.append((run("small"), b))
        if has_dckpt() is None:
            # (dckpt, DCP) on the small case, alternating which goes first
            if i % 2 == 0:
                d = run_dckpt()
                vs_dckpt.append((d, run("small")))
            else:
                c = run("small")
                vs_dckpt.append((run_dckpt(), c))
            if i % 2 == 0:
                w = writer_small()
                vs_writer.append((w, save_small(dcp.FileSystemWriter)))
            else:
                c = save_small(dcp.FileSystemWriter)
                vs_writer.append((writer_small(), c))
    per_item = writer_cost_per_item(cases["small"], rounds) if has_dckpt() is None else None
    shutil.rmtree(path, ignore_errors=True)
    return out, vs_dckpt, vs_writer, per_item, data.numel() * data.element_size()


def writer_cost_per_item(state, rounds):
    """Microseconds per write item of DckptStorageWriter's own mapping of DCP's plan onto
    dckpt's pieces (resolving each item, describing it), best of `rounds`: what the writer
    adds in Python to DCP's planner and dckpt's engine."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dckpt.dcp import DckptStorageWriter

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = planner.create_local_plan()
    writer = DckptStorageWriter("unused")
    writer.prepare_local_plan(plan)
    best = None
    for _ in range(max(rounds, 3)):
        t = time.perf_counter()
        pieces = writer._pieces(plan, planner, frozenset())
        s = time.perf_counter() - t
        del pieces
        best = s if best is None else min(best, s)
    return best / len(plan.items) * 1e6


# ---------------------------------------------------------------------------------------


def figure(name, rounds, nbytes, note):
    """GB/s medians of both sides and the median of per-round ratios, which the note lists
    in round order (as the Rust figures do), so that a run shows its spread as well."""
    ratios = [c / e for e, c in rounds]
    return {
        "name": name,
        "value": statistics.median(nbytes / e / GB for e, _ in rounds),
        "ceiling": statistics.median(nbytes / c / GB for _, c in rounds),
        "ratio": statistics.median(ratios),
        "note": f"{note}; ratio per round: " + ", ".join(f"{r:.3f}" for r in ratios),
    }


def missing_figure(name, note):
    return {"name": name, "value": None, "ceiling": None, "ratio": None, "note": note}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe", action="store_true", help="check the packages, print their versions")
    ap.add_argument("--manifest", help="the state, as written by dckpt bench")
    ap.add_argument("--dir", help="a scratch directory (removed afterwards)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    versions = probe()
    if args.probe:
        print(json.dumps(versions))
        return 0
    if not args.manifest or not args.dir:
        ap.error("--manifest and --dir are required")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        manifest = read_manifest(args.manifest)
        manifest["ranks"] = one_tensor_per_part(manifest["ranks"])
        world = len(manifest["ranks"])
        for r, pieces in enumerate(manifest["ranks"]):
            for p in pieces:
                placement(p, r, world)
    except BadManifest as e:
        print(f"bench_torch: bad manifest: {e}", file=sys.stderr)
        return BAD_INPUT

    import torch.multiprocessing as mp

    total = manifest["bytes"]
    fresh_dir(args.dir)
    result_path = os.path.join(args.dir, "ranks.json")
    print(
        f"bench_torch: torch {versions['torch']}, safetensors {versions['safetensors']}: "
        f"{total / 2**30:.2f} GiB on {world} processes (gloo), {args.rounds} rounds",
        file=sys.stderr,
    )
    try:
        mp.spawn(
            worker,
            args=(world, free_port(), manifest, args.dir, args.rounds, result_path),
            nprocs=world,
            join=True,
        )
        with open(result_path, encoding="utf-8") as f:
            r = json.load(f)
        small, small_dckpt, small_writer, per_item, small_bytes = small_tensors(args.dir, args.rounds)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)

    tv, sv = versions["torch"], versions["safetensors"]
    write = f"one plain sequential write + fsync of the same {total} bytes"
    read = "a plain read of the same files"
    figures = [
        figure(
            "dcp_save_vs_write",
            r["dcp_save"],
            total,
            f"GB/s: torch {tv} DCP save ({world} processes, gloo, DTensors; FileSystemWriter fsyncs "
            f"each file, not the directory; {r['dcp_disk']} bytes on disk) vs {write}",
        ),
        figure(
            "dcp_load_warm_vs_read",
            r["dcp_load"],
            total,
            f"GB/s: DCP load into preallocated DTensors, page cache warm, no checksums vs {read}",
        ),
        figure(
            "safetensors_save_vs_write",
            r["st_save"],
            total,
            f"GB/s: safetensors {sv} save_file of each rank's main pieces + fsync of file and "
            f"directory (save_file does neither; {r['st_disk']} bytes on disk) vs {write}",
        ),
        figure(
            "safetensors_load_warm_vs_read",
            r["st_load"],
            total,
            f"GB/s: load_file of each rank's own file + copy into preallocated tensors, warm vs {read}",
        ),
        figure(
            "dcp_small_tensors_vs_large",
            small,
            small_bytes,
            "GB/s of DCP save + load, one process: 20,000 tensors of 4 KiB vs one tensor of the same 78 MiB",
        ),
    ]
    no_dckpt = has_dckpt()
    dk = r.get("dckpt")
    dckpt_figs = [
        ("dckpt_torch_save_vs_dcp", "save", "GB/s: dckpt.torch.save of the same DTensors (its plan reused after the "
         "first round) vs torch DCP save (FileSystemWriter); ratio = speedup"),
        ("dckpt_torch_load_warm_vs_dcp", "load", "GB/s: dckpt.torch.load into the preallocated DTensors, warm, every "
         "byte checksummed vs DCP load (FileSystemReader, no checksums); ratio = speedup"),
        ("dckpt_dcp_reader_load_warm_vs_dcp", "reader", "GB/s: dcp.load through dckpt.dcp.DckptStorageReader of "
         "dckpt's checkpoint vs through FileSystemReader of DCP's, warm; ratio = speedup"),
        ("dckpt_dcp_writer_save_vs_dcp", "writer", "GB/s: dcp.save through dckpt.dcp.DckptStorageWriter (DCP's "
         "planner, dckpt's coverage proof, replica check, checksums and commit) vs through FileSystemWriter; "
         "ratio = speedup"),
    ]
    for name, field, note in dckpt_figs:
        if dk is None:
            figures.append(missing_figure(name, f"dckpt's Python package is not importable: {no_dckpt}"))
        else:
            figures.append(figure(name, dk[field], total, note))
    if r.get("vs_st") is None:
        figures.append(missing_figure("load_warm_vs_safetensors", f"dckpt's Python package is not importable: {no_dckpt}"))
    else:
        figures.append(
            figure(
                "load_warm_vs_safetensors",
                r["vs_st"],
                total,
                f"GB/s: dckpt.torch.load into the preallocated DTensors, warm, every byte checksummed vs "
                f"safetensors {sv} load_file of each rank's own file + copy into the same tensors, nothing checked",
            )
        )
    if small_dckpt:
        figures.append(
            figure(
                "dckpt_torch_small_tensors_vs_dcp",
                small_dckpt,
                small_bytes,
                "GB/s of save + load, one process: 20,000 tensors of 4 KiB, dckpt.torch vs torch DCP; ratio = speedup",
            )
        )
    else:
        figures.append(missing_figure("dckpt_torch_small_tensors_vs_dcp", f"dckpt's Python package: {no_dckpt}"))
    if small_writer:
        figures.append(
            figure(
                "dckpt_dcp_writer_small_tensors_vs_dcp",
                small_writer,
                small_bytes,
                "GB/s of dcp.save, one process: 20,000 tensors of 4 KiB through DckptStorageWriter vs "
                "FileSystemWriter; ratio = speedup",
            )
        )
        figures.append(
            {
                "name": "dckpt_dcp_writer_us_per_item",
                "value": per_item,
                "ceiling": None,
                "ratio": None,
                "note": "µs per write item of DckptStorageWriter's own Python (DCP's plan items onto dckpt's "
                "pieces), 20,000 tensors of 4 KiB, best of the rounds",
            }
        )
    else:
        for name in ("dckpt_dcp_writer_small_tensors_vs_dcp", "dckpt_dcp_writer_us_per_item"):
            figures.append(missing_figure(name, f"dckpt's Python package: {no_dckpt}"))
    tdr = r.get("torch_dist")
    for name, field, note in (
        ("dckpt_torch_save_vs_torch_dist", "save", "GB/s: dckpt.torch.save of the pieces as dckpt.torch.Shard vs "
         "megatron-core's torch_dist strategy (dist_checkpointing.save of the same ShardedTensors); ratio = speedup"),
        ("dckpt_torch_load_warm_vs_torch_dist", "load", "GB/s: dckpt.torch.load vs dist_checkpointing.load "
         "(torch_dist) into the same preallocated tensors, warm; ratio = speedup"),
    ):
        if tdr is None:
            why = has_megatron() or f"dckpt's Python package: {no_dckpt}"
            figures.append(missing_figure(name, f"megatron-core's torch_dist strategy is not usable: {why}"))
        else:
            figures.append(figure(name, tdr[field], total, note))
    for name, field, what in (
        ("dckpt_torch_save_vs_engine", "engine_save", "save"),
        ("dckpt_torch_load_warm_vs_engine", "engine_load", "load"),
    ):
        if dk is None:
            figures.append(missing_figure(name, f"dckpt's Python package is not importable: {no_dckpt}"))
        else:
            note = (f"GB/s: dckpt.torch {what} of the DTensors vs the engine's {what} of the same tensors from the "
                    f"same {world} processes and gloo collective, its descriptors built once (no per-call Python)")
            figures.append(figure(name, dk[field], total, note))
    json.dump(figures, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # report, do not dump a bare traceback for expected failures
        print(f"bench_torch: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
