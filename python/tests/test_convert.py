"""Round trips of `dckpt convert` and `dckpt export` through the real readers: PyTorch's
`dcp.load`, Megatron-Core's `dist_checkpointing.load` and `safetensors.torch.load_file`.

Needs torch, megatron-core (0.16.1) and safetensors, and the `dckpt` binary (not the dckpt
Python package): its path is `DCKPT_BIN`, default `target/ci/dckpt` under the repository
root; without one every test is skipped, saying so. Run with

    DCKPT_BIN=target/ci/dckpt target/py-venv/bin/python -m pytest python/tests/test_convert.py

Any torch from 2.3 on: with torch 2.3.1 (and no megatron-core or safetensors installed) the
DCP tests run and the others are skipped, naming the missing package.

Every comparison is bit for bit: tensors as their bytes (`view(torch.uint8)`), against the
values the fixture generator recorded (`tests/fixtures/torch/*/expected.json`) or the
tensors the test saved itself.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "torch")
DCKPT = os.environ.get("DCKPT_BIN") or os.path.join(ROOT, "target", "ci", "dckpt")

if os.environ.get("DCKPT_BIN") and not os.access(DCKPT, os.X_OK):
    # Named explicitly (cargo xtask test does): a missing binary is a failure, not a skip.
    raise RuntimeError(f"DCKPT_BIN={DCKPT} is not an executable")

pytestmark = pytest.mark.skipif(
    not os.access(DCKPT, os.X_OK),
    reason=f"no dckpt binary at {DCKPT} (build it with `cargo build -p dckpt-cli --profile ci` or set DCKPT_BIN)",
)


def dckpt(*args):
    """Runs the binary with --json and returns what it printed; fails the test naming the
    command and its stderr when it exits non-zero."""
    cmd = [DCKPT, *args, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}: {p.stderr}"
    return json.loads(p.stdout)


def single_process(fn):
    """`dcp.save` / `dcp.load` in one process without a process group: recent releases ask
    for it with `no_dist=True`, 2.3 infers it from the absent group."""
    import inspect

    kw = {"no_dist": True} if "no_dist" in inspect.signature(fn).parameters else {}
    return lambda sd, directory: fn(sd, checkpoint_id=directory, **kw)


dcp_load = single_process(dcp.load)
NEW_DCP = "no_dist" in __import__("inspect").signature(dcp.load).parameters
dcp_save = single_process(dcp.save)


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def expected(name):
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        return json.load(f)


def empty_like_expected(exp):
    return {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) for k, v in exp["tensors"].items()}


def to_torch_dist(src, tmp_path):
    """SRC (torch_dist/DCP) -> dckpt -> torch_dist; returns both new directories."""
    mid, back = str(tmp_path / "dckpt"), str(tmp_path / "torch_dist")
    r = dckpt("convert", src, mid)
    assert r["to"] == "dckpt"
    v = subprocess.run([DCKPT, "validate", mid], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    r = dckpt("convert", mid, back, "--to", "torch_dist")
    assert r["to"] == "torch_dist"
    return mid, back


def objects_of(directory):
    """Every bytes item of a DCP directory, each `torch.load`ed from its place as DCP's
    reader loads it (the planner's way of handing objects back differs between releases)."""
    import io

    reader = dcp.FileSystemReader(directory)
    md = reader.read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        if type(md.state_dict_metadata[index.fqn]).__name__ != "BytesStorageMetadata":
            continue
        with open(os.path.join(directory, info.relative_path), "rb") as f:
            f.seek(info.offset)
            out[index.fqn] = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    return out


# The objects scripts/make_torch_fixtures.py saved in each fixture, as each stored them
# (2.3 pickles a dict of plain values whole, later releases flatten it; Megatron stores each
# ShardedObject in a list).
FIXTURE_OBJECTS = {
    "dcp-2.15": {"blob": b"opaque bytes", "config.lr": 0.5, "config.name": "fixture", "step": 7},
    "dcp-2.3": {"blob": b"opaque bytes", "config": {"lr": 0.5, "name": "fixture"}, "step": 7},
    "megatron-0.16.1": {f"decoder.extra_state/shard_{r}_2": [{"rank": r, "fp8": [1, 2]}] for r in range(2)},
    "etp-ok": {},
}


@pytest.mark.parametrize("name", ["dcp-2.15", "dcp-2.3", "megatron-0.16.1", "etp-ok"])
def test_dcp_load_reads_converted_fixtures_bit_exact(name, tmp_path):
    src = os.path.join(FIXTURES, name)
    _, back = to_torch_dist(src, tmp_path)
    exp = expected(name)
    sd = empty_like_expected(exp)
    dcp_load(sd, back)
    for k, v in exp["tensors"].items():
        assert raw(sd[k]).hex() == v["hex"], f"{name}: {k}"
    # The objects come back as the values PyTorch saved.
    assert objects_of(back) == FIXTURE_OBJECTS[name]


def test_dcp_to_torch_save_reads_converted_output(tmp_path):
    """DCP's own offline consolidation (no state dict given: its planner rebuilds one from
    the metadata's planner data) reads the converted directory."""
    format_utils = pytest.importorskip("torch.distributed.checkpoint.format_utils")
    _, back = to_torch_dist(os.path.join(FIXTURES, "dcp-2.15"), tmp_path)
    out = str(tmp_path / "all.pt")
    format_utils.dcp_to_torch_save(back, out)
    sd = torch.load(out, weights_only=False)
    exp = expected("dcp-2.15")
    for k, v in exp["tensors"].items():
        assert raw(sd[k]).hex() == v["hex"], k
    assert {k: sd[k] for k in FIXTURE_OBJECTS["dcp-2.15"]} == FIXTURE_OBJECTS["dcp-2.15"]


def state():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(5, 1 << 21, generator=g)  # 40 MiB: more than one slab
    return {
        "w.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "w.f64": torch.randn(4, generator=g).to(torch.float64),
        "w.f8": torch.randn(6, 2, generator=g).to(torch.float8_e4m3fn),
        "w.f8e5": torch.randn(5, generator=g).to(torch.float8_e5m2),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4) * 100003,
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "transposed": torch.randn(4, 6, generator=g).T,
        "big": big,
        "step": 11,
        "meta": {"name": "round trip", "lrs": [0.1, 0.01]},
    }


def test_a_dcp_save_round_trips_through_dckpt_bit_exact(tmp_path):
    sd = state()
    assert not sd["transposed"].is_contiguous()
    src = str(tmp_path / "dcp")
    dcp_save(sd, src)
    _, back = to_torch_dist(src, tmp_path)
    out = {k: torch.empty_like(v.contiguous()) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    out["meta"] = {"name": None, "lrs": None}
    dcp_load(out, back)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert raw(out[k]) == raw(v), k
    assert objects_of(back) == objects_of(src)
    assert objects_of(src)["step"] == 11
    if NEW_DCP:
        # Releases from 2.4 on also hand objects back in place.
        assert (out["step"], out["meta"]) == (sd["step"], sd["meta"])


def test_dckpt_torch_objects_convert_to_what_torch_load_reads(tmp_path):
    # Objects of dckpt.torch are a tag and a body (JSON, bytes, pickle); copied as they were
    # into torch_dist, every one failed `torch.load`, so `dcp.load` and Megatron's load.
    src, back = str(tmp_path / "dckpt"), str(tmp_path / "torch_dist")
    values = {
        "step": 11,
        "cfg": {"name": "x", "lrs": [0.1, 0.01], "on": True, "none": None, "big": 2**40, "neg": -3},
        "blob": b"opaque",
        "holder": {"a": b"x", "n": 1},
        "s": {1, 2},
    }
    import dckpt.torch as dt

    dt.save({"w": torch.arange(4.0), **values}, src, allow_pickle=True)
    dckpt("convert", src, back, "--to", "torch_dist")
    assert objects_of(back) == values
    out = {"w": torch.zeros(4), **{k: None for k in values}}
    dcp_load(out, back)
    assert torch.equal(out["w"], torch.arange(4.0))
    if NEW_DCP:
        assert {k: out[k] for k in values} == values


def test_objects_converted_from_torch_dist_load_through_dckpt_torch(tmp_path):
    # Kept as torch.save archives, they began with the byte of the pickle tag and failed.
    import dckpt.torch as dt

    mid = str(tmp_path / "dckpt")
    dckpt("convert", os.path.join(FIXTURES, "dcp-2.15"), mid)
    out = {k: None for k in FIXTURE_OBJECTS["dcp-2.15"]}
    dt.load(out, mid, strict=False)
    assert out == FIXTURE_OBJECTS["dcp-2.15"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_cuda():
    # Megatron's torch_dist strategy synchronizes the device and builds tensors on the
    # current device; neither exists on a CPU-only machine.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def megatron_rank(rank, world, port, directory, out):
    """Loads the converted Megatron fixture with the sharded state dict its generator saved
    (TP over `world` ranks), and writes what it got to `out`-<rank>.json."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stub_cuda()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    exp = expected("megatron-0.16.1")["tensors"]
    full = empty_like_expected({"tensors": exp})

    def piece(key, axis):
        return torch.empty_like(full[key].chunk(world, dim=axis)[rank])

    sd = {
        "embedding": ShardedTensor.from_rank_offsets(
            "embedding.weight", piece("embedding.weight", 0), (0, rank, world)
        ),
        "proj": ShardedTensor.from_rank_offsets(
            "decoder.linear_proj.weight", piece("decoder.linear_proj.weight", 1), (1, rank, world)
        ),
        "qkv": [
            ShardedTensor.from_rank_offsets(
                "decoder.layers.qkv.weight",
                torch.empty_like(full["decoder.layers.qkv.weight"][layer].chunk(world, dim=0)[rank]),
                (0, layer, 2),
                (1, rank, world),
                prepend_axis_num=1,
            )
            for layer in range(2)
        ],
        "norm": ShardedTensor.from_rank_offsets(
            "decoder.norm.weight", torch.empty_like(full["decoder.norm.weight"]), replica_id=(0, rank, 0)
        ),
        "extra_state": [
            ShardedObject("decoder.extra_state", None, (2,), (i,), replica_id=rank) for i in range(2)
        ],
    }
    got = dist_checkpointing.load(sd, directory)
    result = {
        "embedding": raw(got["embedding"]).hex(),
        "proj": raw(got["proj"]).hex(),
        "qkv": [raw(t).hex() for t in got["qkv"]],
        "norm": raw(got["norm"]).hex(),
        "extra_state": got["extra_state"],
        "iteration": got.get("iteration"),
        "args": got.get("args"),
    }
    with open(f"{out}-{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 1])
def test_megatron_dist_checkpointing_load_reads_converted_output(world, tmp_path):
    pytest.importorskip("megatron.core")
    _, back = to_torch_dist(os.path.join(FIXTURES, "megatron-0.16.1"), tmp_path)
    out = str(tmp_path / "got")
    mp.spawn(megatron_rank, args=(world, free_port(), back, out), nprocs=world, join=True)
    exp = expected("megatron-0.16.1")["tensors"]
    full = {k: bytes.fromhex(v["hex"]) for k, v in exp.items()}
    shapes = {k: v["shape"] for k, v in exp.items()}
    as_tensor = {
        k: torch.frombuffer(bytearray(full[k]), dtype=getattr(torch, exp[k]["dtype"])).reshape(shapes[k])
        for k in full
    }
    for rank in range(world):
        with open(f"{out}-{rank}.json") as f:
            got = json.load(f)
        emb = as_tensor["embedding.weight"].chunk(world, dim=0)[rank]
        proj = as_tensor["decoder.linear_proj.weight"].chunk(world, dim=1)[rank]
        assert got["embedding"] == raw(emb).hex(), rank
        assert got["proj"] == raw(proj).hex(), rank
        for layer in range(2):
            qkv = as_tensor["decoder.layers.qkv.weight"][layer].chunk(world, dim=0)[rank]
            assert got["qkv"][layer] == raw(qkv).hex(), (rank, layer)
        assert got["norm"] == exp["decoder.norm.weight"]["hex"]
        # The objects and the common state (common.pt, carried as an object) as saved.
        assert got["extra_state"] == [{"rank": 0, "fp8": [1, 2]}, {"rank": 1, "fp8": [1, 2]}]
        assert got["iteration"] == 42
        assert got["args"] == {"tp": 2, "name": "megatron-fixture"}


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("via", ["dckpt", "torch_dist"])
def test_safetensors_loads_the_export_of_a_fixture_bit_exact(via, dtype, tmp_path):
    """The fixture exported as it is (torch_dist) or once converted to dckpt."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    src = os.path.join(FIXTURES, "dcp-2.15")
    if via == "dckpt":
        src = str(tmp_path / "dckpt")
        dckpt("convert", os.path.join(FIXTURES, "dcp-2.15"), src)
    out = str(tmp_path / "hf")
    args = ["export", src, out, "--format", "safetensors"]
    if dtype:
        args += ["--dtype", dtype]
    dckpt(*args)
    got = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    exp = expected("dcp-2.15")["tensors"]
    assert set(got) == set(exp)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype)
    for k, v in exp.items():
        t = torch.frombuffer(bytearray(bytes.fromhex(v["hex"])), dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
        want = t.to(cast) if cast and t.is_floating_point() else t
        assert got[k].dtype == want.dtype and list(got[k].shape) == v["shape"], k
        assert raw(got[k]) == raw(want), k


def test_the_export_check_script_passes():
    """scripts/check_export.py: edge-case values (NaN, infinities, subnormals, ties) through
    convert and export, every cast, sharded output, against torch's own casts."""
    pytest.importorskip("safetensors")
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "check_export.py"), "--dckpt", DCKPT],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["ok"] is True
