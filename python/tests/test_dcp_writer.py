"""`dcp.save` and `dcp.async_save` through `dckpt.dcp.DckptStorageWriter`: the checkpoint is
what `dckpt.torch.save` writes for the same state (keys, chunks, object values), read back by
`dcp.load` in another placement, by `dckpt.torch.load` and by the CLI; DCP's dedup keeps the
replicas comparable (replicas that differ are refused), a planner's gap is refused before a
byte is written, errors are dckpt's on every rank, a rank failing alone fails every rank at
once, and the async executors (thread and process) give the outcome or raise. Then
`dckpt.torch.save` -> `dcp.load` of a flattened optimizer state, and S3."""

from __future__ import annotations

import os
import subprocess
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dckpt
import dckpt.torch as dt
from conftest import gen, run_ranks, same_bits
from dckpt.dcp import DckptStorageReader, DckptStorageWriter, dckpt_error

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DCKPT = os.environ.get("DCKPT_BIN") or os.path.join(ROOT, "target", "ci", "dckpt")

# key -> (shape, dtype, seed)
GLOBAL = {
    "model.w1": ((9, 6), torch.float32, 51),  # Shard(0) over 2: rows 5 + 4
    "model.w2": ((6, 7), torch.bfloat16, 52),  # Shard(1): columns 4 + 3
    "model.w3": ((5,), torch.int32, 53),  # Replicate: DCP keeps one copy
    "emb": ((3, 4), torch.float16, 54),  # a plain tensor, the same on every rank
}
OBJECTS = {
    "step": 7,
    "cfg": {"lr": 0.5, "name": "cosine", "warmup": [1, 2]},  # a dict without tensors: one object
    "sched": [1, 2.5, "x"],
}
PARAM_GROUPS = [{"lr": 0.25, "betas": [0.9, 0.95], "params": ["model.w1", "model.w2"]}]


def full(key: str) -> torch.Tensor:
    shape, dtype, seed = GLOBAL[key]
    return gen(shape, dtype, seed)


def quiet():
    """DCP warns that it assumes one process when there is no group: it is meant."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def nested_full() -> dict:
    """The whole state as plain tensors, as one process holds it."""
    return {
        "model": {k.split(".")[1]: full(k) for k in GLOBAL if k.startswith("model.")},
        "emb": full("emb"),
        "optim": {"m": full("model.w1") * 0 + 1, "param_groups": PARAM_GROUPS},
        **OBJECTS,
    }


def sharded_state(mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        "model": {
            "w1": distribute_tensor(full("model.w1"), mesh, [Shard(0)]),
            "w2": distribute_tensor(full("model.w2"), mesh, [Shard(1)]),
            "w3": distribute_tensor(full("model.w3"), mesh, [Replicate()]),
        },
        "emb": full("emb"),
        "optim": {"m": distribute_tensor(full("model.w1") * 0 + 1, mesh, [Shard(0)]), "param_groups": PARAM_GROUPS},
        **OBJECTS,
    }


def outcome_of(fn):
    """`(type name of dckpt's error inside, its message)` of what `fn` raised, or None."""
    try:
        fn()
    except BaseException as e:  # noqa: B036 - DCP's CheckpointException is a BaseException
        inner = dckpt_error(e)
        return (type(inner).__name__ if inner is not None else f"not dckpt's: {type(e).__name__}", str(inner or e))
    return None


def save_two(rank: int, world: int, loc: str, twin: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sd = sharded_state(mesh)
    md = dcp.save(sd, storage_writer=DckptStorageWriter(loc))
    out = {"save_id": md.storage_data["save_id"], "bytes": md.storage_data["bytes"]}
    # The same state through dckpt.torch, to compare the two checkpoints.
    dt.save(sd, twin)
    # A second save is refused, on every rank, with dckpt's own error; replace overwrites.
    out["again"] = outcome_of(lambda: dcp.save(sd, storage_writer=DckptStorageWriter(loc)))
    out["replaced"] = dcp.save(sd, checkpoint_id=loc, storage_writer=DckptStorageWriter(replace=True)).storage_data[
        "save_id"
    ]

    # Loaded by DCP through dckpt's reader into other placements.
    target = sharded_state(mesh)
    for k in ("w1", "w2"):
        target["model"][k] = distribute_tensor(torch.zeros(GLOBAL[f"model.{k}"][0], dtype=GLOBAL[f"model.{k}"][1]), mesh, [Shard(1 if k == "w1" else 0)])
    target["optim"]["param_groups"] = [{"lr": 0.0, "betas": [0.0, 0.0], "params": []}]
    target["step"], target["cfg"], target["sched"] = 0, {"lr": 0.0, "name": "", "warmup": [0, 0]}, None
    dcp.load(target, storage_reader=DckptStorageReader(loc))
    out["exact"] = all(same_bits(target["model"][k].full_tensor(), full(f"model.{k}")) for k in ("w1", "w2", "w3"))
    out["objects"] = {k: target[k] for k in OBJECTS}
    out["param_groups"] = target["optim"]["param_groups"]
    return out


def test_dcp_save_writes_what_dckpt_torch_writes(tmp_path):
    loc, twin = str(tmp_path / "dcp-writer"), str(tmp_path / "dckpt-torch")
    results = run_ranks(save_two, 2, loc, twin)
    for rank, r in enumerate(results):
        assert r["again"][0] == "AlreadyExists" and loc in r["again"][1], (rank, r["again"])
        assert r["exact"], rank
        assert r["objects"] == OBJECTS and r["param_groups"] == PARAM_GROUPS, (rank, r)
    # One outcome, the same on both ranks, and it is the checkpoint's.
    assert results[0]["replaced"] == results[1]["replaced"] == dckpt.metadata(loc)["save_id"]
    assert results[0]["save_id"] != results[0]["replaced"]

    # The same keys, shapes, dtypes, chunks and objects as dckpt.torch.save's checkpoint.
    ours, theirs = dckpt.metadata(loc), dckpt.metadata(twin)

    def shape(index):
        return (
            {k: (t["shape"], t["dtype"], sorted(map(str, t["chunks"]))) for k, t in index["tensors"].items()},
            sorted(index["objects"]),
        )

    assert shape(ours) == shape(theirs)
    assert sorted(ours["objects"]) == ["cfg", "optim.param_groups", "sched", "step"]

    # dckpt.torch.load of the nested state, one process: every tensor whole, every object.
    target = {
        "model": {k.split(".")[1]: torch.zeros(GLOBAL[k][0], dtype=GLOBAL[k][1]) for k in GLOBAL if "." in k},
        "emb": torch.zeros(3, 4, dtype=torch.float16),
        "optim": {"m": torch.zeros(9, 6), "param_groups": None},
        "step": None, "cfg": None, "sched": None,
    }
    dt.load(target, loc)
    want = nested_full()
    assert all(same_bits(target["model"][k], want["model"][k]) for k in want["model"])
    assert same_bits(target["emb"], want["emb"]) and same_bits(target["optim"]["m"], want["optim"]["m"])
    assert target["optim"]["param_groups"] == PARAM_GROUPS
    assert {k: target[k] for k in OBJECTS} == OBJECTS

    # The CLI reads it like any checkpoint.
    if os.access(DCKPT, os.X_OK):
        v = subprocess.run([DCKPT, "validate", loc], capture_output=True, text=True)
        assert v.returncode == 0, v.stderr


def test_dckpt_torch_save_then_dcp_load_of_a_flattened_optimizer(tmp_path):
    """The reverse: `dckpt.torch` stores `optim.param_groups` as one object; DCP asks for
    its leaves (`optim.param_groups.0.lr`) and gets them."""
    quiet()
    loc = str(tmp_path / "ckpt")
    dt.save(nested_full(), loc)
    target = {
        "model": {k.split(".")[1]: torch.zeros(GLOBAL[k][0], dtype=GLOBAL[k][1]) for k in GLOBAL if "." in k},
        "emb": torch.zeros(3, 4, dtype=torch.float16),
        "optim": {"m": torch.zeros(9, 6), "param_groups": [{"lr": 0.0, "betas": [0.0, 0.0], "params": []}]},
        "step": 0, "cfg": {"lr": 0.0, "name": "", "warmup": []}, "sched": None,
    }
    dcp.load(target, storage_reader=DckptStorageReader(loc), no_dist=True)
    assert target["optim"]["param_groups"] == PARAM_GROUPS
    assert {k: target[k] for k in OBJECTS} == OBJECTS
    assert same_bits(target["model"]["w2"], full("model.w2"))


def test_a_key_the_checkpoint_lacks_is_missing_as_in_dcp(tmp_path):
    """A key of a state dict's container that the checkpoint lacks: DCP's load raises that it
    is missing, or keeps the target's value under `allow_partial_load`; the reader took the
    stored container whole and the key was gone without a word."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    quiet()
    loc = str(tmp_path / "ckpt")
    dt.save({"w": full("emb"), "train": {"step": 5, "betas": (0.9, 0.95)}}, loc)

    def target():
        return {"w": torch.zeros(3, 4, dtype=torch.float16), "train": {"step": 0, "tokens": 7, "betas": (0.0, 0.0)}}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = target()
        # DCP raises a read's error inside its own exception, which holds it.
        with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is one
            dcp.load(t, storage_reader=DckptStorageReader(loc), no_dist=True)
        said = f"{raised.value} {getattr(raised.value, 'failures', '')}"
        assert "Missing key in checkpoint state_dict: train.tokens" in said, said
        t = target()
        planner = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(t, storage_reader=DckptStorageReader(loc), planner=planner, no_dist=True)
    # A tuple comes back a tuple, as DCP keeps it (JSON stores it as a list).
    assert t["train"] == {"step": 5, "tokens": 7, "betas": (0.9, 0.95)}, t
    assert same_bits(t["w"], full("emb"))


def test_what_dcps_flattening_drops_comes_back_from_the_target(tmp_path):
    """An optimizer's state before its first step, dict keys that are not strings and a
    list holding an empty dict leave no leaf, or other keys, in DCP's flattening: the
    writer rebuilt `optim` without `state`, and a load replaced the target's `optim` with
    it (`opt.load_state_dict` then failed on the missing `state`). Loads now fill the
    target's own containers, as DCP's own load does."""
    quiet()
    loc = str(tmp_path / "ckpt")

    def state(lr):
        return {
            "w": full("emb"),
            "optim": {"state": {}, "param_groups": [{"lr": lr, "params": [0, 1]}]},
            "stats": {1: lr, 2: {}},
            "hist": [{}, {"a": lr}],
        }

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(0.5), storage_writer=DckptStorageWriter(loc, process_group=dt.LOCAL), no_dist=True)
    want = state(0.5)
    del want["w"]
    for how in ("dckpt.torch", "dcp"):
        target = state(0.0)
        target["w"] = torch.zeros_like(target["w"])
        if how == "dckpt.torch":
            dt.load(target, loc, process_group=dt.LOCAL)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(target, storage_reader=DckptStorageReader(loc), no_dist=True)
        assert same_bits(target.pop("w"), full("emb")), how
        assert target == want, (how, target)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    opt.load_state_dict(target["optim"])
    assert opt.param_groups[0]["lr"] == 0.5


def test_checkpoint_id_reset_and_storage_meta(tmp_path):
    quiet()
    loc = str(tmp_path / "by-id")
    w = DckptStorageWriter()
    assert w.checkpoint_id is None
    assert DckptStorageWriter.validate_checkpoint_id(loc) and DckptStorageWriter.validate_checkpoint_id("s3://b/p")
    assert not DckptStorageWriter.validate_checkpoint_id("gs://b/p")
    md = dcp.save({"w": full("emb")}, checkpoint_id=loc, storage_writer=w, no_dist=True)
    assert w.checkpoint_id == loc and w.storage_meta().checkpoint_id == loc
    first = w.storage_meta().save_id
    w.reset()
    assert w.storage_meta().save_id != first and w.outcome is None
    assert md.storage_data["save_id"] == dckpt.metadata(loc)["save_id"]
    # No location at all is named before anything runs.
    err = outcome_of(lambda: dcp.save({"w": full("emb")}, storage_writer=DckptStorageWriter(), no_dist=True))
    assert err is not None and "no location" in err[1], err


class _Gap(dcp.DefaultSavePlanner):
    """A planner that loses rank 1's rows of `model.w1` from its final plan."""

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        import dataclasses

        import torch.distributed as dist

        if dist.get_rank() == 1:
            plan = dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn != "model.w1"])
        return plan


def refusals(rank: int, world: int, root: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    # A gap in the plan: refused before a byte is written.
    gap = os.path.join(root, "gap")
    out["gap"] = outcome_of(lambda: dcp.save(sharded_state(mesh), storage_writer=DckptStorageWriter(gap), planner=_Gap()))
    out["gap_files"] = sorted(os.listdir(gap)) if os.path.isdir(gap) else []
    # A plain tensor that differs between the ranks (a split described as a replica):
    # DCP's dedup keeps one copy, dckpt compares them.
    differ = {"w": gen((4, 4), torch.float32, 60 + rank)}
    out["differ"] = outcome_of(lambda: dcp.save(differ, storage_writer=DckptStorageWriter(os.path.join(root, "differ"))))
    out["differ_off"] = outcome_of(
        lambda: dcp.save(differ, storage_writer=DckptStorageWriter(os.path.join(root, "off"), replica_check="off"))
    )
    # One rank holds an object that is not plain: every rank fails at once, none waits.
    odd = {"w": full("emb"), f"local.{rank}": ({1, 2} if rank == 1 else 1)}
    out["odd"] = outcome_of(lambda: dcp.save(odd, storage_writer=DckptStorageWriter(os.path.join(root, "odd"))))
    try:
        dcp.save(odd, storage_writer=DckptStorageWriter(os.path.join(root, "odd")))
    except BaseException as e:  # noqa: B036
        out["odd_types"] = sorted({type(f[0]).__name__ for f in e.failures.values()})
    # dcp.save(no_dist=True): each process saves alone, through a writer of a world of one;
    # a writer of the job's group is refused, where DCP's rank is not the group's and where
    # DCP planned fewer ranks than the group has (rank 0 waited for the others' save).
    alone = os.path.join(root, f"alone-{rank}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it assumes one process: it is meant
        writer = DckptStorageWriter(alone, process_group=dt.LOCAL)
        out["alone"] = outcome_of(lambda: dcp.save({"w": full("emb")}, storage_writer=writer, no_dist=True))
        group = DckptStorageWriter(alone + "-group")
        out["alone_group"] = outcome_of(lambda: dcp.save({"w": full("emb")}, storage_writer=group, no_dist=True))
    out["alone_saved"] = dckpt.metadata(alone)["save_id"] == writer.outcome["save_id"]
    dist.barrier()
    return out


def test_refusals_are_dckpts_on_every_rank(tmp_path):
    results = run_ranks(refusals, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["gap"][0] == "CoverageError" and "model.w1" in r["gap"][1], (rank, r["gap"])
        # Refused before a byte is written: no metadata and no data file either.
        assert not [f for f in r["gap_files"] if f == "dckpt.meta" or f.endswith(".safetensors")], r["gap_files"]
        assert r["differ"] is not None and r["differ"][0] == "CoverageError" and "w" in r["differ"][1], r["differ"]
        assert r["differ_off"] is None, r["differ_off"]
        assert r["odd"] is not None and "set" in r["odd"][1] and "allow_pickle" in r["odd"][1], r["odd"]
        assert r["odd_types"] == ["TypeError"], r["odd_types"]
        assert r["alone"] is None and r["alone_saved"], r["alone"]
    for r in results:
        assert "process_group=dckpt.torch.LOCAL" in r["alone_group"][1], r["alone_group"]
    assert results[0]["differ"] == results[1]["differ"]


def per_rank_objects(rank: int, world: int, root: str):
    """torchtitan's dataloader state: a key of each data-parallel rank's own under one dict,
    beside one the ranks share; once as plain values, once as the pickled bytes torchtitan
    stores (bytes need no ``allow_pickle``: they are stored as they are)."""
    import pickle

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for kind, mine in (("plain", {"pos": 100 + rank, "epoch": 1}), ("bytes", pickle.dumps({"pos": 100 + rank}))):
        loc = os.path.join(root, kind)
        sd = sharded_state(mesh)
        sd["dataloader"] = {f"dp_rank_{rank}": mine, "world_size": world}
        # One data-parallel rank: the same keys on every rank, one object holding bytes.
        sd["dp1"] = {"dp_rank_0": b"\x80\x04state", "world_size": 1}
        # A list of dicts longer on one rank: split into its indices, each rank its own.
        sd["hist"] = [{"a": 1}] + ([{"a": 2}] if rank == 1 else [])
        dcp.save(sd, storage_writer=DckptStorageWriter(loc))
        target = sharded_state(mesh)
        target["dataloader"] = {f"dp_rank_{rank}": None if kind == "plain" else b"", "world_size": 0}
        target["dp1"] = {"dp_rank_0": b"", "world_size": 0}
        target["hist"] = [{"a": 0} for _ in sd["hist"]]
        dcp.load(target, storage_reader=DckptStorageReader(loc))
        same = all(target[k] == sd[k] for k in ("dataloader", "dp1", "hist"))
        out[kind] = (same, {k: target[k] for k in ("dataloader", "dp1", "hist")})
        # A group every rank holds the same leaves of stays one object.
        out[kind + "_cfg"] = target["cfg"] == OBJECTS["cfg"]
    # With DCP's plan cache the second save's plans are its cached ones, split as before.
    from torch.distributed.checkpoint import DefaultSavePlanner

    sd = sharded_state(mesh)
    sd["dataloader"] = {f"dp_rank_{rank}": {"pos": 7 + rank}, "world_size": world}
    sd["dp1"] = {"dp_rank_0": b"", "world_size": 1}
    sd["hist"] = [{"a": 1}] + ([{"a": 2}] if rank == 1 else [])
    for i in range(2):
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(sd, storage_writer=DckptStorageWriter(os.path.join(root, f"cached{i}")), planner=planner)
    # Rank 1 alone adds a leaf to a group, then drops it, while rank 0's plan comes from
    # DCP's cache unchanged: rank 0 is sent its plan again, split as the groups now need.
    # Then rank 0 alone drops a leaf both held, and no rank's share of the items changes.
    steps = (
        ("base", {}), ("changed", {"b": 2} if rank == 1 else {}), ("back", {}),
        ("both", {"c": 3}), ("dropped", {"c": 3} if rank == 1 else {}),
    )
    for name, extra in steps:
        sd = sharded_state(mesh)
        sd["ts"] = {"a": 1, **extra}
        loc = os.path.join(root, name)
        dcp.save(sd, storage_writer=DckptStorageWriter(loc), planner=DefaultSavePlanner(enable_plan_caching=True))
        target = sharded_state(mesh)
        target["ts"] = {k: 0 for k in sd["ts"]}
        dcp.load(target, storage_reader=DckptStorageReader(loc))
        out[name] = target["ts"] == sd["ts"]
    # A value on one rank where the other holds a group (a dict, a list) under the same key,
    # a list on one where the other holds a dict, an empty dict on one: each rank gets back
    # what it held. Before, the rank holding the group was given the other's value, a dict
    # for its list, the other's dict for its empty one (DCP's flattening drops an empty dict).
    mixed = {
        "leaf_dict": 5 if rank == 0 else {"a": 1},
        "leaf_list": 5 if rank == 0 else [{"a": 1}, {"a": 2}],
        "list_dict": [{"a": 1}] if rank == 0 else {"a": 3},
        "empty_dict": {} if rank == 0 else {"a": 1},
    }
    for name, value in mixed.items():
        loc = os.path.join(root, f"mixed-{name}")
        sd = sharded_state(mesh)
        sd["x"] = value
        dcp.save(sd, storage_writer=DckptStorageWriter(loc))
        target = sharded_state(mesh)
        target["x"] = blank(value)
        dcp.load(target, storage_reader=DckptStorageReader(loc))
        out[f"mixed_{name}"] = (target["x"] == value, target["x"])
    return out


def blank(value):
    """``value`` with every leaf replaced, its containers kept: a load target for it."""
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank(v) for v in value]
    return None


def test_split_groups_judges_each_part_again():
    from dckpt.dcp import _nest

    # Rank 0 and 1 hold their own `dp_rank_<k>` (two leaves each) and the same `world_size`;
    # `cfg` alike everywhere; `x.y` under `x` on rank 0, alone (a tensor beside it) on rank 1.
    r0 = {"dl": (("dp_rank_0", "a"), ("dp_rank_0", "b"), ("world_size",)), "cfg": (("lr",),), "x": (("y",),)}
    r1 = {"dl": (("dp_rank_1", "a"), ("dp_rank_1", "b"), ("world_size",)), "cfg": (("lr",),), "x.y": ((),)}
    assert _nest.split_groups([r0, r1, None]) == {"dl", "x", "x.y"}
    paths = {"dl.dp_rank_0.a": ("dl", "dp_rank_0", "a"), "dl.dp_rank_0.b": ("dl", "dp_rank_0", "b"), "dl.world_size": ("dl", "world_size")}
    got = _nest.parts("dl", 1, sorted(paths), paths, {"dl"})
    assert got == [("dl.dp_rank_0", 2, ["dl.dp_rank_0.a", "dl.dp_rank_0.b"]), ("dl.world_size", 2, ["dl.world_size"])], got


def test_per_rank_objects_under_one_dict(tmp_path):
    results = run_ranks(per_rank_objects, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["plain"][0] and r["bytes"][0], (rank, r)
        assert r["plain_cfg"] and r["bytes_cfg"], (rank, r)
    for kind in ("plain", "bytes"):
        objects = sorted(dckpt.metadata(str(tmp_path / kind))["objects"])
        # The group the ranks hold differently is stored as its parts, under DCP's flat keys;
        # each rank's own part whole, as the group would be.
        assert objects == [
            "cfg", "dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.world_size", "dp1",
            "hist.0", "hist.1", "optim.param_groups", "sched", "step",
        ], objects
    assert sorted(dckpt.metadata(str(tmp_path / "cached1"))["objects"]) == objects
    names = ("base", "changed", "back", "both", "dropped")
    for rank, r in enumerate(results):
        assert all(r[k] for k in names), (rank, r)
        assert all(r[f"mixed_{k}"][0] for k in ("leaf_dict", "leaf_list", "list_dict", "empty_dict")), (rank, r)
    stored = {k: sorted(o for o in dckpt.metadata(str(tmp_path / k))["objects"] if o.startswith("ts")) for k in names}
    want = {"base": ["ts"], "changed": ["ts.a", "ts.b"], "back": ["ts"], "both": ["ts"], "dropped": ["ts.a", "ts.c"]}
    assert stored == want, stored


def async_two(rank: int, world: int, root: str, kind: str):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    sd = sharded_state(mesh)
    ctype = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    loc = os.path.join(root, "async")
    fut = dcp.async_save(sd, storage_writer=DckptStorageWriter(loc), async_checkpointer_type=ctype)
    md = fut.result()
    out = {"save_id": md.storage_data["save_id"]}
    # A failed background save raises at result(): the step is committed already.
    fut = dcp.async_save(sd, storage_writer=DckptStorageWriter(loc), async_checkpointer_type=ctype)
    out["again"] = outcome_of(fut.result)
    dist.barrier()
    target = sharded_state(mesh)
    for k in target["model"]:
        target["model"][k].to_local().zero_()
    dcp.load(target, storage_reader=DckptStorageReader(loc))
    out["exact"] = all(same_bits(target["model"][k].full_tensor(), full(f"model.{k}")) for k in target["model"])
    return out


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_async_save(tmp_path, kind):
    results = run_ranks(async_two, 2, str(tmp_path), kind)
    loc = str(tmp_path / "async")
    for rank, r in enumerate(results):
        assert r["save_id"] == dckpt.metadata(loc)["save_id"], (rank, r)
        assert r["again"] is not None and r["again"][0] == "AlreadyExists", (rank, r["again"])
        assert r["exact"], rank


def s3_two(rank: int, world: int, url: str):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    md = dcp.save(sharded_state(mesh), storage_writer=DckptStorageWriter(url))
    return md.storage_data["save_id"]


@pytest.mark.skipif(not os.environ.get("DCKPT_TEST_S3_URL"), reason="no S3 server (DCKPT_TEST_S3_URL unset)")
def test_s3_dcp_save_then_one_process_loads():
    quiet()
    url = f"{os.environ['DCKPT_TEST_S3_URL'].rstrip('/')}/python-dcp-writer-{uuid.uuid4().hex}"
    ids = run_ranks(s3_two, 2, url)
    assert ids[0] == ids[1] == dckpt.metadata(url)["save_id"]
    target = nested_full()
    for v in target["model"].values():
        v.zero_()
    target["optim"]["param_groups"] = None
    dt.load(target, url)
    assert all(same_bits(target["model"][k], full(f"model.{k}")) for k in target["model"])
    assert target["optim"]["param_groups"] == PARAM_GROUPS
    # And DCP through dckpt's reader, flattened.
    again = nested_full()
    again["model"]["w1"].zero_()
    dcp.load(again, storage_reader=DckptStorageReader(url), no_dist=True)
    assert same_bits(again["model"]["w1"], full("model.w1"))


def cache_after_another_writer(rank: int, world: int, root: str):
    """DCP's plan cache filled by torch's writer, then dckpt's saves with it (the ranks'
    cached final plans were another writer's: the first was refused, the next stored `o` as
    one object holding one rank's `part`), the last with a plan changed on rank 1."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    out = []
    for i, writer in enumerate((dcp.FileSystemWriter, DckptStorageWriter, DckptStorageWriter, DckptStorageWriter)):
        extra = {"b": i} if i == 3 and rank == 1 else {}
        sd = {"w": full("emb"), "o": {"a": i, "part": {f"k{rank}": i}, **extra}}
        loc = os.path.join(root, str(i))
        dcp.save(sd, storage_writer=writer(loc), planner=DefaultSavePlanner(enable_plan_caching=True))
        target = {"w": torch.zeros(3, 4, dtype=torch.float16), "o": blank(sd["o"])}
        reader = DckptStorageReader if writer is DckptStorageWriter else dcp.FileSystemReader
        dcp.load(target, storage_reader=reader(loc))
        out.append(target["o"] == sd["o"])
    # A final plan that lost the writer's word on its groups fails every rank, not only its own.
    lost = DckptStorageWriter(os.path.join(root, "lost"))
    out.append(outcome_of(lambda: dcp.save(sd, storage_writer=lost, planner=_Lost())))
    return out


class _Lost(dcp.DefaultSavePlanner):
    """A planner whose final plan on rank 1 drops the writer's ``storage_data``."""

    def finish_plan(self, new_plan):
        import dataclasses

        import torch.distributed as dist

        plan = super().finish_plan(new_plan)
        return dataclasses.replace(plan, storage_data=None) if dist.get_rank() == 1 else plan


def test_plan_cache_filled_by_another_writer(tmp_path):
    results = run_ranks(cache_after_another_writer, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r[:4] == [True] * 4, (rank, r)
        assert r[4] is not None and "rank 1's final plan was not made by this writer" in r[4][1], (rank, r[4])
    assert not os.path.exists(tmp_path / "lost" / "dckpt.meta")
    for i, objects in ((1, ["o.a", "o.part.k0", "o.part.k1"]), (3, ["o.a", "o.b", "o.part.k0", "o.part.k1"])):
        assert sorted(dckpt.metadata(str(tmp_path / str(i)))["objects"]) == objects, i


def over_a_torch_checkpoint(rank: int, world: int, loc: str):
    """A dckpt save where torch's writer left a checkpoint: `dcp.load(checkpoint_id=...)`,
    which picks torch's reader, read the old one."""
    import torch.distributed as dist

    dcp.save({"w": full("emb") * 0}, storage_writer=dcp.FileSystemWriter(loc))
    out = {"refused": outcome_of(lambda: dcp.save({"w": full("emb")}, storage_writer=DckptStorageWriter(loc)))}
    out["kept"] = os.path.exists(os.path.join(loc, ".metadata"))
    dist.barrier()
    dcp.save({"w": full("emb")}, storage_writer=DckptStorageWriter(loc, replace=True))
    target = {"w": torch.zeros(3, 4, dtype=torch.float16)}
    out["plain_load"] = outcome_of(lambda: dcp.load(target, checkpoint_id=loc))
    dcp.load(target, storage_reader=DckptStorageReader(loc))
    out["loaded"] = same_bits(target["w"], full("emb"))
    return out


def test_a_torch_checkpoint_in_the_directory_is_refused_or_replaced(tmp_path):
    loc = str(tmp_path / "ckpt")
    for rank, r in enumerate(run_ranks(over_a_torch_checkpoint, 2, loc)):
        assert r["refused"] is not None and r["refused"][0] == "AlreadyExists", (rank, r)
        assert os.path.join(loc, ".metadata") in r["refused"][1] and r["kept"], (rank, r)
        # Replaced: torch's reader finds no checkpoint there, dckpt's the new one.
        assert r["plain_load"] is not None and r["loaded"], (rank, r)
    assert not os.path.exists(os.path.join(loc, ".metadata"))


def test_returned_metadata_names_the_committed_save(tmp_path):
    quiet()
    loc = str(tmp_path / "ckpt")
    w = DckptStorageWriter(loc, process_group=dt.LOCAL)
    md = dcp.save({"w": full("emb"), "n": 1}, storage_writer=w, no_dist=True)
    committed = dckpt.metadata(loc)["save_id"]
    assert md.storage_meta is not None and md.storage_meta.checkpoint_id == loc
    assert md.storage_meta.save_id == w.storage_meta().save_id == md.storage_data["save_id"] == committed
