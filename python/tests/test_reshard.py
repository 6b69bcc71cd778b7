"""Saved in one layout, loaded in another, bit-exact: explicit Shards (uneven splits, ZeRO-1
flat ranges, an empty rank), DTensors over 1-d and 2-d meshes, and plain tensors."""

from __future__ import annotations

import os

import pytest
import torch

import dckpt
import dckpt.torch as dt
from conftest import gen, run_ranks, same_bits, wait_child

# The global state of the explicit-Shard test: key -> (shape, dtype, seed).
GLOBAL = {
    "layers.0.weight": ((10, 6), torch.bfloat16, 1),
    "layers.0.bias": ((7,), torch.float32, 2),
    "embedding": ((5, 4), torch.int64, 3),
    "optimizer.exp_avg": ((4, 6), torch.float32, 4),
}


def full(key: str) -> torch.Tensor:
    shape, dtype, seed = GLOBAL[key]
    return gen(shape, dtype, seed)


ROWS_4 = [(0, 3), (3, 6), (6, 8), (8, 10)]  # uneven
BIAS_4 = [(0, 2), (2, 4), (4, 7), None]  # rank 3 holds none of it
FLAT_4 = [(0, 5), (5, 12), (12, 20), (20, 24)]  # ZeRO-1 slices of the flattened tensor


def save_four(rank: int, world: int, loc: str):
    w, b, m = full("layers.0.weight"), full("layers.0.bias"), full("optimizer.exp_avg")
    r0, r1 = ROWS_4[rank]
    sd = {
        "layers": [{"weight": dt.Shard(w[r0:r1].clone(), w.shape, (r0, 0))}],
        "embedding": full("embedding"),  # plain: the same on every rank, saved once
        "optimizer": {"exp_avg": dt.Shard(m.reshape(-1)[slice(*FLAT_4[rank])].clone(), m.shape, (0, 0),
                                          flat_range=FLAT_4[rank])},
        "step": 7,
        "rng": dt.Object({"seed": rank}, global_shape=(4,), global_offset=(rank,)),
    }
    if BIAS_4[rank] is not None:
        b0, b1 = BIAS_4[rank]
        sd["layers"][0]["bias"] = dt.Shard(b[b0:b1].clone(), b.shape, (b0,))
    else:
        # Rank 3 still holds a replica of bias' first element: a piece that is not main.
        sd["layers"][0]["bias"] = dt.Shard(b[0:1].clone(), b.shape, (0,), replica_id=(0, 1))
    out = dt.save(sd, loc)
    return out["bytes"]


def load_two(rank: int, world: int, loc: str):
    w, b, m, e = full("layers.0.weight"), full("layers.0.bias"), full("optimizer.exp_avg"), full("embedding")
    c0, c1 = [(0, 4), (4, 6)][rank]
    b0, b1 = [(0, 3), (3, 7)][rank]
    m0, m1 = [(0, 1), (1, 4)][rank]
    # Rank 0 loads the weight columns into a non-contiguous (transposed) target.
    weight = torch.zeros(c1 - c0, 10, dtype=torch.bfloat16).t() if rank == 0 else torch.zeros(10, 2, dtype=torch.bfloat16)
    assert weight.is_contiguous() == (rank == 1)
    target = {
        "layers": [{"weight": dt.Shard(weight, w.shape, (0, c0)), "bias": dt.Shard(torch.zeros(b1 - b0), b.shape, (b0,))}],
        "embedding": torch.zeros(5, 4, dtype=torch.int64),
        "optimizer": {"exp_avg": dt.Shard(torch.zeros(m1 - m0, 6), m.shape, (m0, 0))},
        "step": None,
        "rng": dt.Object(None, global_shape=(4,), global_offset=(rank + 2,)),
    }
    # The other positions of the rng grid are stored but not requested here.
    out = dt.load(target, loc, strict=False)
    assert out is target
    layer = target["layers"][0]
    return {
        "weight": same_bits(layer["weight"].data, w[:, c0:c1]),
        "bias": same_bits(layer["bias"].data, b[b0:b1]),
        "embedding": same_bits(target["embedding"], e),
        "exp_avg": same_bits(target["optimizer"]["exp_avg"].data, m[m0:m1]),
        "step": target["step"],
        "rng": target["rng"].value,
    }


def test_explicit_shards_four_ranks_to_two_to_one(tmp_path):
    loc = str(tmp_path / "ckpt")
    stored = run_ranks(save_four, 4, loc)
    expected_bytes = sum(full(k).numel() * full(k).element_size() for k in GLOBAL)
    # Every tensor byte once (plus the small objects); the same outcome on every rank.
    assert len(set(stored)) == 1 and expected_bytes <= stored[0] < expected_bytes + 200

    results = run_ranks(load_two, 2, loc)
    for rank, r in enumerate(results):
        assert r == {
            "weight": True, "bias": True, "embedding": True, "exp_avg": True, "step": 7, "rng": {"seed": rank + 2}
        }, (rank, r)

    # A world of one (no process group here): each tensor whole.
    target = {
        "layers": {"0": {"weight": torch.zeros(10, 6, dtype=torch.bfloat16), "bias": torch.zeros(7)}},
        "embedding": torch.zeros(5, 4, dtype=torch.int64),
        "optimizer": {"exp_avg": torch.zeros(4, 6)},
        "step": None,
    }
    dt.load(target, loc, strict=False)
    assert same_bits(target["layers"]["0"]["weight"], full("layers.0.weight"))
    assert same_bits(target["layers"]["0"]["bias"], full("layers.0.bias"))
    assert same_bits(target["embedding"], full("embedding"))
    assert same_bits(target["optimizer"]["exp_avg"], full("optimizer.exp_avg"))
    assert target["step"] == 7

    meta = dckpt.metadata(loc)
    assert meta["tensors"]["layers.0.weight"]["dtype"] == "bf16"
    assert sorted(c[0] for c in meta["tensors"]["layers.0.weight"]["chunks"]) == [[r0, 0] for r0, _ in ROWS_4]
    assert meta["tensors"]["layers.0.weight"]["flat_chunks"] == []
    exp_avg = meta["tensors"]["optimizer.exp_avg"]
    assert exp_avg["chunks"] == [] and sorted(c[2:] for c in exp_avg["flat_chunks"]) == FLAT_4
    assert all(c[:2] == ([0, 0], [4, 6]) for c in exp_avg["flat_chunks"])
    assert meta["objects"]["rng"]["grid_shape"] == [4]
    assert meta["layout"]["world_size"] == "4"


# DTensors: key -> (shape, dtype, seed, placements on a (dp=2, tp=2) mesh).
DT_GLOBAL = {
    "w1": ((9, 6), torch.float32, 11),
    "w2": ((6, 7), torch.bfloat16, 12),
    "w3": ((5,), torch.int32, 13),
    "w4": ((8, 3), torch.float32, 14),
}


def _placements(name):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        # w4 as FSDP2 over a column-parallel layer places it: each shard still one block.
        "save": {
            "w1": [Replicate(), Shard(0)],
            "w2": [Shard(0), Shard(1)],
            "w3": [Shard(0), Replicate()],
            "w4": [_StridedShard(0, split_factor=2), Shard(0)],
        },
        "load": {"w1": [Shard(1)], "w2": [Shard(0)], "w3": [Replicate()], "w4": [Shard(0)]},
    }[name]


def _refused(call) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _flattened_columns(mesh, placements):
    """A DTensor sharded on its columns, flattened: each rank holds every other run of
    elements, which no box at torch's offset describes."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(torch.zeros(4, 6), mesh, placements).flatten()


def save_dtensors(rank: int, world: int, loc: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pl = _placements("save")
    sd = {"model": {k: distribute_tensor(gen(s, d, seed), mesh, pl[k]) for k, (s, d, seed) in DT_GLOBAL.items()}}
    # A Partial DTensor (a sum not yet reduced) has no stored form: refused, naming it.
    from torch.distributed.tensor import DTensor, Partial, Replicate

    partial = DTensor.from_local(torch.ones(2), mesh, [Partial(), Replicate()])
    try:
        dt.save({"pending": partial}, loc + "-partial")
        refused = None
    except ValueError as e:
        refused = str(e)
    assert refused is not None and "pending" in refused and "Partial" in refused, refused
    strided = _flattened_columns(mesh, [Replicate(), _placements("load")["w1"][0]])
    refused = _refused(lambda: dt.save({"flat": strided}, loc + "-strided"))
    assert refused is not None and "flat" in refused and "not one block" in refused, refused
    return dt.save(sd, loc)["chunks"]


def load_dtensors(rank: int, world: int, loc: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    pl = _placements("load")
    sd = {"model": {k: distribute_tensor(torch.zeros(s, dtype=d), mesh, pl[k]) for k, (s, d, _) in DT_GLOBAL.items()}}
    strided = _flattened_columns(mesh, pl["w1"])
    refused = _refused(lambda: dt.load({"model": {"w1": strided}}, loc))
    assert refused is not None and "model.w1" in refused and "not one block" in refused, refused
    dt.load(sd, loc)
    return {k: same_bits(sd["model"][k].full_tensor(), gen(s, d, seed)) for k, (s, d, seed) in DT_GLOBAL.items()}


def test_dtensors_two_by_two_mesh_to_two_to_one(tmp_path):
    loc = str(tmp_path / "ckpt")
    chunks = run_ranks(save_dtensors, 4, loc)
    # w1: 2 tp shards (replicated over dp); w2: 4 shards; w3: 2 dp shards; w4: 4 shards.
    assert chunks == [12] * 4
    for r in run_ranks(load_dtensors, 2, loc):
        assert r == {"w1": True, "w2": True, "w3": True, "w4": True}
    target = {"model": {k: torch.zeros(s, dtype=d) for k, (s, d, _) in DT_GLOBAL.items()}}
    dt.load(target, loc)
    for k, (s, d, seed) in DT_GLOBAL.items():
        assert same_bits(target["model"][k], gen(s, d, seed)), k


def save_s3(rank: int, world: int, url: str):
    w = gen((8, 3), torch.bfloat16, 21)
    return dt.save({"w": dt.Shard(w[4 * rank : 4 * rank + 4].clone(), w.shape, (4 * rank, 0))}, url)["bytes"]


@pytest.mark.skipif(not os.environ.get("DCKPT_TEST_S3_URL"), reason="no S3 server (DCKPT_TEST_S3_URL unset)")
def test_s3_two_ranks_to_one():
    import uuid

    url = f"{os.environ['DCKPT_TEST_S3_URL'].rstrip('/')}/python-{uuid.uuid4().hex}"
    assert run_ranks(save_s3, 2, url) == [48, 48]
    target = {"w": torch.zeros(8, 3, dtype=torch.bfloat16)}
    dt.load(target, url)
    assert same_bits(target["w"], gen((8, 3), torch.bfloat16, 21))


@pytest.mark.skipif(not os.environ.get("DCKPT_TEST_S3_URL"), reason="no S3 server (DCKPT_TEST_S3_URL unset)")
def test_s3_in_a_forked_child_after_the_parent_used_it():
    import uuid

    base = f"{os.environ['DCKPT_TEST_S3_URL'].rstrip('/')}/python-fork-{uuid.uuid4().hex}"
    y = gen((16,), torch.float32, 22)
    dt.save({"y": y}, f"{base}/parent")  # the parent's S3 runtime is running now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            dt.save({"y": y * 2}, f"{base}/child")
            back = {"y": torch.zeros(16)}
            dt.load(back, f"{base}/parent")
            code = 0 if same_bits(back["y"], y) else 3
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    back = {"y": torch.zeros(16)}
    dt.load(back, f"{base}/child")
    assert same_bits(back["y"], y * 2)


def tcp_world(rank: int, world: int, loc: str):
    os.environ["DCKPT_TCP_HOST"] = "127.0.0.1"
    w = gen((6, 4), torch.bfloat16, 23)
    rows = [(0, 1), (1, 6)][rank]  # uneven
    dt.save({"w": dt.Shard(w[rows[0] : rows[1]].clone(), w.shape, (rows[0], 0))}, loc, collective="tcp")
    back = {"w": torch.zeros(6, 4, dtype=torch.bfloat16)}
    dt.load(back, loc, collective="tcp")
    # The same job may mix both collectives; each has its own checkpointer.
    again = {"w": torch.zeros(6, 4, dtype=torch.bfloat16)}
    dt.load(again, loc)
    kinds = sorted(k[0] for k in dt._process._proc.checkpointers)
    return same_bits(back["w"], w) and same_bits(again["w"], w) and kinds == ["gloo", "tcp"]


def test_tcp_collective_rendezvoused_through_the_store(tmp_path):
    assert run_ranks(tcp_world, 2, str(tmp_path / "tcp")) == [True, True]


def _rows(w: torch.Tensor, rows: tuple[int, int]) -> dt.Shard:
    return dt.Shard(w[rows[0] : rows[1]].clone(), w.shape, (rows[0], 0))


def tcp_subgroup_then_world(rank: int, world: int, root: str):
    import torch.distributed as dist

    os.environ["DCKPT_TCP_HOST"] = "127.0.0.1"
    os.environ["DCKPT_RENDEZVOUS_TIMEOUT_MS"] = "20000"  # a lost rendezvous fails in seconds
    w = gen((6, 4), torch.float32, 24)
    sub = dist.new_group([0, 1])  # made on every rank, as torch asks
    if rank < 2:
        dt.save({"w": _rows(w, [(0, 2), (2, 6)][rank])}, f"{root}/sub", process_group=sub, collective="tcp")
    # Ranks 0 and 1 have made a TCP world before this one; rank 2 has not.
    dt.save({"w": _rows(w, [(0, 1), (1, 3), (3, 6)][rank])}, f"{root}/world", collective="tcp")
    back = {"w": torch.zeros(6, 4)}
    dt.load(back, f"{root}/world", collective="tcp")
    ok = same_bits(back["w"], w)
    if rank < 2:
        back = {"w": torch.zeros(6, 4)}
        dt.load(back, f"{root}/sub", process_group=sub, collective="tcp")
        ok = ok and same_bits(back["w"], w)
    return ok


def test_tcp_worlds_are_counted_per_group(tmp_path):
    """A subgroup's TCP world made by some ranks does not shift the store keys of the next
    world over all of them: every rank finds the same rendezvous."""
    assert run_ranks(tcp_subgroup_then_world, 3, str(tmp_path)) == [True, True, True]


def tcp_store_timeout(rank: int, world: int, loc: str):
    from torch.distributed.distributed_c10d import _get_default_store

    os.environ["DCKPT_TCP_HOST"] = "127.0.0.1"
    os.environ["DCKPT_RENDEZVOUS_TIMEOUT_MS"] = "20000"
    before = _get_default_store().timeout
    dt.save({"x": gen((4,), torch.float32, 25)}, loc, collective="tcp")
    return before, _get_default_store().timeout


def test_tcp_rendezvous_leaves_the_job_store_timeout(tmp_path):
    """The rendezvous waits with its own timeout: the job's store client, shared by its
    barriers and NCCL's setup, keeps the one the job gave it on every rank."""
    for rank, (before, after) in enumerate(run_ranks(tcp_store_timeout, 2, str(tmp_path / "t"))):
        assert before == after, (rank, before, after)


def job_made_again(rank: int, world: int, root: str):
    import torch.distributed as dist

    os.environ["DCKPT_COLLECTIVE_TIMEOUT_MS"] = "20000"  # a dead group fails in seconds
    w = gen((6, 4), torch.float32, 25)
    dt.save({"w": _rows(w, [(0, 2), (2, 6)][rank])}, f"{root}/before")
    m = dt.CheckpointManager(f"{root}/run")
    m.save(1, {"w": _rows(w, [(0, 3), (3, 6)][rank])})
    # An in-process restart: the job's groups destroyed and a new job made.
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    dt.save({"w": _rows(w, [(0, 4), (4, 6)][rank])}, f"{root}/after")
    m.save(2, {"w": _rows(w, [(0, 1), (1, 6)][rank])})
    ok = True
    for loc in (f"{root}/before", f"{root}/after", f"{root}/run/{dckpt._dckpt.RunRoot.step_dir(2)}"):
        back = {"w": torch.zeros(6, 4)}
        dt.load(back, loc)
        ok = ok and same_bits(back["w"], w)
    return ok and m.latest() == 2


def test_a_job_destroyed_and_made_again_in_the_process_saves_and_loads(tmp_path):
    """After destroy_process_group and a new init_process_group in the same processes, the
    checkpointers and run roots made in the old job are made anew (they held its
    destroyed groups)."""
    assert run_ranks(job_made_again, 2, str(tmp_path)) == [True, True]
