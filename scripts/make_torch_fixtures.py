#!/usr/bin/env python3
"""Writes the torch_dist / DCP fixtures under tests/fixtures/torch/ with real PyTorch.

Not run by CI (it needs torch, and megatron-core for the Megatron fixtures). Each fixture is
a checkpoint directory written by two ranks over gloo on loopback (torch.multiprocessing),
plus `expected.json`: for every tensor its dtype, global shape and the hex of its row-major
bytes (bf16 as its raw bits), and for every object its key. From the repository root:

    $TORCH215/bin/python scripts/make_torch_fixtures.py dcp-2.15
    $TORCH23/bin/python  scripts/make_torch_fixtures.py dcp-2.3
    $TORCH215/bin/python scripts/make_torch_fixtures.py megatron-0.16.1
    $TORCH215/bin/python scripts/make_torch_fixtures.py etp-bug etp-ok

    $TORCH215/bin/python scripts/make_torch_fixtures.py hostile

where $TORCH215 is a venv with torch 2.15.0 and megatron-core 0.16.1 installed `--no-deps`
with packaging and psutil (`target/py-venv`, which `cargo xtask test` makes, has them), and
$TORCH23 one with `pip install torch==2.3.1 "numpy<2"`. A fixture directory is replaced whole.

The DCP fixtures hold DTensors split by rows, by columns and unevenly (5 rows over 2
ranks), bf16, fp32 and int64, a transposed tensor saved as a plain tensor (its stride is
kept in the item's data.pkl), a replicated tensor and plain Python values (DCP writes them
as opaque BYTE_IO items). The Megatron fixtures are `dist_checkpointing.save` with the
torch_dist strategy on CPU: CUDA calls the strategy makes are stubbed out. `etp-bug` is form
(b) of the ETP bug: an expert tensor with its true global shape whose second ETP shard is
marked as a replica, so that only one shard is written; the planner's volume check that
recent PyTorch releases run is switched off for it, as older releases and custom planners
never had it. `etp-ok` is the same state with correct replica ids. `hostile` writes
`.metadata` variants of `dcp-2.15` (which must exist) whose items lie past their file's end
or whose offsets and sizes overflow 64 bits, or whose chunks overlap by what they leave
uncovered, for the tests to put in a copy of `dcp-2.15`.
"""

import json
import os
import shutil
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "torch")
WORLD = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(shape, dtype, seed):
    """Deterministic, distinct values in every position (small integers in float types so
    that bf16 holds them exactly)."""
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.int64) * 7 + seed * 1000 + 3
    if dtype.is_floating_point:
        return (base % 251 - 125).to(dtype).reshape(shape) / 4
    return (base * 1_000_003).to(dtype).reshape(shape)


def hexbytes(t):
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def dcp_global_tensors():
    return {
        "row.weight": values((4, 6), torch.bfloat16, 1),
        "col.weight": values((3, 4), torch.float32, 2),
        "uneven.weight": values((5, 3), torch.float32, 3),
        "counts": values((6,), torch.int64, 4),
        # A plain tensor that is a transposed view: torch.save keeps its stride.
        "transposed": values((2, 3), torch.float32, 5).T,
        "replicated": values((3,), torch.float32, 6),
        "bf16.replicated": values((2, 2), torch.bfloat16, 7),
    }


def dcp_rank(rank, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import torch.distributed.checkpoint as dcp

    try:
        from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.3: DTensor lived under torch.distributed._tensor
        from torch.distributed._tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(WORLD)))
    g = dcp_global_tensors()
    sd = {
        "row.weight": distribute_tensor(g["row.weight"], mesh, [Shard(0)]),
        "col.weight": distribute_tensor(g["col.weight"], mesh, [Shard(1)]),
        "uneven.weight": distribute_tensor(g["uneven.weight"], mesh, [Shard(0)]),
        "counts": distribute_tensor(g["counts"], mesh, [Shard(0)]),
        "transposed": g["transposed"],
        "replicated": g["replicated"],
        "bf16.replicated": distribute_tensor(g["bf16.replicated"], mesh, [Replicate()]),
        "step": 7,
        "blob": b"opaque bytes",
        "config": {"lr": 0.5, "name": "fixture"},
    }
    assert not sd["transposed"].is_contiguous()
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def stub_cuda():
    # Megatron's torch_dist strategy synchronizes the device and builds a tensor on the
    # current device; neither exists on a CPU-only machine.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def megatron_global_tensors(etp):
    if etp is not None:
        return {
            # [experts, out, in]: the ETP split is along `out`.
            "decoder.experts.fc1.weight": values((2, 8, 4), torch.bfloat16, 11),
            "decoder.experts.fc2.weight": values((2, 4, 8), torch.float32, 12),
            "decoder.norm.weight": values((4,), torch.float32, 13),
        }
    return {
        "embedding.weight": values((6, 4), torch.bfloat16, 21),  # TP on rows
        "decoder.linear_proj.weight": values((4, 6), torch.float32, 22),  # TP on columns
        "decoder.layers.qkv.weight": values((2, 6, 4), torch.float32, 23),  # layer axis + TP
        "decoder.norm.weight": values((4,), torch.float32, 24),  # replicated over TP
    }


def megatron_rank(rank, port, out, etp):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    stub_cuda()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = megatron_global_tensors(etp)

    def tp_piece(t, axis):
        return t.chunk(WORLD, dim=axis)[rank].clone()

    if etp is None:
        sd = {
            "embedding": ShardedTensor.from_rank_offsets(
                "embedding.weight", tp_piece(g["embedding.weight"], 0), (0, rank, WORLD)
            ),
            "proj": ShardedTensor.from_rank_offsets(
                "decoder.linear_proj.weight",
                tp_piece(g["decoder.linear_proj.weight"], 1),
                (1, rank, WORLD),
            ),
            "qkv": [
                # Each layer one ShardedTensor with a prepended layer axis.
                ShardedTensor.from_rank_offsets(
                    "decoder.layers.qkv.weight",
                    tp_piece(g["decoder.layers.qkv.weight"][layer], 0),
                    (0, layer, 2),
                    (1, rank, WORLD),
                    prepend_axis_num=1,
                )
                for layer in range(2)
            ],
            "norm": ShardedTensor.from_rank_offsets(
                "decoder.norm.weight", g["decoder.norm.weight"].clone(), replica_id=(0, rank, 0)
            ),
            "extra_state": ShardedObject(
                "decoder.extra_state", {"rank": rank, "fp8": [1, 2]}, (WORLD,), (rank,), replica_id=0
            ),
            "iteration": 42,
            "args": {"tp": WORLD, "name": "megatron-fixture"},
        }
    else:
        # ETP=2 over the two ranks. Correct ids: every ETP shard is a main replica at its
        # own offset. Form (b) of the bug: the shards are at their true offsets in the true
        # global shape, but the second ETP rank's shard is marked as a replica, so it is
        # never written.
        rid = (0, 0, 0) if etp == "ok" else (0, rank, 0)
        sd = {
            "fc1": ShardedTensor.from_rank_offsets(
                "decoder.experts.fc1.weight",
                tp_piece(g["decoder.experts.fc1.weight"], 1),
                (1, rank, WORLD),
                replica_id=rid,
            ),
            "fc2": ShardedTensor.from_rank_offsets(
                "decoder.experts.fc2.weight",
                tp_piece(g["decoder.experts.fc2.weight"], 2),
                (2, rank, WORLD),
                replica_id=rid,
            ),
            "norm": ShardedTensor.from_rank_offsets(
                "decoder.norm.weight", g["decoder.norm.weight"].clone(), replica_id=(0, rank, 0)
            ),
        }
        if etp == "bug":
            import torch.distributed.checkpoint.default_planner as planner

            # Recent releases return the list of problems (empty when valid), older ones
            # a bool (True when valid).
            inspect_ret = planner._validate_global_plan.__annotations__.get("return")
            ok = [] if inspect_ret not in (bool, "bool") else True
            planner._validate_global_plan = lambda *a, **k: ok
    dist_checkpointing.save(sd, out, validate_access_integrity=(etp != "bug"))
    dist.barrier()
    dist.destroy_process_group()


def run(target, *args):
    port = free_port()
    mp.spawn(target, args=(port,) + args, nprocs=WORLD, join=True)


def write_expected(out, tensors, objects, extra):
    doc = {
        "torch_version": torch.__version__.split("+")[0],
        "tensors": {
            k: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "hex": hexbytes(t)}
            for k, t in sorted(tensors.items())
        },
        "objects": sorted(objects),
    }
    doc.update(extra)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def make(name):
    # Relative names, so that the checkpoint_id DCP records names no machine's paths.
    os.chdir(ROOT)
    out = name
    tmp = os.path.basename(tempfile.mkdtemp(prefix=name + ".", dir="."))
    if name.startswith("dcp-"):
        run(dcp_rank, tmp)
        write_expected(tmp, dcp_global_tensors(), ["blob", "config", "step"], {"format": "dcp"})
    elif name == "megatron-0.16.1":
        run(megatron_rank, tmp, None)
        write_expected(
            tmp,
            megatron_global_tensors(None),
            ["decoder.extra_state/shard_0_2", "decoder.extra_state/shard_1_2"],
            {"format": "torch_dist"},
        )
    elif name in ("etp-bug", "etp-ok"):
        etp = name.split("-")[1]
        run(megatron_rank, tmp, etp)
        g = megatron_global_tensors(etp)
        extra = {"format": "torch_dist"}
        if etp == "bug":
            # Only the first ETP shard of each expert tensor was written: the test checks
            # these tensors are reported covered 1/2, and does not read them whole.
            extra["incomplete"] = ["decoder.experts.fc1.weight", "decoder.experts.fc2.weight"]
        write_expected(tmp, g, [], extra)
    elif name == "hostile":
        make_hostile()
        return
    else:
        sys.exit(f"unknown fixture {name!r}")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {sorted(os.listdir(out))} {size} bytes")


def make_hostile():
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    os.makedirs("hostile", exist_ok=True)
    with open("dcp-2.15/.metadata", "rb") as f:
        base = f.read()

    def variant(name, edit):
        md = pickle.loads(base)
        edit(md)
        with open(os.path.join("hostile", name + ".metadata"), "wb") as f:
            pickle.dump(md, f)

    def item(md, fqn):
        return next(k for k in md.storage_data if k.fqn == fqn)

    def past_end(md):
        k = item(md, "row.weight")
        md.storage_data[k] = dataclasses.replace(md.storage_data[k], offset=1_000_000)

    def offset_overflow(md):
        k = item(md, "col.weight")
        md.storage_data[k] = dataclasses.replace(md.storage_data[k], offset=2**64 - 16, length=1577)

    def size_overflow(md):
        t = md.state_dict_metadata["counts"]
        t.size = torch.Size([2**40, 2**40])
        t.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2**40, 2**40]))]

    def overlap_gap(md):
        # counts' second chunk [3:6] moved to [2:5]: it overlaps the first by the element
        # it leaves uncovered, so the elements add up.
        t = md.state_dict_metadata["counts"]
        t.chunks[1] = ChunkStorageMetadata(offsets=torch.Size([2]), sizes=torch.Size([3]))
        k = next(k for k in md.storage_data if k.fqn == "counts" and k.offset == torch.Size([3]))
        info = md.storage_data.pop(k)
        md.storage_data[dataclasses.replace(k, offset=torch.Size([2]))] = info

    variant("offset-past-end", past_end)
    variant("offset-overflow", offset_overflow)
    variant("size-overflow", size_overflow)
    variant("overlap-gap", overlap_gap)
    print("hostile:", sorted(os.listdir("hostile")))


if __name__ == "__main__":
    os.makedirs(ROOT, exist_ok=True)
    for n in sys.argv[1:]:
        make(n)
