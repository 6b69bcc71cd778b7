"""The host side of tensors and walks, where no GPU or thread can show it: device copies
waited for on each device, errors that name the key, and the cyclic collector off for the
walk only, not for the native call."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import dckpt.torch as dt
from dckpt.torch import _leaves, _process
from conftest import caught, gen, same_bits


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on ``_where`` (no accelerator here), and records the
    copies made from it: ``(device, non_blocking)``."""

    copies: list = []

    @property
    def device(self):
        return self._where

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[1], _OnDevice):
            cls.copies.append((str(args[1]._where), bool(kwargs.get("non_blocking", False))))
        out = super().__torch_function__(func, types, args, kwargs)
        # What is made of it (a detach, a narrow) lives where it does.
        if isinstance(out, _OnDevice) and not hasattr(out, "_where"):
            out._where = next(a for a in args if isinstance(a, _OnDevice))._where
        return out


def _on(device: str, data: torch.Tensor) -> torch.Tensor:
    t = torch.Tensor._make_subclass(_OnDevice, data)
    t._where = torch.device(device)
    return t


def test_staging_waits_for_every_cuda_device_and_copies_others_blocking(monkeypatch):
    """A copy from cuda:1 is waited for on cuda:1, not only on the current device; a copy
    from an accelerator `torch.cuda.synchronize` does not wait for is made blocking."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    _OnDevice.copies = []
    data = [(d, gen((2, 3), torch.float32, i)) for i, d in enumerate(("cuda:0", "cuda:1", "cuda:1", "xpu:0"))]
    staging = _leaves._Staging()
    hosts = [staging.host(_on(d, t), f"t{i}") for i, (d, t) in enumerate(data)]
    staging.sync()
    assert sorted(str(d) for d in synced) == ["cuda:0", "cuda:1"], synced  # each device once
    assert [d for d, _ in _OnDevice.copies] == [d for d, _ in data], _OnDevice.copies
    assert dict(_OnDevice.copies)["xpu:0"] is False, _OnDevice.copies  # nothing else waits for it
    for host, (_, t) in zip(hosts, data):
        assert type(host) is torch.Tensor and same_bits(host, t)


def test_errors_name_the_key(tmp_path):
    """A dtype dckpt has no name for, a sparse tensor (on the short path, where torch's own
    `is_contiguous` error came first) and a meta tensor: each refused naming its key, on
    save and on load, before anything is written."""
    loc = str(tmp_path / "c")
    err = caught(dt.save, {"spectrum": torch.zeros(3, dtype=torch.complex64)}, loc)
    assert err[0] == "TypeError" and err[1].startswith("spectrum: ") and "complex64" in err[1], err
    with warnings.catch_warnings():  # sparse CSR is "beta" in torch
        warnings.simplefilter("ignore", UserWarning)
        csr = torch.eye(3).to_sparse_csr()
    err = caught(dt.save, {"csr_weight": csr}, loc)
    assert err[0] == "TypeError" and err[1].startswith("csr_weight: ") and "dense" in err[1], err
    err = caught(dt.save, {"ghost": torch.empty(2, 2, device="meta")}, loc)
    assert err[0] == "ValueError" and err[1].startswith("ghost: ") and "meta" in err[1], err
    assert not (tmp_path / "c").exists()

    dt.save({"spectrum": torch.zeros(3), "csr_weight": torch.zeros(3, 3)}, loc)
    err = caught(dt.load, {"spectrum": torch.zeros(3, dtype=torch.complex64)}, loc, strict=False)
    assert err[0] == "TypeError" and err[1].startswith("spectrum: ") and "complex64" in err[1], err
    err = caught(dt.load, {"csr_weight": csr}, loc, strict=False)
    assert err[0] == "TypeError" and err[1].startswith("csr_weight: ") and "dense" in err[1], err
    assert dt.dtype_name(torch.bfloat16) == "bf16"  # the key is optional for other callers


class _Watched(dict):
    """A state dict that records whether the collector is on whenever the walk reads it."""

    def __init__(self, seen: list, *args) -> None:
        super().__init__(*args)
        self.seen = seen

    def items(self):
        self.seen.append(("walk", gc.isenabled()))
        return super().items()


class _Recording:
    """The process's native checkpointer, recording whether the collector is on in its
    save and load (which release the GIL for as long as they write or read)."""

    def __init__(self, inner, seen: list) -> None:
        self.inner, self.seen = inner, seen
        self.rank, self.world_size = inner.rank, inner.world_size

    def save(self, *args, **kwargs):
        self.seen.append(("native", gc.isenabled()))
        return self.inner.save(*args, **kwargs)

    def load(self, *args, **kwargs):
        self.seen.append(("native", gc.isenabled()))
        return self.inner.load(*args, **kwargs)


def test_collector_is_off_for_the_walk_only(tmp_path, monkeypatch):
    real = _process._checkpointer
    seen: list = []

    def recording(*args):
        ckpt, rank = real(*args)
        return _Recording(ckpt, seen), rank

    monkeypatch.setattr(_process, "_checkpointer", recording)
    assert gc.isenabled()
    w = gen((4, 3), torch.float32, 5)
    loc = str(tmp_path / "gc")
    dt.save(_Watched(seen, {"w": w, "step": 3}), loc)
    back = _Watched(seen, {"w": torch.zeros(4, 3), "step": None})
    dt.load(back, loc)
    assert same_bits(back["w"], w) and back["step"] == 3
    assert seen == [("walk", False), ("native", True)] * 2, seen
    assert gc.isenabled()


def test_engine_warnings_reach_python_logging(tmp_path, caplog):
    """``unexpected="log"`` (and every other warning of the engine) reaches the ``dckpt``
    logger of Python's ``logging``; it once went to a logger no one had installed."""
    import logging

    loc = str(tmp_path / "ckpt")
    dt.save({"kept": gen((4,), torch.float32, 1), "extra_stored_key": gen((3,), torch.int64, 2)}, loc)
    sd = {"kept": torch.empty(4)}
    with caplog.at_level(logging.INFO, logger="dckpt"):
        dt.load(sd, loc, strict=False, unexpected="log")
    said = [r for r in caplog.records if r.name == "dckpt"]
    assert any(r.levelno == logging.WARNING and "extra_stored_key" in r.getMessage() for r in said), said
    assert same_bits(sd["kept"], gen((4,), torch.float32, 1))


def test_a_piece_with_a_negative_offset_names_its_key():
    """A shape or offset that is not a list of non-negative integers is refused naming the
    tensor (it was pyo3's bare OverflowError)."""
    from dckpt import _dckpt

    t = torch.zeros(2)
    err = caught(_dckpt.tensor_piece, "neg.offset", "f32", [4], [-1], [2], t.data_ptr(), t.nbytes)
    assert err is not None and "neg.offset" in err[1] and "offset" in err[1], err


def test_object_codec_bytes_and_hostile_pickles():
    """Bytes and plain values holding them load without allow_pickle; a pickle that names a
    class, or holds anything else, is refused with TypeError; a pickle that shares or
    contains its own containers is walked once per container, not forever."""
    import pickle
    from collections import OrderedDict

    from dckpt.torch import decode_object, encode_object

    state = {"dp_rank_0": b"\x80\x04s", "world_size": 1, "t": (1, [b"x"])}
    data = encode_object("dl", state, allow_pickle=False)
    assert data[:1] == b"P" and decode_object("dl", data, allow_pickle=False) == state
    assert decode_object("raw", encode_object("raw", bytearray(b"ab"), False), False) == b"ab"
    # Subclasses pickle their class: refused on save without allow_pickle.
    for odd in (OrderedDict(a=b"x"), {"s": {1, 2}, "b": b"x"}):
        with pytest.raises(TypeError, match="allow_pickle"):
            encode_object("odd", odd, allow_pickle=False)
    for stored in (pickle.dumps(OrderedDict(a=1)), pickle.dumps({1, 2}), b"\x80\x04truncated"):
        with pytest.raises(TypeError, match="allow_pickle"):
            decode_object("odd", b"P" + stored, allow_pickle=False)
    # 2^60 paths through 60 shared lists, and a list inside itself.
    x: list = [b"leaf"]
    for _ in range(60):
        x = [x, x]
    assert decode_object("dag", b"P" + pickle.dumps(x), allow_pickle=False)[0][1][0] is not None
    loop: list = []
    loop.append(loop)
    back = decode_object("loop", b"P" + pickle.dumps(loop), allow_pickle=False)
    assert back[0] is back


def test_plain_values_with_bytes_digest_by_value_and_type():
    """The digest that compares copies of plain values holding bytes across ranks: equal
    values of one type alike (dicts in another order, bytes and bytearray, a value shared or
    copied, a cycle of one shape), values of other types or contents not, and shared or deep
    values in time linear in what they hold (2^60 paths through 60 shared lists); a value
    shared and cyclic at once past a bound of items walked again is not compared (``None``)."""
    from dckpt.torch._objects import _canonical as digest

    same = [
        ({"a": b"x", "b": [1, (2, "s")]}, {"b": [1, (2, "s")], "a": bytearray(b"x")}),
        ([b"q", b"q"], [b"q", bytes(bytearray(b"q"))]),
    ]
    shared: list = [b"leaf"]
    for _ in range(8):
        shared = [shared, shared]

    def fresh(depth: int) -> list:  # the same value, nothing in it shared
        return [b"leaf"] if depth == 0 else [fresh(depth - 1), fresh(depth - 1)]

    same.append((shared, fresh(8)))
    loops = []
    for _ in range(2):
        loop: list = [1]
        loop.append(loop)
        loops.append(loop)
    same.append(tuple(loops))
    for a, b in same:
        assert digest(a) == digest(b), (a, b)
    differ = [([1], (1,)), (1, True), (1, 1.0), (0.0, -0.0), ("a", b"a"), ([[1], [2]], [[1, 2]]), ({"a": 1}, {"b": 1})]
    differ += [(10**5000, 10**5000 + 1), (loops[0], [1, [1, loops[0]]])]
    # A container whose items refer to one around it digests by its place, not once: [A, B]
    # with A = [B], B = [A] against [A, C] with C = [the whole] (B taken once would read as
    # C, and these two would pass as one value).
    a_: list = []
    b_ = [a_]
    a_.append(b_)
    a2: list = []
    b2 = [a2]
    a2.append(b2)
    second: list = [a2, None, b"x"]
    second[1] = [second]
    differ.append(([a_, b_, b"x"], second))
    for a, b in differ:
        assert digest(a) != digest(b), (a, b)
    dag: list = [b"leaf"]
    for _ in range(60):
        dag = [dag, dag]
    deep: list = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    assert digest(dag) != digest(deep)
    # No canonical form: a set, a dict keyed otherwise than by str, a subclass of a builtin.
    from collections import OrderedDict

    for odd in ({"s": {1}, "b": b"x"}, {1: b"x"}, [OrderedDict(a=b"x")]):
        assert digest(odd) is None, odd
    # Shared and cyclic at once: given up on (not compared) rather than 2^60 walks.
    inner = dag
    while isinstance(inner[0][0], list):
        inner = inner[0]
    inner[0].append(dag)
    assert digest(dag) is None
    # Few containers, each walked again in full wherever it stands (it refers to the one
    # around it): the bound counts the items walked again, so this gives up after about ten
    # walks of the long one rather than 10^9 items.
    outer: list = []
    long = [outer, b"", *range(10_000)]
    outer.extend([long] * 100_000)
    assert digest(outer) is None


def test_a_load_into_meta_tensors_is_refused_naming_the_key(tmp_path):
    # A copy into a meta tensor does nothing: the load reported success and a model built
    # on the meta device was then initialised from scratch.
    loc = str(tmp_path / "ckpt")
    dt.save({"w": torch.ones(4)}, loc)
    with pytest.raises(TypeError, match="w: cannot load into a tensor on the meta device"):
        dt.load({"w": torch.empty(4, device="meta")}, loc)


def test_a_load_into_an_expanded_view_is_refused_before_anything_is_read(tmp_path):
    # Its elements share memory: torch's copy back refused it after the load, on that rank
    # alone (the others reported success), its later targets left unfilled.
    loc = str(tmp_path / "ckpt")
    dt.save({"w": torch.ones(3, 4), "z": torch.ones(4, 3)}, loc)
    z = torch.zeros(3, 4).t()
    with pytest.raises(TypeError, match="w: cannot load into a tensor whose elements share memory"):
        dt.load({"w": torch.zeros(1, 4).expand(3, 4), "z": z}, loc)
    assert not z.any()


def test_negated_views_are_saved_and_loaded_as_their_values(tmp_path):
    # A negated view is contiguous over memory that holds its values' negatives: handed over
    # as it was, the save stored them and a load into one read back their negatives.
    loc = str(tmp_path / "ckpt")
    imag = torch.tensor([1 + 2j]).conj().imag  # one element: contiguous
    neg = torch._neg_view(gen((2, 3), torch.float32, 1))
    assert imag.is_neg() and imag.is_contiguous() and neg.is_neg() and neg.is_contiguous()
    dt.save({"imag": imag, "neg": neg}, loc)
    plain = {"imag": torch.zeros(1), "neg": torch.zeros(2, 3)}
    dt.load(plain, loc)
    assert plain["imag"].tolist() == [-2.0]
    assert same_bits(plain["neg"], -gen((2, 3), torch.float32, 1))
    base = torch.zeros(2, 3)
    into = {"neg": torch._neg_view(base)}
    dt.load(into, loc, strict=False)
    assert same_bits(into["neg"].resolve_neg(), -gen((2, 3), torch.float32, 1))
    assert same_bits(base, gen((2, 3), torch.float32, 1))


def test_the_dcp_reader_waits_for_every_cuda_device(tmp_path, monkeypatch):
    # Targets on cuda:0 and cuda:1 are filled by copies that do not block: the reader waited
    # for the current device only, and handed the planner a target on the other unfilled.
    import torch.distributed.checkpoint as dcp

    from dckpt.dcp import DckptStorageReader

    loc = str(tmp_path / "ckpt")
    dt.save({"a": gen((3,), torch.float32, 1), "b": gen((4,), torch.float32, 2)}, loc)
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    empty = torch.empty  # no driver here to pin host memory with
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    _OnDevice.copies = []
    sd = {"a": _on("cuda:0", torch.zeros(3)), "b": _on("cuda:1", torch.zeros(4))}
    dcp.load(sd, storage_reader=DckptStorageReader(loc), no_dist=True)
    assert sorted(str(d) for d in synced) == ["cuda:0", "cuda:1"], synced
    assert same_bits(sd["a"].as_subclass(torch.Tensor), gen((3,), torch.float32, 1))
    assert same_bits(sd["b"].as_subclass(torch.Tensor), gen((4,), torch.float32, 2))


def test_a_load_that_allows_it_is_cast_as_torch_casts(tmp_path):
    # torch_dist loads an fp32 checkpoint into bf16 parameters (and back); dckpt refused
    # any other dtype, so Megatron's strategy could not load such a model.
    loc = str(tmp_path / "ckpt")
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * 1e3
    w[0, :4] = torch.tensor([65520.0, 1e-40, -0.0, 1.0 + 2**-8])  # half's overflow, a subnormal, a tie
    h = torch.randn(16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    dt.save({"w": w, "h": h}, loc)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        into = {
            "w": dt.Shard(torch.empty(64, 8, dtype=dtype), (64, 8), (0, 0), allow_dtype_cast=True),
            "h": dt.Shard(torch.empty(16, dtype=torch.float32), (16,), (0,), allow_dtype_cast=True),
        }
        dt.load(into, loc)
        assert same_bits(into["w"].data, w.to(dtype)), dtype
        assert same_bits(into["h"].data, h.to(torch.float32))
    half = {"w": dt.Shard(torch.empty(32, 8, dtype=torch.bfloat16), (64, 8), (32, 0), allow_dtype_cast=True)}
    dt.load(half, loc, unexpected="ignore")
    assert same_bits(half["w"].data, w[32:].to(torch.bfloat16))
    # Not allowed, or not a floating dtype: refused by name, the target untouched.
    plain = {"w": torch.zeros(64, 8, dtype=torch.bfloat16), "h": h.clone()}
    with pytest.raises(Exception, match="stored as f32, requested as bf16; allow a dtype cast"):
        dt.load(plain, loc)
    assert not plain["w"].any()
    # The whole load may allow it, as dcp.load casts: plain tensors too, by the short path.
    as32 = {"w": torch.zeros(64, 8, dtype=torch.bfloat16), "h": torch.zeros(16, dtype=torch.float32)}
    dt.load(as32, loc, allow_dtype_cast=True)
    assert same_bits(as32["w"], w.to(torch.bfloat16)) and same_bits(as32["h"], h.to(torch.float32))
    ints = {"w": dt.Shard(torch.zeros(64, 8, dtype=torch.int32), (64, 8), (0, 0), allow_dtype_cast=True), "h": h}
    with pytest.raises(Exception, match="stored as f32, requested as i32") as refused:
        dt.load(ints, loc)
    assert "allow" not in str(refused.value)
