"""PyTorch DCP's own `dcp.load` reading dckpt checkpoints through `dckpt.dcp.DckptStorageReader`:
saved by `dckpt.torch.save` in one layout, loaded by DCP's planner into DTensors of another
(Shard(0) -> Shard(1), uneven splits, flat ZeRO-1 ranges), 2 -> 1 ranks, into plain and
non-contiguous tensors, bit-exact, bf16 included; objects; missing keys as DCP's own reader."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dckpt.torch as dt
from conftest import gen, run_ranks, same_bits
from dckpt.dcp import DckptStorageReader, DckptStorageWriter, object_fqn

# key -> (shape, dtype, seed)
GLOBAL = {
    "model.w1": ((9, 6), torch.float32, 31),  # Shard(0) over 2: rows 5 + 4
    "model.w2": ((6, 7), torch.bfloat16, 32),  # Shard(0) -> Shard(1): columns 4 + 3
    "model.w3": ((5,), torch.int32, 33),  # replicated
    "opt.m": ((4, 6), torch.float32, 34),  # ZeRO-1 flat ranges
    "emb": ((3, 4), torch.float16, 35),  # a plain tensor, the same on every rank
}
FLAT = [(0, 10), (10, 24)]


def caught(f, *args, **kwargs):
    """`(type name, message)` of what `f` raised, or None. DCP's CheckpointException, which
    carries every rank's failure, is a BaseException."""
    try:
        f(*args, **kwargs)
    except BaseException as e:  # noqa: B036 - see above
        return (type(e).__name__, str(e))
    return None


def full(key: str) -> torch.Tensor:
    shape, dtype, seed = GLOBAL[key]
    return gen(shape, dtype, seed)


def save_two(rank: int, world: int, loc: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    m = full("opt.m")
    sd = {
        "model": {
            "w1": distribute_tensor(full("model.w1"), mesh, [Shard(0)]),
            "w2": distribute_tensor(full("model.w2"), mesh, [Shard(0)]),
            "w3": distribute_tensor(full("model.w3"), mesh, [Replicate()]),
        },
        "opt": {"m": dt.Shard(m.reshape(-1)[slice(*FLAT[rank])].clone(), m.shape, (0, 0), flat_range=FLAT[rank])},
        "emb": full("emb"),
        "step": 7,
        "sched": [1, 2.5, "cosine"],
        "rng": dt.Object({"seed": rank}, global_shape=(2,), global_offset=(rank,)),
    }
    dt.save(sd, loc)
    # The same state through DCP's own writer, for the missing-key comparison.
    plain = {k: v for k, v in sd["model"].items()}
    dcp.save({"model": plain, "step": 7}, storage_writer=dcp.FileSystemWriter(loc + "-dcp"))
    return True


def load_two(rank: int, world: int, loc: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))

    def zeros(key, placements):
        shape, dtype, _ = GLOBAL[key]
        return distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)

    target = {
        "model": {
            "w1": zeros("model.w1", [Shard(1)]),
            "w2": zeros("model.w2", [Shard(1)]),
            "w3": zeros("model.w3", [Shard(0)]),
        },
        "opt": {"m": zeros("opt.m", [Shard(0)])},
        "emb": zeros("emb", [Replicate()]),
        "step": 0,
        "sched": None,
        object_fqn("rng", (2,), (1 - rank,)): None,
    }
    dcp.load(target, storage_reader=DckptStorageReader(loc))
    out = {k: same_bits(target[k.split(".")[0]][k.split(".")[1]].full_tensor(), full(k)) for k in GLOBAL if "." in k}
    out["emb"] = same_bits(target["emb"].full_tensor(), full("emb"))
    out["local_w2"] = list(target["model"]["w2"].to_local().shape)
    out["step"], out["sched"] = target["step"], target["sched"]
    out["rng"] = target[object_fqn("rng", (2,), (1 - rank,))]

    # A key the checkpoint lacks: what DCP's own reader does with its own checkpoint.
    def missing(reader):
        return dcp.load({"model": {"w1": zeros("model.w1", [Shard(0)]), "nope": torch.zeros(2)}}, storage_reader=reader)

    ours, theirs = caught(missing, DckptStorageReader(loc)), caught(missing, dcp.FileSystemReader(loc + "-dcp"))
    out["missing"] = (ours[0], "Missing key in checkpoint state_dict: model.nope" in ours[1], theirs[0])
    return out


def test_dtensors_resharded_two_ranks_then_one(tmp_path):
    loc = str(tmp_path / "ckpt")
    assert run_ranks(save_two, 2, loc) == [True, True]
    results = run_ranks(load_two, 2, loc)
    for rank, r in enumerate(results):
        assert r["missing"][0] == r["missing"][2] and r["missing"][1], (rank, r["missing"])
        del r["missing"]
        assert r == {
            "model.w1": True, "model.w2": True, "model.w3": True, "opt.m": True, "emb": True,
            "local_w2": [6, 4 - rank], "step": 7, "sched": [1, 2.5, "cosine"], "rng": {"seed": 1 - rank},
        }, (rank, r)

    # One process, no process group: plain tensors, a transposed (non-contiguous) target,
    # and a float32 target of a bf16 tensor (cast, as DCP's own reader does).
    w2t = torch.zeros(7, 6, dtype=torch.bfloat16).t()
    target = {
        "model": {"w1": torch.zeros(9, 6), "w2": w2t, "w3": torch.zeros(5, dtype=torch.int32)},
        "opt": {"m": torch.zeros(4, 6)},
        "emb": torch.zeros(3, 4, dtype=torch.float32),
        "step": None,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it assumes one process: it is meant
        dcp.load(target, storage_reader=DckptStorageReader(loc), no_dist=True)
    assert same_bits(target["model"]["w1"], full("model.w1"))
    assert same_bits(target["model"]["w2"], full("model.w2")) and target["model"]["w2"] is w2t
    assert same_bits(target["model"]["w3"], full("model.w3"))
    assert same_bits(target["opt"]["m"], full("opt.m"))
    assert torch.equal(target["emb"], full("emb").float())
    assert target["step"] == 7


def test_metadata_is_dckpts_index(tmp_path):
    loc = str(tmp_path / "ckpt")
    w = gen((8, 3), torch.bfloat16, 41)
    dt.save({"w": w, "n": 3}, loc)
    md = DckptStorageReader(loc).read_metadata()
    tmd = md.state_dict_metadata["w"]
    assert tmd.size == torch.Size([8, 3]) and tmd.properties.dtype == torch.bfloat16
    assert [(list(c.offsets), list(c.sizes)) for c in tmd.chunks] == [([0, 0], [8, 3])]
    assert type(md.state_dict_metadata["n"]).__name__ == "BytesStorageMetadata"
    assert DckptStorageReader.validate_checkpoint_id(loc)
    assert not DckptStorageReader.validate_checkpoint_id(str(tmp_path))
    # The location from dcp.load's checkpoint_id, as the module's docs say.
    back = {"w": torch.zeros(8, 3, dtype=torch.bfloat16), "n": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it assumes one process
        dcp.load(back, storage_reader=DckptStorageReader(), checkpoint_id=loc, no_dist=True)
    assert same_bits(back["w"], w) and back["n"] == 3
    # A planner that does not flatten asks for an empty dict's stored value, and gets it
    # (sharded tensors not flattened either: DCP's planner then loads objects into a copy).
    cfg = str(tmp_path / "cfg")
    dt.save({"w": w, "cfg": {"lr": 0.1}}, cfg)
    back = {"w": torch.zeros(8, 3, dtype=torch.bfloat16), "cfg": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(back, storage_reader=DckptStorageReader(cfg), planner=planner, no_dist=True)
    assert back["cfg"] == {"lr": 0.1}, back
    assert DckptStorageReader.validate_checkpoint_id("s3://bucket/prefix")


def test_objects_pickles_only_when_allowed_and_damage_is_named(tmp_path):
    loc = str(tmp_path / "ckpt")
    dt.save({"w": torch.ones(2), "ids": {1, 2}}, loc, allow_pickle=True)

    def load(**kw):
        sd = {"w": torch.zeros(2), "ids": None}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=DckptStorageReader(loc, **kw), no_dist=True)
        return sd

    err = caught(load)
    assert err is not None and "TypeError: ids: stored as a pickle" in err[1] and "allow_pickle" in err[1], err
    assert load(allow_pickle=True)["ids"] == {1, 2}

    # A flipped byte in the tensor's data: the engine's checksum, through DCP.
    data = [f for f in os.listdir(loc) if f != "dckpt.meta"]
    assert len(data) == 1
    path = os.path.join(loc, data[0])
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        raw[raw.rindex(b"\x80\x3f")] ^= 0x01  # inside the last float 1.0 (0x3f800000)
        f.seek(0)
        f.write(raw)
    err = caught(load, allow_pickle=True)
    # DCP wraps what a rank raised; the engine's typed error is inside, naming the file.
    assert err is not None and "dckpt.ChecksumError" in err[1] and data[0] in err[1], err


def save_s3(rank: int, world: int, url: str):
    w = gen((8, 3), torch.bfloat16, 42)
    dt.save({"w": dt.Shard(w[4 * rank : 4 * rank + 4].clone(), w.shape, (4 * rank, 0))}, url)
    return True


@pytest.mark.skipif(not os.environ.get("DCKPT_TEST_S3_URL"), reason="no S3 server (DCKPT_TEST_S3_URL unset)")
def test_s3_two_ranks_to_one_through_dcp():
    import uuid

    url = f"{os.environ['DCKPT_TEST_S3_URL'].rstrip('/')}/python-dcp-{uuid.uuid4().hex}"
    assert run_ranks(save_s3, 2, url) == [True, True]
    target = {"w": torch.zeros(8, 3, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DckptStorageReader(url), no_dist=True)
    assert same_bits(target["w"], gen((8, 3), torch.bfloat16, 42))


def test_an_object_this_process_cannot_unpickle_does_not_stop_other_loads(tmp_path):
    """A stored pickle of a class this process cannot import fails only a load that asks
    for it; reading the metadata (which offers single objects' leaves) once failed on it."""
    import sys
    import types

    mod = types.ModuleType("dckpt_gone_module")
    exec("class Gone:\n    def __init__(self):\n        self.x = 1\n", mod.__dict__)
    sys.modules["dckpt_gone_module"] = mod
    loc = str(tmp_path / "ckpt")
    try:
        dt.save({"w": gen((3, 2), torch.float32, 4), "gone": mod.Gone()}, loc, allow_pickle=True)
    finally:
        del sys.modules["dckpt_gone_module"]
    target = {"w": torch.zeros(3, 2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DckptStorageReader(loc, allow_pickle=True), no_dist=True)
    assert same_bits(target["w"], gen((3, 2), torch.float32, 4))


def dict_cases(rank: int) -> dict:
    """name -> (state, target) of this rank: objects DCP's own writer and reader give back
    as the target holds them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    w, z = full("emb"), torch.zeros(3, 4, dtype=torch.float16)
    cases = {
        # An empty dict beside tensors (a component with nothing to save yet).
        "empty": ({"w": w, "cfg": {"lr": 0.1}, "extra": {}}, {"w": z, "cfg": {"lr": 0.0}, "extra": {}}),
        "adam": ({"optim": opt.state_dict(), "extra": {}}, {"optim": opt.state_dict(), "extra": {}}),
        # Each rank's own part of a dict the ranks hold differently; a subset of a stored dict.
        "per_rank": (
            {"w": w, "train": {"step": 3, "dl": {f"dp_rank_{rank}": {"pos": 100 + rank}}}},
            {"w": z, "train": {"step": 0, "dl": {f"dp_rank_{rank}": {"pos": 0}}}},
        ),
        "subset": ({"w": w, "o": {"a": 1, "b": [1, 2]}}, {"w": z, "o": {"a": 0}}),
        # Keys that look like numbers but are no list index; a dotted key beside a dict.
        "padded": (
            {"w": w, "dl": {"00": 1, "01": 2, f"k{rank}": rank}},
            {"w": z, "dl": {"00": 0, "01": 0, f"k{rank}": 0}},
        ),
        "dotted": ({"w": w, "a.b": 1, "a": {"c": 2}}, {"w": z, "a.b": 0, "a": {"c": 0}}),
    }
    # The same, where the checkpoint holds a dict keyed by a number: dckpt's reader lists it
    # whole, and DCP loads the containers whole (torch 2.3's flattening).
    for name in ("per_rank", "subset", "padded", "dotted"):
        state, target = cases[name]
        cases[name + "_whole"] = ({**state, "ids": {"1": "x"}}, {**target, "ids": {"1": ""}})
    return cases


def plain(value):
    """``value`` with tensors as lists, comparable."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def both_readers(rank: int, world: int, root: str):
    """Each case saved by DCP's writer and dckpt's, loaded by each one's reader: what each
    load gave, or its error."""
    out = {}
    for name, (state, target) in dict_cases(rank).items():
        for tag, writer, reader in (
            ("torch", dcp.FileSystemWriter, dcp.FileSystemReader),
            ("dckpt", DckptStorageWriter, DckptStorageReader),
        ):
            loc = os.path.join(root, name, tag)
            back = dict_cases(rank)[name][1]
            try:
                dcp.save(state, storage_writer=writer(loc))
                dcp.load(back, storage_reader=reader(loc))
                out[name, tag] = plain(back)
            except BaseException as e:  # noqa: B036 - DCP's CheckpointException
                out[name, tag] = f"{type(e).__name__}: {getattr(e, 'failures', e)}"
    return out


@pytest.fixture(scope="module")
def dicts_loaded(tmp_path_factory):
    return run_ranks(both_readers, 2, str(tmp_path_factory.mktemp("dicts")))


def assert_as_dcp(results, names):
    for rank, r in enumerate(results):
        for name in names:
            assert not isinstance(r[name, "torch"], str), (rank, name, r[name, "torch"])
            assert r[name, "dckpt"] == r[name, "torch"], (rank, name, r[name, "dckpt"], r[name, "torch"])


def test_an_empty_dict_beside_tensors_loads(dicts_loaded):
    """`{}` beside tensors: DCP's planner, offered a stored object whole beside its leaves,
    flattened the state dict torch 2.3's way, where `{}` is a key never stored (`Missing key`)."""
    assert_as_dcp(dicts_loaded, ["empty", "adam"])
    assert dicts_loaded[0]["empty", "dckpt"]["extra"] == {}


def test_a_loaded_dict_holds_the_targets_keys_only(dicts_loaded):
    """Rank 0 was given rank 1's `dp_rank_1` too, and a subset target the keys it lacked."""
    assert_as_dcp(dicts_loaded, ["per_rank", "subset", "per_rank_whole", "subset_whole"])
    for rank, r in enumerate(dicts_loaded):
        assert r["per_rank_whole", "dckpt"]["train"]["dl"] == {f"dp_rank_{rank}": {"pos": 100 + rank}}
        assert r["subset_whole", "dckpt"]["o"] == {"a": 1}


def test_number_like_keys_and_dotted_keys(dicts_loaded):
    """`"00"` was read as the list index 0 (`dl.00 is not stored`); `"a.b"` beside `"a":
    {"c": ...}` was taken for a part of `a` (`a.c is not stored`)."""
    assert_as_dcp(dicts_loaded, ["padded", "dotted", "padded_whole", "dotted_whole"])
