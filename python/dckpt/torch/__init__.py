"""Save and load PyTorch state dicts with dckpt.

``save(state_dict, location)`` writes every byte of every global tensor once, whatever
the parallel layout, and ``load(state_dict, location)`` fills the given tensors in place,
in whatever layout *they* describe (resharding). ``location`` is a path or an
``s3://bucket/prefix`` URL (credentials and endpoint from the ``AWS_*`` environment).

The state dict is nested dicts and lists; each leaf gets the dotted path to it as its key
(``model.layers.0.weight``, list indices as numbers). Leaves:

- a plain ``torch.Tensor``: the whole tensor, the same on every rank of the group; saved
  once (by the group's first rank; the others hold replicas);
- a DTensor: its local shard, placed by its mesh and placements (``Shard(d)``, uneven
  splits included, and ``Replicate``, over any number of mesh dimensions; ``Partial`` is
  refused);
- :class:`Shard`: an explicit piece of a global tensor, for framework-defined sharding
  (Megatron, ZeRO-1 flat buffers);
- :class:`Object`: an explicit per-rank object in a grid (RNG states);
- anything else is an object: plain Python values (``None``, ``bool``, ``int``, ``float``,
  ``str`` and lists, tuples and str-keyed dicts of these, with no tensor inside) are
  stored as JSON (tuples come back as lists), saved once; other values are pickled, only
  with ``allow_pickle=True`` (on ``load`` too: loading a pickle runs code). ``load``
  replaces such a leaf of the target, ``None`` included, with the stored value.

Collectives: inside an initialised torch.distributed job, dckpt talks over a dedicated
gloo group over ``process_group``'s ranks (the default group when ``None``), created at
the first call on that group; no port of its own. Without an initialised job, or with
``process_group=LOCAL``, the process is a world of one (reading a checkpoint alone inside
a job, say). For very large worlds, ``collective="tcp"`` (or ``DCKPT_COLLECTIVE=tcp`` in the
environment) uses dckpt's own TCP star instead, which keeps Python out of the collective
path: the group's first rank listens on an ephemeral port and publishes ``host:port`` in
the job's store (the default process group's), where the others read it. That rank's
host is ``DCKPT_TCP_HOST`` when set, else its hostname's address; it must be reachable
from every rank. Never ``MASTER_PORT``.

Every rank of the group makes the same calls in the same order. Errors are
``dckpt.DckptError`` subclasses, raised identically on every rank.

Processes: a native checkpointer is kept per process group (a save of the same structure
reuses the previous plan). A forked child (a DataLoader worker) starts afresh as a world
of one and never touches the parent's engines; background saves still running when the
interpreter exits are finished first, then dckpt's gloo groups are destroyed (their worker
threads joined) before the interpreter finalises.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dckpt import _dckpt
from dckpt.torch import _collective
from dckpt.torch._collective import TorchCollective

__all__ = [
    "LOCAL",
    "AsyncSave",
    "CheckpointManager",
    "ManagedAsyncSave",
    "Object",
    "Shard",
    "TorchCollective",
    "load",
    "save",
    "torch_dtype",
    "dtype_name",
]

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor import Shard as _DShard
except ImportError:  # pragma: no cover - older torch
    try:
        from torch.distributed._tensor import DTensor, Replicate
        from torch.distributed._tensor import Shard as _DShard
        from torch.distributed._tensor.placement_types import _Partial as Partial
    except ImportError:
        DTensor = Replicate = _DShard = Partial = None


class _Local:
    def __repr__(self) -> str:
        return "dckpt.torch.LOCAL"


LOCAL = _Local()
"""``process_group=LOCAL``: this process alone, a world of one, even inside a job."""


# --------------------------------------------------------------------------------------
# dtypes

_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
}
for _name, _dckpt_name in (("float8_e4m3fn", "f8_e4m3"), ("float8_e5m2", "f8_e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _dckpt_name
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """dckpt's name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"dckpt cannot store tensors of dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dckpt dtype name (``"bf16"`` -> ``torch.bfloat16``)."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise TypeError(f"no torch dtype for dckpt dtype {name!r}") from None


# --------------------------------------------------------------------------------------
# leaves


def _main(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(int(r) == 0 for r in replica_id)


@dataclass
class Shard:
    """A piece of a global tensor, placed explicitly.

    ``data`` holds the box of ``data.shape`` at ``global_offset`` of a tensor of
    ``global_shape``. ``replica_id``: an int or a tuple of ints; the piece is the main copy
    of its region iff every entry is zero (exactly one holder of each region must be).

    ``flat_range=(start, end)`` is the ZeRO-1 form: ``data`` is then 1-D and holds
    elements ``start..end`` of the row-major flattening of the box of ``local_shape`` at
    ``global_offset`` (``local_shape`` defaults to ``global_shape``, the whole tensor,
    which needs a zero offset). Pieces of several ranks may split one box this way.

    On load, ``data`` is filled in place with the stored elements of its region.

    ``key``: the global tensor's key, when the framework names its tensors itself
    (Megatron); by default the leaf's path in the state dict. Several pieces of one key
    may then sit on one rank.
    """

    data: torch.Tensor
    global_shape: Sequence[int]
    global_offset: Sequence[int]
    replica_id: int | Sequence[int] = 0
    flat_range: tuple[int, int] | None = None
    local_shape: Sequence[int] | None = None
    allow_shape_mismatch: bool = False
    key: str | None = None

    def _box(self, key: str) -> tuple[list[int], list[int], tuple[int, int] | None]:
        gshape = [int(d) for d in self.global_shape]
        offset = [int(d) for d in self.global_offset]
        if self.flat_range is None:
            return offset, list(self.data.shape), None
        start, end = (int(x) for x in self.flat_range)
        if self.local_shape is None:
            if any(offset):
                raise ValueError(f"{key}: a Shard with flat_range and a nonzero global_offset needs local_shape")
            box = gshape
        else:
            box = [int(d) for d in self.local_shape]
        if self.data.numel() != end - start:
            raise ValueError(
                f"{key}: flat_range ({start}, {end}) holds {end - start} elements but data has {self.data.numel()}"
            )
        return offset, box, (start, end)


@dataclass
class Object:
    """A per-rank object at ``global_offset`` in a grid of ``global_shape`` objects under
    one key (Megatron's ShardedObject: one RNG state per (pp, tp) rank, say). Main iff every
    entry of ``replica_id`` is zero. ``value`` is encoded as any object leaf is. On load,
    ``value`` is replaced with the stored one. ``key``: as :class:`Shard`'s."""

    value: Any
    global_shape: Sequence[int] = (1,)
    global_offset: Sequence[int] = (0,)
    replica_id: int | Sequence[int] = 0
    key: str | None = None


# Object encoding: one tag byte, then the body. JSON keeps int and float apart; a tuple
# becomes a list.
_JSON, _PICKLE = b"J", b"P"


def _is_plain(v) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if x is None or isinstance(x, (bool, int, float, str)):
            continue
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                return False
            stack.extend(x.values())
        else:
            return False
    return True


def _encode(key: str, value, allow_pickle: bool) -> bytes:
    if _is_plain(value):
        return _JSON + json.dumps(value, separators=(",", ":")).encode()
    if not allow_pickle:
        raise TypeError(
            f"{key}: a {type(value).__name__} is not a plain value (None, bool, int, float, str, lists and "
            "str-keyed dicts of these); pass allow_pickle=True to save and load it as a pickle"
        )
    return _PICKLE + pickle.dumps(value)


def _decode(key: str, data: bytes, allow_pickle: bool):
    tag, body = data[:1], data[1:]
    if tag == _JSON:
        return json.loads(body)
    if tag == _PICKLE:
        if not allow_pickle:
            raise TypeError(f"{key}: stored as a pickle; pass allow_pickle=True to load it (loading a pickle runs code)")
        return pickle.loads(body)
    raise ValueError(f"{key}: not an object written by dckpt.torch (tag {tag!r})")


def _has_tensors(v) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, (torch.Tensor, Shard, Object)):
            return True
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return False


def _own_key(path: str, leaf) -> str:
    own = getattr(leaf, "key", None) if isinstance(leaf, (Shard, Object)) else None
    return path if own is None else own


_CONTAINERS = (dict, list, tuple)


def _leaves(state) -> list[tuple[str, Any, Any, Any]]:
    """``(key, leaf, parent, index)`` for every leaf, in order. A dict or list without
    tensors inside is one object leaf."""
    if not isinstance(state, _CONTAINERS):
        raise TypeError("the state dict must be a dict or a list")
    out: list[tuple[str, Any, Any, Any]] = []
    _walk("", state, out)
    if len({leaf[0] for leaf in out}) != len(out):
        seen: set[str] = set()
        for key, *_ in out:
            if key in seen:
                raise ValueError(f"two leaves of the state dict have the key {key!r}")
            seen.add(key)
    return out


def _walk(prefix: str, node, out: list) -> None:
    # A tensor is tested first: it is the common leaf and never a container.
    tensor = torch.Tensor
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        key = f"{prefix}.{k}" if prefix else str(k)
        if not key:
            raise ValueError("a key of the state dict is the empty string")
        if not isinstance(v, tensor) and isinstance(v, _CONTAINERS) and _has_tensors(v):
            _walk(key, v, out)
        else:
            out.append((key, v, node, k))


# Tensor types that are plain data, not wrapper subclasses. Dense contiguous CPU ones take
# the short path in save and load: no detach, subclass or staging work, addresses handed
# over as they are.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


# --------------------------------------------------------------------------------------
# process groups, per process


class _Process:
    """What one process keeps: a native checkpointer per process group (so repeated saves
    reuse their plan) and the background saves in flight."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.checkpointers: dict[Any, tuple[Any, _dckpt.Checkpointer]] = {}
        # Held until done even when the caller drops its handle: exit waits for them.
        self.pending: list[AsyncSave] = []
        # A forked child inherits the parent's torch.distributed state, but not its peers.
        self.inherited_job = False


_proc = _Process()


def _after_fork_in_child() -> None:
    global _proc
    old = _proc
    _proc = _Process()
    _proc.inherited_job = old.inherited_job or (dist.is_available() and dist.is_initialized())
    # The parent's native checkpointers are leaked on purpose: they refuse to run here and
    # never touch the parent's threads or sockets when dropped.
    _leaked.append(old)
    _collective._reset_after_fork()


_leaked: list[_Process] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _shutdown() -> None:
    # Background saves call into Python from a Rust thread; finish them while the
    # interpreter can still answer, then release the engines and dckpt's gloo groups.
    p = _proc
    if p.pid != os.getpid():
        return
    with p.lock:
        pending, p.pending = p.pending, []
    for h in pending:
        try:
            h.wait()
        except Exception:
            pass
    with p.lock:
        cps = list(p.checkpointers.values())
        p.checkpointers.clear()
    for _, c in cps:
        c.close()
    # Joins the gloo groups' worker threads while the interpreter can still answer them.
    _collective.release_groups()


def _checkpointer(process_group, collective: str | None) -> tuple[_dckpt.Checkpointer, int]:
    """The native checkpointer for ``process_group`` and this rank's index in it."""
    if collective is None:
        collective = os.environ.get("DCKPT_COLLECTIVE", "gloo")
    if collective not in ("gloo", "tcp"):
        raise ValueError(f"collective={collective!r}: expected 'gloo' or 'tcp'")
    p = _proc
    local = (
        process_group is LOCAL
        or p.inherited_job
        or not dist.is_available()
        or not dist.is_initialized()
    )
    if local:
        cache_key: Any = LOCAL
    else:
        pg = process_group if process_group is not None else dist.group.WORLD
        cache_key = (collective, tuple(dist.get_process_group_ranks(pg)))
    with p.lock:
        hit = p.checkpointers.get(cache_key)
    if hit is not None:
        return hit[1], hit[1].rank
    if local:
        c = _dckpt.Checkpointer(None)
    elif collective == "tcp":
        c = _tcp_checkpointer(pg, cache_key[1])
    else:
        c = _dckpt.Checkpointer(TorchCollective(pg))
    with p.lock:
        p.checkpointers[cache_key] = (process_group, c)
    return c, c.rank


_tcp_worlds = 0


def _tcp_checkpointer(pg, ranks: tuple[int, ...]) -> _dckpt.Checkpointer:
    """dckpt's TCP star over ``pg``'s ranks, rendezvoused through the job's store."""
    import secrets
    import socket
    from datetime import timedelta

    global _tcp_worlds
    _tcp_worlds += 1
    # Every rank of the group makes its n-th TCP world in the same order: one store prefix
    # per (group, n).
    prefix = f"dckpt/tcp/{'-'.join(map(str, ranks))}/{_tcp_worlds}/"
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    timeout = float(os.environ.get("DCKPT_RENDEZVOUS_TIMEOUT_MS", "300000")) / 1000.0
    if rank == 0:
        host = os.environ.get("DCKPT_TCP_HOST") or socket.gethostbyname(socket.gethostname())
        job_id = f"dckpt-{secrets.token_hex(8)}"

        def announce(port: int) -> None:
            store.set("addr", f"{host} {port} {job_id}")

        return _dckpt.Checkpointer.tcp(0, world, host, 0, job_id, timeout, announce)
    store.set_timeout(timedelta(seconds=timeout))
    host, port, job_id = store.get("addr").decode().split(" ")
    return _dckpt.Checkpointer.tcp(rank, world, host, int(port), job_id, timeout)


# --------------------------------------------------------------------------------------
# tensors


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor as plain dense data: no autograd, quantized or wrapper subclasses
    (Transformer Engine's Float8Tensor, say) dequantized."""
    t = t.detach()
    if t.is_quantized or (type(t) not in _PLAIN and hasattr(t, "dequantize")):
        t = t.dequantize()
    return t


def _dtensor_piece(key: str, t) -> tuple[torch.Tensor, list[int], list[int], bool] | None:
    """(local tensor, global offset, global shape, is_main) of this rank's shard of a
    DTensor; None where this rank is not in its mesh."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    for p in placements:
        if p.is_partial():
            raise ValueError(f"{key}: a DTensor with a Partial placement has no stored form; reduce it first")
    gshape = list(t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    is_main = all(coord[i] == 0 for i, p in enumerate(placements) if p.is_replicate())
    local = t.to_local()
    if list(local.shape) != list(local_shape):
        raise ValueError(f"{key}: DTensor local shape {tuple(local.shape)} is not the expected {tuple(local_shape)}")
    return local, list(offset), gshape, is_main


class _Staging:
    """Host copies of device tensors, made with one synchronisation for all of them."""

    def __init__(self) -> None:
        self.cuda = False

    def host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t if t.is_contiguous() else t.contiguous()
        if t.device.type == "meta":
            raise ValueError("meta tensors hold no data")
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        pinned.copy_(t, non_blocking=True)
        self.cuda = self.cuda or t.device.type == "cuda"
        return pinned

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _descriptor_buffer(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def _gc_paused(fn):
    """Runs ``fn`` with Python's cyclic garbage collector off. Walking a state dict makes a
    few objects per tensor, and every collection they trigger traverses the whole heap
    (torch's included): with 20,000 small tensors that was two thirds of the Python time
    of a save or load. Nothing made here is cyclic; collection resumes afterwards."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused


# --------------------------------------------------------------------------------------
# save


class AsyncSave:
    """A save whose tensors are copied; planning, writing and the commit go on in the
    background. ``wait()`` returns its outcome or raises its error (the same on every
    rank); ``done()`` says whether ``wait()`` would return at once."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def done(self) -> bool:
        return self._handle.done()

    def wait(self) -> dict:
        return self._handle.wait()


@_gc_paused
def save(
    state_dict,
    location,
    *,
    process_group=None,
    async_save: bool = False,
    replace: bool = False,
    allow_pickle: bool = False,
    collective: str | None = None,
    replica_check: str = "sample",
):
    """Saves ``state_dict`` at ``location`` (a path or ``s3://`` URL), collectively over
    ``process_group``. Returns the outcome (a dict: ``save_id``, ``bytes``, ``files``,
    ``chunks``, ``rank_bytes``, ``plan_reused``) once the checkpoint is committed
    everywhere, or, with ``async_save=True``, an :class:`AsyncSave` as soon as the tensors
    are copied (they may then change). Raises ``dckpt.AlreadyExists`` where a checkpoint
    is committed unless ``replace=True``, ``dckpt.CoverageError`` when the pieces do not
    cover each tensor exactly once (nothing is written), and ``TypeError`` for a value
    that is not plain without ``allow_pickle``.

    ``replica_check`` says how much of what ranks call copies of one piece (replicated
    tensors, non-main replica ids) is compared byte for byte before anything is written:
    ``"sample"`` (the default: a window of every replicated chunk and a tenth of them
    whole, which catches a split tensor described as replicas at every save), ``"all"``
    or ``"off"``. Copies that differ raise ``dckpt.CoverageError`` naming the tensor and
    the ranks."""
    ckpt, rank = _checkpointer(process_group, collective)
    staging = _Staging()
    keep: list[Any] = []  # every tensor whose address is handed over, alive until the call returns
    tensors: list[tuple] = []
    objects: list[tuple] = []
    # `leaves` keeps every leaf alive until the call returns, the short path's included.
    leaves = _leaves(state_dict)
    first = rank == 0
    with torch.no_grad():
        for key, leaf, _, _ in leaves:
            if type(leaf) in _PLAIN and leaf.is_cpu and leaf.is_contiguous():
                # The common case, kept short: 20,000 small tensors spend their time here.
                # Quantized dtypes have no name: such tensors take the long way.
                name = _DTYPES.get(leaf.dtype)
                if name is not None:
                    shape = leaf.shape  # a tuple: the native side takes any sequence
                    ptr, nbytes = leaf.data_ptr(), leaf.nbytes
                    tensors.append((key, name, shape, (0,) * len(shape), shape, None, first, ptr, nbytes))
                    continue
            key = _own_key(key, leaf)
            if isinstance(leaf, Object):
                data = _encode(key, leaf.value, allow_pickle)
                shape = [int(d) for d in leaf.global_shape]
                offset = [int(d) for d in leaf.global_offset]
                objects.append((key, shape, offset, _main(leaf.replica_id), data))
                continue
            if isinstance(leaf, Shard):
                data = _plain(leaf.data)
                offset, box, flat = leaf._box(key)
                gshape = [int(d) for d in leaf.global_shape]
                is_main = _main(leaf.replica_id)
            elif DTensor is not None and isinstance(leaf, DTensor):
                piece = _dtensor_piece(key, leaf)
                if piece is None:
                    continue
                local, offset, gshape, is_main = piece
                data, box, flat = _plain(local), list(local.shape), None
            elif isinstance(leaf, torch.Tensor):
                data = _plain(leaf)
                gshape = list(data.shape)
                offset, box, flat, is_main = [0] * data.dim(), gshape, None, rank == 0
            else:
                objects.append((key, [], [], rank == 0, _encode(key, leaf, allow_pickle)))
                continue
            if data.layout is not torch.strided:
                raise TypeError(f"{key}: a {data.layout} tensor has no dense form here; store t.to_dense()")
            host = staging.host(data)
            keep.append(host)
            ptr, nbytes = _descriptor_buffer(host)
            tensors.append((key, dtype_name(host.dtype), gshape, offset, box, flat, is_main, ptr, nbytes))
    staging.sync()
    layout = {"world_size": str(ckpt.world_size)}
    try:
        out = ckpt.save(
            str(location),
            tensors,
            objects,
            replace=replace,
            async_save=async_save,
            layout=layout,
            replica_check=replica_check,
        )
    finally:
        del keep
    if async_save:
        h = AsyncSave(out)
        p = _proc
        with p.lock:
            p.pending = [x for x in p.pending if not x.done()] + [h]
        return h
    return out


# --------------------------------------------------------------------------------------
# load


@_gc_paused
def load(
    state_dict,
    location,
    *,
    process_group=None,
    strict: bool = True,
    allow_pickle: bool = False,
    collective: str | None = None,
    unexpected: str | None = None,
):
    """Fills the tensors of ``state_dict`` in place from the checkpoint at ``location``,
    whatever layout it was saved in, replaces its object leaves with the stored values,
    and returns ``state_dict``. With ``strict`` (the default) a requested key that is not
    stored raises ``dckpt.MissingKeys`` and a stored key nobody requested raises
    ``dckpt.UnexpectedKeys``, on every rank; without it such tensors are left as they are.
    ``unexpected`` (``"raise"``, ``"return"``, ``"log"``, ``"ignore"``) overrides what
    ``strict`` does with stored keys nobody requested (a partial load asks ``"ignore"``).
    Every byte used is checked against its checksum (``dckpt.ChecksumError``)."""
    ckpt, _ = _checkpointer(process_group, collective)
    tensors: list[tuple] = []
    objects: list[tuple] = []
    object_leaves: list[tuple[str, Any, Any, Any]] = []
    keep: list[Any] = []
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def target(key: str, dest: torch.Tensor) -> tuple[int, int]:
        dest = dest.detach()
        if type(dest) not in _PLAIN or dest.is_quantized:
            raise TypeError(f"{key}: cannot load into a {type(dest).__name__} in place")
        if dest.layout is not torch.strided:
            raise TypeError(f"{key}: cannot load into a {dest.layout} tensor in place; load into a dense one")
        # Targets sharing bytes (tied weights, views of one buffer) are the native side's
        # to fill through temporaries.
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        if direct:
            buf = dest
        else:
            # A non-contiguous or device target is read into a contiguous host temporary
            # and copied back; `reshape` would silently copy instead of writing through.
            pin = dest.device.type == "cuda"
            buf = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=pin)
            copy_back.append((dest, buf))
        keep.append(buf)
        return _descriptor_buffer(buf)

    leaves = _leaves(state_dict)  # alive until the call returns, the short path's leaves included
    with torch.no_grad():
        for key, leaf, parent, index in leaves:
            if type(leaf) in _PLAIN and leaf.is_cpu and leaf.is_contiguous():
                # The common case, kept short (see save).
                name = _DTYPES.get(leaf.dtype)
                if name is not None:
                    shape = leaf.shape
                    ptr, nbytes = leaf.data_ptr(), leaf.nbytes
                    tensors.append((key, name, shape, (0,) * len(shape), shape, None, False, ptr, nbytes))
                    continue
            key = _own_key(key, leaf)
            if isinstance(leaf, Object):
                shape = [int(d) for d in leaf.global_shape]
                offset = [int(d) for d in leaf.global_offset]
                objects.append((key, shape, offset))
                object_leaves.append((key, leaf, parent, index))
                continue
            if isinstance(leaf, Shard):
                offset, box, flat = leaf._box(key)
                gshape = [int(d) for d in leaf.global_shape]
                dest, mismatch = leaf.data, leaf.allow_shape_mismatch
            elif DTensor is not None and isinstance(leaf, DTensor):
                piece = _dtensor_piece(key, leaf)
                if piece is None:
                    continue
                dest, offset, gshape, _ = piece
                box, flat, mismatch = list(dest.shape), None, False
            elif isinstance(leaf, torch.Tensor):
                dest, mismatch = leaf, False
                gshape = list(dest.shape)
                offset, box, flat = [0] * dest.dim(), gshape, None
            else:
                if isinstance(parent, tuple):  # refused before any byte is read
                    raise TypeError(f"{key}: cannot replace an element of a tuple; use a list in the target state dict")
                objects.append((key, [], []))
                object_leaves.append((key, leaf, parent, index))
                continue
            ptr, nbytes = target(key, dest)
            tensors.append((key, dtype_name(dest.dtype), gshape, offset, box, flat, mismatch, ptr, nbytes))
        policy = "raise" if strict else "return"
        unrequested = policy if unexpected is None else unexpected
        _, datas = ckpt.load(str(location), tensors, objects, missing=policy, unexpected=unrequested)
        for dest, buf in copy_back:
            dest.copy_(buf)
        if any(d.device.type == "cuda" for d, _ in copy_back):
            torch.cuda.synchronize()
    del keep
    for (key, leaf, parent, index), data in zip(object_leaves, datas):
        if data is None:
            continue
        value = _decode(key, data, allow_pickle)
        if isinstance(leaf, Object):
            leaf.value = value
        else:
            parent[index] = value
    return state_dict


def metadata(location) -> dict:
    """The index of the checkpoint at ``location``, read by this process alone: its
    tensors ``{key: {"dtype", "shape", "chunks": [(offset, shape)], "flat_chunks":
    [(offset, shape, start, stop)]}}`` (boxes, and pieces that are a flat range of a box),
    its objects ``{key: {"grid_shape", "entries": [grid_offset]}}`` and its saved layout."""
    return _dckpt.metadata(str(location))


from dckpt.torch._manager import CheckpointManager, ManagedAsyncSave  # noqa: E402
