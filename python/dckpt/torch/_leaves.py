"""The leaves of a state dict: dtypes, :class:`Shard` and :class:`Object`, the walk that
finds them, and tensors as the plain host data whose address the native side reads."""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass
from typing import Any, Sequence

import torch

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None

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


def dtype_name(dtype: torch.dtype, key: str | None = None) -> str:
    """dckpt's name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``); ``TypeError``
    naming ``key`` (the tensor's) where there is none."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        where = "" if key is None else f"{key}: "
        raise TypeError(f"{where}dckpt cannot store tensors of dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dckpt dtype name (``"bf16"`` -> ``torch.bfloat16``)."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise TypeError(f"no torch dtype for dckpt dtype {name!r}") from None


# --------------------------------------------------------------------------------------
# explicit leaves


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

    ``allow_dtype_cast``: on load, a tensor stored as another floating dtype (f16, bf16,
    f32, f64) fills ``data`` cast as ``tensor.to(data.dtype)`` casts it, each stored byte
    checked first; otherwise such a load raises. Megatron's strategy allows it, as
    torch_dist does.
    """

    data: torch.Tensor
    global_shape: Sequence[int]
    global_offset: Sequence[int]
    replica_id: int | Sequence[int] = 0
    flat_range: tuple[int, int] | None = None
    local_shape: Sequence[int] | None = None
    allow_shape_mismatch: bool = False
    key: str | None = None
    allow_dtype_cast: bool = False

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
    ``value`` is replaced with the stored one. ``key``: as :class:`Shard`'s. The copies that
    ranks hold as replicas are compared as plain values are, unless ``compare`` is false:
    then the main copy's value is saved whatever the others hold."""

    value: Any
    global_shape: Sequence[int] = (1,)
    global_offset: Sequence[int] = (0,)
    replica_id: int | Sequence[int] = 0
    key: str | None = None
    compare: bool = True


# --------------------------------------------------------------------------------------
# the walk


def _has_tensors(v) -> bool:
    """Whether a tensor, :class:`Shard` or :class:`Object` is inside ``v``. Each container
    is visited once: a value may share or contain itself (a list holding itself spun here
    forever, while the other ranks waited for this one)."""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if isinstance(x, (torch.Tensor, Shard, Object)):
            return True
        if id(x) in seen:
            continue
        if isinstance(x, dict):
            seen.add(id(x))
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            seen.add(id(x))
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


@contextlib.contextmanager
def _gc_off():
    """Python's cyclic garbage collector off inside the block. Walking a state dict makes a
    few objects per tensor, and every collection they trigger traverses the whole heap
    (torch's included): with 20,000 small tensors that was two thirds of the Python time
    of a save or load. Nothing made here is cyclic; collection resumes afterwards. The
    switch is process-wide: keep the block to the walk, never around a native save or load
    (it releases the GIL for minutes while other threads allocate)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def gc_paused(fn):
    """Runs ``fn`` with Python's cyclic garbage collector off (see :func:`_gc_off`): for a
    function that walks a state dict, not one that also waits on the native engine."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with _gc_off():
            return fn(*args, **kwargs)

    return paused


# --------------------------------------------------------------------------------------
# tensors as host data

# Tensor types that are plain data, not wrapper subclasses. Dense contiguous CPU ones take
# the short path in save and load: no detach, subclass or staging work, addresses handed
# over as they are.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor as plain dense data: no autograd, quantized or wrapper subclasses that
    define their own ``dequantize`` (Transformer Engine's Float8Tensor, say) dequantized,
    other subclasses as plain tensors of their own dtype (``Tensor.dequantize`` of a tensor
    that is not quantized is a cast to float32)."""
    t = t.detach()
    if t.is_quantized or type(t).dequantize is not torch.Tensor.dequantize:
        t = t.dequantize()
    elif type(t) not in _PLAIN:
        t = t.as_subclass(torch.Tensor)
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
    if any(type(p).__name__ == "_StridedShard" for p in placements):
        _check_one_block(key, gshape, mesh, coord, placements, local_shape, offset)
    return local, list(offset), gshape, is_main


def _check_one_block(key: str, gshape, mesh, coord, placements, local_shape, offset) -> None:
    """Refuses a shard that is not one block of the global tensor. Torch's offset of a
    shard under a strided placement is only its first element's: flattening a DTensor
    sharded on its columns, say, leaves each rank every other pair of elements, which a box at
    that offset would silently misplace. Plain ``Shard`` chains always make blocks; FSDP2 over
    tensor parallelism (``_StridedShard`` then ``Shard`` on one dimension) makes blocks too."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
        from torch.distributed.tensor.placement_types import Shard, _StridedShard
    except ImportError as e:
        raise ValueError(
            f"{key}: a DTensor with placements {tuple(placements)}: this torch does not say which elements its "
            "shards hold; redistribute it to Shard placements first"
        ) from e
    sizes, held = list(gshape), {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            d = p.dim
            sizes[d], held[d] = _get_shard_size_and_offsets(
                sizes[d], mesh.size(mesh_dim), coord[mesh_dim], p, held.get(d), gshape[d], False
            )
    for d, idx in held.items():
        n, indices = int(local_shape[d]), idx.tolist()
        if n and indices != list(range(offset[d], offset[d] + n)):
            raise ValueError(
                f"{key}: this rank's shard of a DTensor with placements {tuple(placements)} holds elements "
                f"{indices[:8]}{' ...' if len(indices) > 8 else ''} of dimension {d}, "
                "not one block of the global tensor; "
                "redistribute it to Shard placements (or save its full_tensor()) first"
            )


class _Staging:
    """Host copies of device tensors: CUDA ones made asynchronously and waited for together
    in :meth:`sync`, one synchronisation per device copied from."""

    def __init__(self) -> None:
        self.cuda: set[torch.device] = set()

    def host(self, t: torch.Tensor, key: str) -> torch.Tensor:
        kind = t.device.type
        if t.is_neg():
            # A negated view (`torch._neg_view`, the imaginary part of a conjugate) is
            # contiguous over memory that holds its values' negatives: resolved, not read.
            t = t.resolve_neg()
        if kind == "cpu":
            return t if t.is_contiguous() else t.contiguous()
        if kind == "meta":
            raise ValueError(f"{key}: a meta tensor holds no data")
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        # `torch.cuda.synchronize` waits for CUDA devices only: any other accelerator's copy
        # is made blocking, since nothing would wait for it before the native side reads.
        cuda = kind == "cuda"
        pinned.copy_(t, non_blocking=cuda)
        if cuda:
            self.cuda.add(t.device)
        return pinned

    def sync(self) -> None:
        # Without a device `synchronize` waits for the current one only, not a tensor's on
        # another.
        for device in self.cuda:
            torch.cuda.synchronize(device)


def _descriptor_buffer(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()
