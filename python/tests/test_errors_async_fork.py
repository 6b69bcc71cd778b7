"""Two ranks on gloo: errors raised identically on every rank, async saves overlapped with
work, the collective's u64 reductions, and a forked child that saves on its own."""

from __future__ import annotations

import fractions
import os
import sys
import warnings

import torch

import dckpt
import dckpt.torch as dt
from conftest import caught, gen, run_ranks, same_bits, wait_child


def two_ranks(rank: int, world: int, root: str):
    out = {}
    w = gen((4, 6), torch.float32, 5)

    def state(scale=1.0):
        return {"w": dt.Shard((w[:, 3 * rank : 3 * rank + 3] * scale).clone(), w.shape, (0, 3 * rank)), "step": 1}

    a = f"{root}/a"
    dt.save(state(), a)
    # A committed checkpoint is refused, on every rank, unless replacing it.
    out["exists"] = caught(dt.save, state(), a)
    dt.save(state(2.0), a, replace=True)
    target = {"w": torch.zeros(4, 6), "step": None}
    dt.load(target, a)
    out["replaced"] = same_bits(target["w"], w * 2.0) and target["step"] == 1

    # One rank alone inside the job (dckpt.dcp reads this way): a world of one.
    if rank == 1:
        alone = {"w": torch.zeros(4, 6), "step": None}
        dt.load(alone, a, process_group=dt.LOCAL)
        out["local"] = same_bits(alone["w"], w * 2.0)
    else:
        out["local"] = True

    # strict: a requested key that is not stored, on every rank.
    out["missing"] = caught(dt.load, {"w": torch.zeros(4, 6), "step": None, "nope": torch.zeros(1)}, a)
    # a stored key nobody requested.
    out["unexpected"] = caught(dt.load, {"w": torch.zeros(4, 6)}, a)
    out["not_strict"] = caught(dt.load, {"w": torch.zeros(4, 6), "nope": torch.zeros(1)}, a, strict=False)
    # What the load left out, on every rank: "nope" is rank 1's alone.
    asked = {"w": torch.zeros(4, 6)} | ({"nope": torch.zeros(1)} if rank == 1 else {})
    got = dt.load(asked, a, strict=False, info=True)
    out["skipped"] = (got["missing"], got["unexpected"])

    # A coverage hole: rank 0 holds rows 0..2, rank 1 row 3; row 2 is nobody's.
    rows = [(0, 2), (3, 4)][rank]
    hole = {"holey": dt.Shard(torch.ones(rows[1] - rows[0], 2), (4, 2), (rows[0], 0))}
    out["hole"] = caught(dt.save, hole, f"{root}/hole")
    # Nothing at all: no metadata, and no data file a refused commit would leave behind.
    hole_dir = f"{root}/hole"
    listed = os.listdir(hole_dir) if os.path.isdir(hole_dir) else []
    out["hole_written"] = [n for n in listed if n == "dckpt.meta" or n.endswith(".safetensors")]

    # Async: the source changes right after the call returns; the saved bytes are the old ones.
    x = gen((1000,), torch.float32, 6 + rank)
    before = x.clone()
    h = dt.save({"x": dt.Shard(x, (2000,), (1000 * rank,))}, f"{root}/async", async_save=True)
    x.add_(1.0)
    x.mul_(3.0)
    result = h.wait()
    out["async_done"] = h.done() and result["bytes"] == 8000 and h.wait() == result
    whole = {"x": torch.zeros(2000)}
    dt.load(whole, f"{root}/async")
    out["async_old_bytes"] = same_bits(whole["x"][1000 * rank : 1000 * rank + 1000], before)
    # The error of a background save comes from wait(), on every rank.
    h2 = dt.save({"x": dt.Shard(x, (2000,), (1000 * rank,))}, f"{root}/async", async_save=True)
    out["async_error"] = caught(h2.wait)

    # The collective's u64 reductions cover the whole range.
    coll = dt.TorchCollective()
    big = (1 << 64) - 1 - rank
    out["u64"] = (
        coll.all_reduce_u64([big, rank], "max"),
        coll.all_reduce_u64([big, rank], "min"),
        coll.all_reduce_u64([big, 1 << 40], "sum"),
        coll.all_gather(bytes([rank]) * (rank + 1)),
        coll.scatter(1, [b"a", b"bc"] if rank == 1 else None),
        coll.broadcast(0, b"hello" if rank == 0 else None),
        coll.gather(1, b"x" * rank),
    )
    # Point to point: two messages to the other rank (one empty), in the order sent.
    peer = 1 - rank
    out["exchange"] = coll.exchange([(peer, b"m%d" % rank * 1000), (peer, b"")], [peer, peer])

    # A forked child (a DataLoader worker, say) uses dckpt on its own: a world of one.
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            y = torch.arange(6.0) + rank
            dt.save({"y": y}, f"{root}/child{rank}")
            back = {"y": torch.zeros(6)}
            dt.load(back, f"{root}/child{rank}")
            code = 0 if torch.equal(back["y"], y) else 3
        finally:
            os._exit(code)
    out["child_exit"] = wait_child(pid)
    # The parent's checkpointer still works after the fork.
    dt.save(state(), f"{root}/after-fork")
    return out


def one_rank_fails(rank: int, world: int, root: str):
    """A failure on one rank only, in Python before the native call (a value only it holds
    cannot be stored, a target only it has cannot be filled): every rank fails at once."""
    w = gen((4, 6), torch.float32, 5)
    shard = dt.Shard(w[:, 3 * rank : 3 * rank + 3].clone(), w.shape, (0, 3 * rank))
    out = {"save": caught(dt.save, {"w": shard, "odd": {1, 2} if rank == 1 else 1}, f"{root}/odd")}
    out["save_written"] = os.path.exists(f"{root}/odd/dckpt.meta")
    # The same on rank 0 of a save due on both tiers in the background: the failing rank
    # saves in the foreground, and took other rounds than the others' background save (they
    # raised that rank 1's message did not decode).
    m = dt.CheckpointManager(f"{root}/run", local=f"{root}/nodes/{{node}}", ranks_per_node=1, persistent_every=1)
    both = {"w": shard, "odd": {1, 2} if rank == 0 else 1}
    out["tiers"] = caught(lambda: m.save(1, both, async_save=True).wait())
    dt.save({"w": shard}, f"{root}/good")
    dest = torch.zeros(4, 6)
    out["load"] = caught(dt.load, {"w": dest.to_sparse() if rank == 1 else dest}, f"{root}/good")
    # An object only rank 1 cannot decode (its own entry was pickled): every rank's load fails.
    value = fractions.Fraction(1, 3) if rank == 1 else 7
    rng = lambda v: dt.Object(v, global_shape=(2,), global_offset=(rank,))  # noqa: E731
    dt.save({"w": shard, "rng": rng(value)}, f"{root}/rng", allow_pickle=True)
    out["objects"] = caught(dt.load, {"w": torch.zeros(4, 6), "rng": rng(None)}, f"{root}/rng")
    back = {"w": torch.zeros(4, 6), "rng": rng(None)}
    dt.load(back, f"{root}/rng", allow_pickle=True)
    out["objects_allowed"] = back["rng"].value == value
    # An option given wrongly to one rank only (before, checked natively on that rank, which
    # then never joined the call the other waited in).
    check = "everything" if rank == 0 else "all"
    out["replica_check"] = caught(dt.save, {"w": shard}, f"{root}/checked", replica_check=check)
    policy = "ignore" if rank == 0 else "warn"
    out["policy"] = caught(dt.load, {"w": torch.zeros(4, 6)}, f"{root}/good", unexpected=policy)
    return out


def test_a_failure_on_one_rank_fails_every_rank_at_once(tmp_path):
    """Before, the other rank waited in the native call until the collective timed out
    (here after 60 s, as a CollectiveError naming no cause)."""
    os.environ["DCKPT_COLLECTIVE_TIMEOUT_MS"] = "60000"  # inherited by the spawned ranks
    try:
        results = run_ranks(one_rank_fails, 2, str(tmp_path))
    finally:
        del os.environ["DCKPT_COLLECTIVE_TIMEOUT_MS"]
    for rank, r in enumerate(results):
        name, msg, err_rank = r["save"]
        # The failing rank raises its own error; the other the same class, naming it.
        assert name == "TypeError" and "odd" in msg and "set" in msg, (rank, r["save"])
        assert rank == 1 or ("rank 1" in msg and err_rank == 1), (rank, r["save"])
        assert not r["save_written"]
        name, msg, err_rank = r["tiers"]
        assert name == "TypeError" and "odd" in msg and "set" in msg, (rank, r["tiers"])
        assert rank == 0 or ("rank 0" in msg and err_rank == 0), (rank, r["tiers"])
        name, msg, err_rank = r["load"]
        assert name == "TypeError" and "sparse" in msg, (rank, r["load"])
        assert rank == 1 or ("rank 1" in msg and err_rank == 1), (rank, r["load"])
        # Decoded inside the native load: before, rank 0 returned as if all was well.
        name, msg, err_rank = r["objects"]
        assert name == "TypeError" and "rng" in msg and "allow_pickle" in msg, (rank, r["objects"])
        assert rank == 1 or ("rank 1" in msg and err_rank == 1), (rank, r["objects"])
        assert r["objects_allowed"]
        name, msg, err_rank = r["replica_check"]
        assert name == "ValueError" and "'everything'" in msg, (rank, r["replica_check"])
        assert rank == 0 or ("rank 0" in msg and err_rank == 0), (rank, r["replica_check"])
        name, msg, err_rank = r["policy"]
        assert name == "ValueError" and "'warn'" in msg, (rank, r["policy"])
        assert rank == 1 or ("rank 1" in msg and err_rank == 1), (rank, r["policy"])


def test_errors_async_collective_fork_two_ranks(tmp_path):
    results = run_ranks(two_ranks, 2, str(tmp_path))
    for rank, r in enumerate(results):
        other = results[1 - rank]
        name, msg, _ = r["exists"]
        assert name == "AlreadyExists" and "already committed" in msg, r["exists"]
        assert r["replaced"] and r["local"]
        assert r["missing"][0] == "MissingKeys" and "nope" in r["missing"][1]
        assert r["unexpected"][0] == "UnexpectedKeys" and "step" in r["unexpected"][1]
        assert r["not_strict"] is None
        assert r["skipped"] == (["nope"], ["step"]), r["skipped"]
        name, msg, err_rank = r["hole"]
        assert name == "CoverageError" and "holey" in msg, r["hole"]
        assert err_rank is not None
        assert not r["hole_written"], r["hole_written"]
        assert r["async_done"]
        assert r["async_old_bytes"]
        assert r["async_error"][0] == "AlreadyExists"
        max_, min_, sum_, gathered, part, bcast, gather = r["u64"]
        assert max_ == [(1 << 64) - 1, 1] and min_ == [(1 << 64) - 2, 0]
        assert sum_ == [((1 << 64) - 1 + (1 << 64) - 2) % (1 << 64), 2 << 40]
        assert gathered == [b"\x00", b"\x01\x01"]
        assert part == [b"a", b"bc"][rank] and bcast == b"hello"
        assert gather == ([b"", b"x"] if rank == 1 else None)
        assert r["exchange"] == [b"m%d" % (1 - rank) * 1000, b""], r["exchange"]
        assert r["child_exit"] == 0
        # The same error on every rank.
        for k in ("exists", "missing", "unexpected", "hole", "async_error"):
            assert r[k] == other[k], (k, r[k], other[k])


def test_world_of_one_values_pickles_and_errors(tmp_path):
    loc = str(tmp_path / "one")
    fp8 = gen((3, 4), torch.float8_e4m3fn, 30)
    strided = gen((5, 3), torch.float64, 31).t()  # saved from a non-contiguous view
    sd = {
        "fp8": fp8,
        "strided": strided,
        "meta": {"epoch": 3, "lr": 1.0, "name": "run", "betas": (0.9, 0.95), "nested": {"a": [None, True]}},
        "none": None,
    }
    first = dt.save(sd, loc)
    # One native checkpointer per process group: the same structure reuses the plan.
    again = dt.save(sd, str(tmp_path / "again"))
    assert not first["plan_reused"] and again["plan_reused"], (first, again)
    target = {"fp8": torch.zeros(3, 4, dtype=torch.float8_e4m3fn), "strided": torch.zeros(3, 5, dtype=torch.float64),
              "meta": None, "none": 5}
    dt.load(target, loc)
    assert same_bits(target["fp8"], fp8) and same_bits(target["strided"], strided)
    # JSON keeps int and float apart; a tuple comes back as a list.
    assert target["meta"] == {"epoch": 3, "lr": 1.0, "name": "run", "betas": [0.9, 0.95], "nested": {"a": [None, True]}}
    assert type(target["meta"]["epoch"]) is int and type(target["meta"]["lr"]) is float
    assert target["none"] is None

    # Arbitrary objects: a TypeError naming the key, unless pickles are allowed both ways.
    err = caught(dt.save, {"s": {1, 2}}, str(tmp_path / "p"))
    assert err[0] == "TypeError" and "s:" in err[1] and "allow_pickle" in err[1]
    dt.save({"s": {1, 2}}, str(tmp_path / "p"), allow_pickle=True)
    err = caught(dt.load, {"s": None}, str(tmp_path / "p"))
    assert err[0] == "TypeError" and "allow_pickle" in err[1]
    back = dt.load({"s": None}, str(tmp_path / "p"), allow_pickle=True)
    assert back == {"s": {1, 2}}
    # Plain values holding bytes (torchtitan's dataloader state) need no allow_pickle either
    # way: bytes are stored as they are, a dict of them as a pickle that names no class.
    state = {"dl": {"dp_rank_0": b"\x80\x04state", "world_size": 1}, "raw": bytearray(b"xy")}
    dt.save(state, str(tmp_path / "b"))
    back = dt.load({"dl": None, "raw": None}, str(tmp_path / "b"))
    assert back == {"dl": {"dp_rank_0": b"\x80\x04state", "world_size": 1}, "raw": b"xy"}, back

    # The same tensor twice in a target (tied weights) is filled twice.
    tied = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    dt.load({"fp8": tied, "strided": torch.zeros(3, 5, dtype=torch.float64), "meta": None, "none": None,
             "_": {}}, loc, strict=False)
    assert same_bits(tied, fp8)

    assert caught(dt.load, {"x": torch.zeros(1)}, str(tmp_path / "nothing"))[0] == "NotACheckpoint"
    # A wrong dtype in the request.
    err = caught(dt.load, {"fp8": torch.zeros(3, 4), "strided": torch.zeros(3, 5, dtype=torch.float64),
                           "meta": None, "none": None}, loc)
    assert err[0] == "RequestError" and "fp8" in err[1], err

    # A flipped byte in a data file is found by its checksum.
    data = [f for f in os.listdir(loc) if f != "dckpt.meta"]
    assert len(data) == 1
    path = os.path.join(loc, data[0])
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0x40
    open(path, "wb").write(bytes(raw))
    err = caught(dt.load, {"fp8": torch.zeros(3, 4, dtype=torch.float8_e4m3fn),
                           "strided": torch.zeros(3, 5, dtype=torch.float64), "meta": None, "none": None}, loc)
    assert err is not None and err[0] in ("ChecksumError", "FormatError"), err
    assert issubclass(getattr(dckpt, err[0]), dckpt.DckptError)


class _Quantized(torch.Tensor):
    """A stand-in for a quantized wrapper (Transformer Engine's Float8Tensor): its stored
    form is what `dequantize` returns."""

    def dequantize(self):
        return torch.full(self.shape, 7.5, dtype=torch.bfloat16)


def test_tensor_subclasses_are_saved_dequantized(tmp_path):
    q = torch.Tensor._make_subclass(_Quantized, torch.zeros(2, 3, dtype=torch.uint8))
    dt.save({"q": q}, str(tmp_path / "q"))
    back = {"q": torch.zeros(2, 3, dtype=torch.bfloat16)}
    dt.load(back, str(tmp_path / "q"))
    assert torch.equal(back["q"], torch.full((2, 3), 7.5, dtype=torch.bfloat16))


class _Tagged(torch.Tensor):
    """A subclass that only tags its tensor: its data is its own, in its own dtype."""


def test_a_subclass_without_its_own_dequantize_keeps_its_dtype(tmp_path):
    """It was saved through ``Tensor.dequantize``, a cast to float32: a bf16 or int64
    tensor stored as another dtype (int64 losing precision), then refused at load."""
    state = {
        "h": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).as_subclass(_Tagged),
        "i": torch.tensor([2**60 + 1, -3], dtype=torch.int64).as_subclass(_Tagged),
    }
    dt.save(state, str(tmp_path / "t"))
    back = {"h": torch.zeros(2, 3, dtype=torch.bfloat16), "i": torch.zeros(2, dtype=torch.int64)}
    dt.load(back, str(tmp_path / "t"))
    assert same_bits(back["h"], state["h"].as_subclass(torch.Tensor)), back
    assert back["i"].tolist() == [2**60 + 1, -3], back


def test_a_bad_tcp_setting_is_a_request_error(monkeypatch):
    """A `DCKPT_*` variable of the collectives that does not parse is a setting to fix,
    named, raised before anything listens: the TCP star's was a `CollectiveError`, as if a
    peer failed, and the gloo group's int()'s bare ValueError."""
    from dckpt import _dckpt

    for var, value in [("DCKPT_TCP_LISTEN", "not-an-address"), ("DCKPT_MESSAGE_BYTES_MAX", "lots")]:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            err = caught(_dckpt.Checkpointer.tcp, 0, 1, "127.0.0.1", 0, "job", 5.0)
        assert err[0] == "RequestError" and var in err[1] and value in err[1], err
    # The gloo group's timeout, read on the Python side, names its variable too.
    from dckpt.torch import _collective

    for value in ["soon", "-5"]:
        with monkeypatch.context() as m:
            m.setenv("DCKPT_COLLECTIVE_TIMEOUT_MS", value)
            err = caught(_collective._timeout)
        assert err[0] == "RequestError" and "DCKPT_COLLECTIVE_TIMEOUT_MS" in err[1] and value in err[1], err
    monkeypatch.setenv("DCKPT_COLLECTIVE_TIMEOUT_MS", " 1500 ")
    assert _collective._timeout().total_seconds() == 1.5


def test_native_pieces_are_checked(tmp_path):
    from dckpt import _dckpt
    from dckpt._dckpt import object_piece, tensor_piece

    c = _dckpt.Checkpointer()
    assert (c.rank, c.world_size) == (0, 1)
    buf = torch.zeros(4)
    ptr = buf.data_ptr()
    # A buffer shorter than its region: refused before anything is read.
    err = caught(tensor_piece, "k", "f32", [4], [0], [4], ptr, 8)
    assert err[0] == "RequestError" and '"k"' in err[1] and "8 bytes" in err[1], err
    err = caught(tensor_piece, "k", "nope", [4], [0], [4], ptr, 16)
    assert err[0] == "RequestError" and "nope" in err[1]
    err = caught(tensor_piece, "k", "f32", [4], [0], [4], 0, 16)
    assert err[0] == "RequestError" and "null" in err[1]
    err = caught(object_piece, "o", [], [], data="not bytes")
    assert err[0] == "RequestError" and "bytes" in err[1]
    # Only pieces are taken: a tuple is refused, naming what was expected.
    err = caught(c.save, str(tmp_path / "x"), [("k", "f32", [4], [0], [4], None, True, ptr, 16)], [])
    assert err[0] == "RequestError" and "TensorPiece" in err[1], err
    err = caught(c.save, str(tmp_path / "x"), [], [object_piece("o")])
    assert err[0] == "RequestError" and '"o"' in err[1] and "no data" in err[1], err
    # Each flag belongs to one call: `main` to save, `allow_shape_mismatch` to load.
    p = tensor_piece("k", "float32", [4], [0], [4], ptr, 16, main=False)
    assert (p.key, p.dtype, p.shape, p.flat_range, p.main, p.allow_shape_mismatch) == ("k", "f32", [4], None, False, False)
    # Load buffers sharing bytes are filled through temporaries; where they overlap, the
    # one listed last wins (two exclusive slices of one memory are never made).
    buf.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    c.save(str(tmp_path / "y"), [tensor_piece("a", "f32", [4], [0], [4], ptr, 16),
                                 tensor_piece("b", "f32", [2], [0], [2], ptr + 8, 8)], [])
    buf.zero_()
    c.load(str(tmp_path / "y"), [tensor_piece("a", "f32", [4], [0], [4], ptr, 16),
                                 tensor_piece("b", "f32", [2], [0], [2], ptr + 4, 8)], [])
    assert buf.tolist() == [1.0, 3.0, 4.0, 4.0], buf
    assert not os.path.exists(tmp_path / "x")
    c.close()
    assert caught(c.save, str(tmp_path / "z"), [], [])[0] == "DckptError"


class _OneRank:
    """A Python collective of one rank, in the shape the native Checkpointer calls."""

    def __init__(self, fail_on=None):
        self.fail_on, self.calls = fail_on, []

    def _call(self, name):
        self.calls.append(name)
        if name == self.fail_on:
            raise RuntimeError(f"injected failure in {name}")

    def rank(self):
        return 0

    def world_size(self):
        return 1

    def barrier(self):
        self._call("barrier")

    def broadcast(self, root, data):
        self._call("broadcast")
        return data

    def gather(self, root, data):
        self._call("gather")
        return [data]

    def all_gather(self, data):
        self._call("all_gather")
        return [data]

    def all_reduce_u64(self, values, op):
        self._call("all_reduce_u64")
        return values

    def scatter(self, root, parts):
        self._call("scatter")
        return parts[0]

    def exchange(self, sends, sources):
        self._call("exchange")
        return []


def gathers_and_scatters(rank: int, world: int):
    coll = dt.TorchCollective()
    out = []
    # Messages of other sizes (none among them), each root in turn, twice in a row: each
    # goes rank to root (or root to rank) at its own size.
    for root in range(world):
        for _ in range(2):
            mine = bytes([rank]) * (rank * 3 % 5)
            out.append(("gather", root, coll.gather(root, mine)))
            parts = [bytes([root, r]) * (r % 3) for r in range(world)] if rank == root else None
            out.append(("scatter", root, coll.scatter(root, parts)))
    return out


def test_gathers_and_scatters_move_each_message_at_its_own_size():
    world = 4
    results = run_ranks(gathers_and_scatters, world)
    for rank, got in enumerate(results):
        for what, root, value in got:
            if what == "gather":
                want = [bytes([r]) * (r * 3 % 5) for r in range(world)] if rank == root else None
            else:
                want = bytes([root, rank]) * (rank % 3)
            assert value == want, (rank, what, root, value)


def test_python_collective_errors_poison_it(tmp_path):
    from dckpt import _dckpt

    buf = torch.arange(4, dtype=torch.float32)
    desc = [_dckpt.tensor_piece("k", "f32", [4], [0], [4], buf.data_ptr(), 16)]
    good = _OneRank()
    c = _dckpt.Checkpointer(good)
    c.save(str(tmp_path / "ok"), desc, [])
    assert "all_reduce_u64" in good.calls or "gather" in good.calls
    # A background save calls the Python collective from a Rust thread.
    h = c.save(str(tmp_path / "bg"), desc, [], async_save=True)
    assert h.wait()["bytes"] == 16

    bad = _OneRank(fail_on="all_reduce_u64")
    c = _dckpt.Checkpointer(bad)
    err = caught(c.save, str(tmp_path / "bad"), desc, [])
    assert err[0] == "CollectiveError" and "injected failure in all_reduce_u64" in err[1], err
    # Poisoned: the ranks no longer agree on where they are.
    n = len(bad.calls)
    err = caught(c.save, str(tmp_path / "bad2"), desc, [])
    assert err[0] == "CollectiveError" and "poisoned" in err[1], err
    assert len(bad.calls) == n
    assert not os.path.exists(tmp_path / "bad" / "dckpt.meta")


class _Interrupted(_OneRank):
    """A collective whose gather is interrupted by Ctrl-C while torch.distributed waits."""

    def _call(self, name):
        super()._call(name)
        if name == "gather":
            raise KeyboardInterrupt


def test_ctrl_c_inside_the_collective_is_raised_as_itself(tmp_path):
    # It came back as CollectiveError, an Exception: a training loop's `except Exception`
    # around its save took the user's Ctrl-C.
    from dckpt import _dckpt

    keep = torch.zeros(4)
    desc = [_dckpt.tensor_piece("w", "f32", [4], [0], [4], keep.data_ptr(), 16)]
    c = _dckpt.Checkpointer(_Interrupted())
    try:
        c.save(str(tmp_path / "x"), desc, [])
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the save returned")


EXIT_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import dckpt.torch as dt
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.arange(1 << 20, dtype=torch.float32) + rank
dt.save({"x": dt.Shard(x, (2 << 20,), ((1 << 20) * rank,))}, sys.argv[1], async_save=True)
# No wait(), no destroy_process_group(): the exit must finish the save, not hang.
"""


def test_interpreter_exit_finishes_a_background_save(tmp_path):
    import subprocess
    import sys

    from conftest import free_port

    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    loc = str(tmp_path / "ckpt")
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), loc], env=env))
    for p in procs:
        assert p.wait(timeout=120) == 0
    back = {"x": torch.zeros(2 << 20)}
    dt.load(back, loc)
    want = torch.cat([torch.arange(1 << 20, dtype=torch.float32), torch.arange(1 << 20, dtype=torch.float32) + 1])
    assert torch.equal(back["x"], want)



def replicas_that_differ(rank: int, world: int, root: str):
    """Two ranks call their halves of one tensor replicas of it (form (a) of the ETP bug):
    the default check refuses it on every rank before writing; `off` lets it through."""
    half = torch.full((4, 8), float(rank + 1))
    state = {"experts.fc1": dt.Shard(half, (4, 8), (0, 0), replica_id=rank)}
    err = caught(dt.save, state, os.path.join(root, "a"))
    a = os.path.join(root, "a")
    written = sorted(os.listdir(a)) if os.path.isdir(a) else []
    dt.save(state, os.path.join(root, "off"), replica_check="off")
    bad = caught(dt.save, state, os.path.join(root, "x"), replica_check="every")
    return err, written, bad


def test_replicas_that_differ_are_refused_on_every_rank(tmp_path):
    results = run_ranks(replicas_that_differ, 2, str(tmp_path))
    for err, written, bad in results:
        assert err is not None and err[0] == "CoverageError", err
        assert "experts.fc1" in err[1] and "replicas differ" in err[1] and "rank 1" in err[1], err
        assert written == [], written
        assert bad is not None and bad[0] == "ValueError" and "replica_check" in bad[1], bad
    assert (tmp_path / "off").is_dir()


def plain_values_that_differ(rank: int, world: int, root: str):
    """A plain value is saved once, so one that another rank holds otherwise is refused on
    every rank before anything is written, one holding bytes (stored as a pickle that names
    no class) too; equal dicts built in another order, with or without bytes, bytes, a
    per-rank Object and pickles of classes (which have no canonical form, so are not
    compared) save."""
    w = torch.arange(4.0)
    differ = caught(dt.save, {"w": w, "step": 10, "rank": rank}, os.path.join(root, "differ"))
    written = os.listdir(os.path.join(root, "differ")) if os.path.isdir(os.path.join(root, "differ")) else []
    loader = {"epoch": 1, "state": b"rank %d" % rank}
    differ_bytes = caught(dt.save, {"w": w, "loader": loader}, os.path.join(root, "differ-bytes"))
    cfg = {"a": 1, "b": [2, 3]} if rank == 0 else {"b": [2, 3], "a": 1}
    shared = {"n": 1, "buf": bytearray(b"x")} if rank == 0 else {"buf": b"x", "n": 1}
    state = {"w": w, "cfg": cfg, "raw": b"same", "shared": shared, "mine": dt.Object(f"rank {rank}", (world,), (rank,))}
    dt.save(state, os.path.join(root, "same"))
    back = {"w": torch.zeros(4), "cfg": None, "raw": None, "shared": None, "mine": dt.Object(None, (world,), (rank,))}
    dt.load(back, os.path.join(root, "same"))
    dt.save({"w": w, "s": {str(rank)}}, os.path.join(root, "pickled"), allow_pickle=True)
    return differ, differ_bytes, written, back["cfg"], back["raw"], back["shared"], back["mine"].value


def test_plain_values_that_differ_are_refused_on_every_rank(tmp_path):
    results = run_ranks(plain_values_that_differ, 2, str(tmp_path))
    for rank, (differ, differ_bytes, written, cfg, raw, shared, mine) in enumerate(results):
        assert differ is not None and differ[0] == "CoverageError", differ
        assert '"rank"' in differ[1] and "rank 1 holds" in differ[1] and "main copy's on rank 0" in differ[1], differ
        assert differ_bytes is not None and differ_bytes[0] == "CoverageError", differ_bytes
        assert '"loader"' in differ_bytes[1] and "rank 1 holds" in differ_bytes[1], differ_bytes
        assert written == [], written
        assert (cfg, raw, shared, mine) == ({"a": 1, "b": [2, 3]}, b"same", {"n": 1, "buf": b"x"}, f"rank {rank}")
        # The main copy's (rank 0's) type comes back: a bytearray, loaded without allow_pickle.
        assert type(shared["buf"]) is bytearray, shared
    assert (tmp_path / "pickled").is_dir()


def test_state_dict_walk_and_short_path_edges(tmp_path):
    """Keys are dotted paths (list indices as numbers); two leaves with one key and empty
    keys are refused before anything is written; parameters, 0-d and empty tensors take the
    short path; a quantized tensor (no dckpt dtype) takes the long one, saved dequantized."""
    w, b = gen((3, 4), torch.bfloat16, 1), gen((4,), torch.float32, 2)
    with warnings.catch_warnings():  # quantized dtypes are deprecated in torch, not gone
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, -2.0]), 0.5, 0, torch.qint8)
    state = {
        "model": {"layers": [{"w": torch.nn.Parameter(w.clone())}, {"b": b.clone()}]},
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 5, dtype=torch.int32),
        "q": q,
        "meta": {"lr": 0.1, "names": ["a", "b"]},
    }
    path = str(tmp_path / "walk")
    dt.save(state, path)
    stored = dt.metadata(path)["tensors"]
    assert sorted(stored) == ["empty", "model.layers.0.w", "model.layers.1.b", "q", "scalar"], sorted(stored)
    assert stored["q"]["dtype"] == "f32", stored["q"]

    target = {
        "model": {"layers": [{"w": torch.nn.Parameter(torch.zeros_like(w))}, {"b": torch.zeros(4)}]},
        "scalar": torch.tensor(0.0, dtype=torch.float64),
        "empty": torch.zeros(0, 5, dtype=torch.int32),
        "q": torch.zeros(3),
        "meta": None,
    }
    dt.load(target, path)
    assert same_bits(target["model"]["layers"][0]["w"].detach(), w)
    assert same_bits(target["model"]["layers"][1]["b"], b)
    assert target["scalar"].item() == 3.25 and target["meta"] == {"lr": 0.1, "names": ["a", "b"]}
    assert torch.equal(target["q"], q.dequantize())

    dup = {"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}
    err = caught(dt.save, dup, str(tmp_path / "dup"))
    assert err[0] == "ValueError" and "'a.b'" in err[1], err
    err = caught(dt.save, {"": torch.zeros(1)}, str(tmp_path / "empty-key"))
    assert err[0] == "ValueError" and "empty" in err[1], err
    assert not (tmp_path / "dup").exists() and not (tmp_path / "empty-key").exists()


def test_load_targets_that_share_memory(tmp_path):
    """Views into one flat buffer and tied weights load in place: each target gets its
    key's values, the one listed last winning where they overlap. A target that cannot take
    its value (an element of a tuple) is refused before any byte is read."""
    path = str(tmp_path / "views")
    w = gen((4,), torch.float32, 3)
    dt.save({"flat": torch.arange(10.0), "tail": 100 + torch.arange(4.0), "a": w, "b": w.clone()}, path)
    base, tied = torch.zeros(10), torch.zeros(4)
    dt.load({"flat": base, "tail": base[6:], "a": tied, "b": tied}, path)
    assert base.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 100.0, 101.0, 102.0, 103.0], base
    assert same_bits(tied, w)
    # A strided view overlapping a contiguous target goes through its own temporary too.
    base.zero_()
    dt.load({"flat": base, "tail": base[1::2][:4]}, path, strict=False)
    assert base.tolist() == [0.0, 100.0, 2.0, 101.0, 4.0, 102.0, 6.0, 103.0, 8.0, 9.0], base

    dt.save({"opt": [torch.ones(2), 5]}, str(tmp_path / "tuple"))
    into = torch.zeros(2)
    err = caught(dt.load, {"opt": (into, None)}, str(tmp_path / "tuple"))
    assert err[0] == "TypeError" and "opt.1" in err[1] and "tuple" in err[1], err
    assert into.tolist() == [0.0, 0.0]

    sparse = torch.eye(3).to_sparse()
    err = caught(dt.save, {"s": sparse}, str(tmp_path / "sparse"))
    assert err[0] == "TypeError" and "s: a torch.sparse_coo tensor" in err[1], err
    assert not (tmp_path / "sparse").exists()


def test_a_load_leaves_what_it_did_not_read(tmp_path):
    """A target read through a temporary (a strided view; tied weights, through the native
    side's) keeps what it held when its key is not stored, and every target keeps it when a
    local restore finds no step: a temporary goes back only when the load filled it."""
    path = str(tmp_path / "ck")
    w = gen((4,), torch.float32, 3)
    dt.save({"a": w}, path)
    base, tied = torch.arange(8.0), torch.full((4,), 7.0)
    got = dt.load({"gone": base[::2], "a": tied, "b": tied}, path, strict=False, info=True)
    assert (got["missing"], got["unexpected"]) == (["b", "gone"], []) and got["bytes_read"] >= 16, got
    assert base.tolist() == [float(i) for i in range(8)], base
    assert same_bits(tied, w), tied
    m = dt.CheckpointManager(str(tmp_path / "run"), local=str(tmp_path / "node{node}"), local_copies=1, ranks_per_node=1)
    assert m.load_latest({"x": base[::2], "a": tied, "b": tied}) is None
    assert base.tolist() == [float(i) for i in range(8)] and same_bits(tied, w), (base, tied)


def test_a_value_that_holds_itself_is_refused(tmp_path):
    """A list that holds itself is an error of this rank's (JSON's circular reference),
    which the others hear of; the walk that looks for tensors in it spun forever before."""
    x: list = []
    x.append(x)
    err = caught(dt.save, {"w": torch.zeros(2), "a": x}, str(tmp_path / "cycle"))
    assert err is not None and err[0] == "ValueError" and "ircular" in err[1] and err[1].startswith("a: "), err


class Moved:
    """A class a checkpoint pickles, then gone from its module (code moved since the save)."""


def test_values_that_do_not_encode_or_decode_name_their_key(tmp_path, monkeypatch):
    """What the pickle raises names the key it was storing or loading, not only the
    value's innards."""
    err = caught(dt.save, {"opt": {"sched": lambda: 1}}, str(tmp_path / "lambda"), allow_pickle=True)
    assert err is not None and err[1].startswith("opt: "), err
    path = str(tmp_path / "moved")
    dt.save({"w": torch.zeros(2), "extra": {"obj": Moved()}}, path, allow_pickle=True)
    monkeypatch.delattr(sys.modules[__name__], "Moved")
    back = {"w": torch.zeros(2), "extra": {"obj": None}}
    err = caught(dt.load, back, path, allow_pickle=True)
    assert err is not None and err[0] == "AttributeError" and err[1].startswith("extra: "), err
    assert "Moved" in err[1], err


MAPPED_SCRIPT = """
import os, signal, sys, torch
import dckpt, dckpt.torch as dt
from conftest import caught
loc = sys.argv[1]
x = torch.arange(3 << 20, dtype=torch.float32)
if not os.path.exists(os.path.join(loc, "dckpt.meta")):
    dt.save({"x": x}, loc)
y = {"x": torch.zeros_like(x)}
dt.load(y, loc)
assert torch.equal(y["x"], x)
# Whether this process catches SIGBUS now, from the kernel (Python's `signal.getsignal`
# knows only the handlers it installed itself).
caught_mask = int([l for l in open("/proc/self/status") if l.startswith("SigCgt:")][0].split()[1], 16)
print("handler", "installed" if caught_mask >> (signal.SIGBUS - 1) & 1 else "none")
data = [n for n in os.listdir(loc) if n.endswith(".safetensors")][0]
with open(os.path.join(loc, data), "r+b") as f:
    f.seek(-(5 << 20), os.SEEK_END)
    b = f.read(1)
    f.seek(-(5 << 20), os.SEEK_END)
    f.write(bytes([b[0] ^ 0x40]))
err = caught(dt.load, {"x": torch.zeros_like(x)}, loc)
with open(os.path.join(loc, data), "r+b") as f:
    f.seek(-(5 << 20), os.SEEK_END)
    f.write(b)
print("flip", err[0] if err else None, data in (err[1] if err else ""))
"""


def test_mapped_reads_are_opt_in_and_check_every_byte(tmp_path):
    """``DCKPT_MAPPED_READS=1`` loads through mappings (the native ``SIGBUS`` handler is then
    installed) and still catches a flipped byte, naming the file; unset, no handler is
    installed; any other value is refused by name."""
    import subprocess
    import sys

    script = tmp_path / "mapped.py"
    script.write_text(MAPPED_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    loc = str(tmp_path / "ck")
    outs = {}
    for value in (None, "1"):
        env = {k: v for k, v in os.environ.items() if k != "DCKPT_MAPPED_READS"}
        env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
        if value is not None:
            env["DCKPT_MAPPED_READS"] = value
        r = subprocess.run([sys.executable, str(script), loc], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs[value] = r.stdout.split("\n")
    assert outs[None][:2] == ["handler none", "flip ChecksumError True"], outs
    assert outs["1"][:2] == ["handler installed", "flip ChecksumError True"], outs
    os.environ["DCKPT_MAPPED_READS"] = "yes"
    try:
        err = caught(dt.load, {"x": torch.zeros(1)}, str(tmp_path / "elsewhere"), process_group=dt.LOCAL)
    finally:
        del os.environ["DCKPT_MAPPED_READS"]
    assert err is not None and err[0] == "ValueError" and "DCKPT_MAPPED_READS='yes'" in err[1], err


FAILED_AT_EXIT_SCRIPT = """
import sys, torch
import dckpt.torch as dt
dt.save({"x": torch.ones(4)}, sys.argv[1])
# The same location again, in the background: refused there (it exists); nobody waits.
dt.save({"x": torch.ones(4)}, sys.argv[1], async_save=True)
"""


def test_a_background_save_failing_at_exit_is_logged(tmp_path):
    # Its failure went nowhere: a last checkpoint the user believed written.
    import subprocess
    import sys

    script = tmp_path / "failed_exit.py"
    script.write_text(FAILED_AT_EXIT_SCRIPT)
    loc = str(tmp_path / "ckpt")
    r = subprocess.run([sys.executable, str(script), loc], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "a background save still running at exit failed" in r.stderr and "already committed" in r.stderr, r.stderr
