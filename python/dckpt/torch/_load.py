"""``load``: a state dict's tensors filled in place and its objects replaced, through the
process group's checkpointer; and ``metadata``."""

from __future__ import annotations

import functools
from typing import Any

import torch

from dckpt import _dckpt
from dckpt._dckpt import ObjectPiece, TensorPiece, object_piece, tensor_piece
from dckpt.torch import _process
from dckpt.torch._leaves import (
    _DTYPES,
    _PLAIN,
    DTensor,
    Object,
    Shard,
    _descriptor_buffer,
    _dtensor_piece,
    _gc_off,
    _leaves,
    _own_key,
    dtype_name,
)
from dckpt.torch._objects import decode_object


def load(
    state_dict,
    location,
    *,
    process_group=None,
    strict: bool = True,
    allow_pickle: bool = False,
    collective: str | None = None,
    unexpected: str | None = None,
    info: bool = False,
    allow_dtype_cast: bool = False,
):
    """Fills the tensors of ``state_dict`` in place from the checkpoint at ``location``,
    whatever layout it was saved in, replaces its object leaves with the stored values,
    and returns ``state_dict``. With ``strict`` (the default) a requested key that is not
    stored raises ``dckpt.MissingKeys`` and a stored key nobody requested raises
    ``dckpt.UnexpectedKeys``, on every rank; without it such tensors are left as they are.
    ``unexpected`` (``"raise"``, ``"return"``, ``"log"``, ``"ignore"``) overrides what
    ``strict`` does with stored keys nobody requested (a partial load asks ``"ignore"``).
    Every byte used is checked against its checksum (``dckpt.ChecksumError``). With
    ``allow_dtype_cast``, a tensor stored as another floating dtype (f16, bf16, f32, f64) is
    cast into its target as ``tensor.to(dtype)`` casts, as ``dcp.load`` does (a bf16
    checkpoint into an fp32 model); without it such a load raises, naming both dtypes.

    With ``info``, returns what the load did instead: ``{"missing": [keys some rank
    requested that are not stored; their targets keep what they held], "unexpected":
    [stored keys no rank requested, where not ignored], "bytes_read", "bytes_received",
    "metadata_bytes", "layout", "save_id", "phases"}``, the same on every rank but for the
    byte counts; what ``load_state_dict(strict=False)`` returns in torch."""
    outcome = _load(
        state_dict, location, None, process_group, strict, allow_pickle, collective, unexpected, allow_dtype_cast
    )
    return outcome if info else state_dict


def _load(state_dict, location, local, process_group, strict, allow_pickle, collective, unexpected, cast=False) -> dict:
    """:func:`load`, or with ``local`` (the native ``Checkpointer.load``'s dict) a restore
    of the node-local tier at ``location``; the native outcome. Objects the restore did not
    give are left as they are."""
    ckpt, _ = _process._checkpointer(process_group, collective)
    targets = _Targets()
    policy = "raise" if strict else "return"
    unrequested = policy if unexpected is None else unexpected
    where = str(location)
    # The others' news needs no key policy: it fails the load in its first round.
    told = lambda why: ckpt.load(where, [], [], local=local, caller_failed=why)  # noqa: E731
    # The collector is off for the walk only, not the native load (see save); a failure in
    # it may be this rank's alone, and the others hear of it.
    with _process.tell_others(ckpt, told), _gc_off(), torch.no_grad():
        _process.check_choice("unexpected", unrequested, ("raise", "return", "log", "ignore"))
        leaves = _leaves(state_dict)  # alive until the call returns, the short path's leaves included
        tensors, objects, object_leaves = _pieces(leaves, targets, cast)
    objects_check = _ObjectsCheck(object_leaves, allow_pickle)
    with torch.no_grad():
        try:
            outcome, _ = ckpt.load(
                where,
                tensors,
                objects,
                missing=policy,
                unexpected=unrequested,
                local=local,
                check_objects=objects_check if object_leaves else None,
            )
        except BaseException:
            objects_check.raise_own()
            raise
        targets.copy_back(_filled(outcome, ckpt.rank))
    del targets
    # Objects DckptStorageWriter rebuilt from DCP's flattened leaves lack what that
    # flattening drops; the target's own containers keep it, as DCP's load keeps them.
    restore = None
    if (outcome.get("layout") or {}).get("objects_from") == "dcp_leaves":
        from dckpt.dcp._nest import restore_dropped as restore
    for (_, leaf, parent, index), value in zip(object_leaves, objects_check.values):
        if value is _NOT_STORED:
            continue
        if restore is not None:
            value = restore(leaf.value if isinstance(leaf, Object) else leaf, value)
        if isinstance(leaf, Object):
            leaf.value = value
        else:
            parent[index] = value
    return outcome


_NOT_STORED = object()


def _filled(outcome: dict, rank: int):
    """Whether the load filled the targets of a key on ``rank``: a stored key, or any key of
    a restore that read this rank's part (none where it found no whole step, or where this
    rank's part is among the failed)."""
    if "step" in outcome and (outcome["step"] is None or rank in outcome["failed"]):
        return lambda key: False
    missing = set(outcome.get("missing") or ())
    return lambda key: key not in missing


class _ObjectsCheck:
    """The objects decoded inside the native load, once this rank's reads are done and
    before the ranks agree on the outcome: an object this rank alone cannot decode fails the
    load on every rank, rather than this rank alone while the others go on to wait for it."""

    def __init__(self, object_leaves, allow_pickle: bool) -> None:
        self.leaves = object_leaves
        self.allow_pickle = allow_pickle
        self.values: list[Any] = []
        self.error: BaseException | None = None

    def __call__(self, datas) -> str | None:
        try:
            self.values = [
                _NOT_STORED if data is None else decode_object(key, data, self.allow_pickle)
                for (key, *_), data in zip(self.leaves, datas)
            ]
        except BaseException as error:  # noqa: BLE001 - an interrupt too: told to every rank, raised here after
            self.error = error
            return f"{type(error).__name__}: {error}"
        return None

    def raise_own(self) -> None:
        """Where this rank's own decoding failed the load, that error (with its traceback),
        not the native call's news of it."""
        if self.error is not None:
            raise self.error from None


def metadata(location) -> dict:
    """The index of the checkpoint at ``location``, read by this process alone: its
    tensors ``{key: {"dtype", "shape", "chunks": [(offset, shape)], "flat_chunks":
    [(offset, shape, start, stop)]}}`` (boxes, and pieces that are a flat range of a box),
    its objects ``{key: {"grid_shape", "entries": [grid_offset]}}`` and its saved layout."""
    return _dckpt.metadata(str(location))


class _Targets:
    """The buffers a load fills: the targets themselves where they are contiguous host
    memory, else temporaries copied back afterwards. Keeps each one alive until then."""

    def __init__(self) -> None:
        self.keep: list[Any] = []
        self.back: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def buffer(self, key: str, dest: torch.Tensor) -> tuple[int, int]:
        dest = dest.detach()
        if type(dest) not in _PLAIN or dest.is_quantized:
            raise TypeError(f"{key}: cannot load into a {type(dest).__name__} in place")
        if dest.layout is not torch.strided:
            raise TypeError(f"{key}: cannot load into a {dest.layout} tensor in place; load into a dense one")
        _refuse_meta(key, dest)
        if torch._debug_has_internal_overlap(dest) == 1:
            # `expand`ed: one element in several places, which no load can fill (torch's
            # copy refused it on this rank alone, after the load, the rest left unfilled).
            raise TypeError(f"{key}: cannot load into a tensor whose elements share memory (an expanded view); load into t.contiguous()")
        # Targets sharing bytes (tied weights, views of one buffer) are the native side's
        # to fill through temporaries.
        if dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_neg():
            buf = dest
        else:
            # A non-contiguous, negated or device target is read into a contiguous host
            # temporary and copied back (`copy_` writes a negated view's negatives);
            # `reshape` would silently copy instead of writing through.
            buf = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=dest.device.type == "cuda")
            self.back.append((key, dest, buf))
        self.keep.append(buf)
        return _descriptor_buffer(buf)

    def copy_back(self, filled) -> None:
        """Copies each temporary the load ``filled`` (by key) into its target; the others
        hold nothing read, and their targets keep what they held."""
        for key, dest, buf in self.back:
            if filled(key):
                dest.copy_(buf)
        if any(d.device.type == "cuda" for _, d, _ in self.back):
            torch.cuda.synchronize()


def _refuse_meta(key: str, dest: torch.Tensor) -> None:
    """A tensor on the meta device holds no memory: a copy into it does nothing, so a
    load would report success and leave the model to be initialised from scratch."""
    if dest.device.type == "meta":
        raise TypeError(f"{key}: cannot load into a tensor on the meta device; materialize it first (to_empty)")


def _pieces(leaves, targets: _Targets, cast: bool = False) -> tuple[list, list, list]:
    """The native pieces of ``leaves``, and the object leaves in the order of theirs;
    ``cast``: every tensor may be filled from another stored floating dtype."""
    tensors: list[TensorPiece] = []
    objects: list[ObjectPiece] = []
    object_leaves: list[tuple[str, Any, Any, Any]] = []
    # The short path's call stays as it was where nothing is cast.
    piece = functools.partial(tensor_piece, allow_dtype_cast=True) if cast else tensor_piece
    strided = torch.strided
    for key, leaf, parent, index in leaves:
        if type(leaf) in _PLAIN and leaf.layout is strided and leaf.is_cpu and leaf.is_contiguous() and not leaf.is_neg():
            # The common case, kept short (see save).
            name = _DTYPES.get(leaf.dtype)
            if name is not None:
                shape = leaf.shape
                tensors.append(piece(key, name, shape, (0,) * len(shape), shape, leaf.data_ptr(), leaf.nbytes))
                continue
        key = _own_key(key, leaf)
        if isinstance(leaf, Object):
            shape = [int(d) for d in leaf.global_shape]
            offset = [int(d) for d in leaf.global_offset]
            objects.append(object_piece(key, shape, offset))
            object_leaves.append((key, leaf, parent, index))
            continue
        if isinstance(leaf, Shard):
            offset, box, flat = leaf._box(key)
            gshape = [int(d) for d in leaf.global_shape]
            dest, mismatch, cast_leaf = leaf.data, leaf.allow_shape_mismatch, cast or leaf.allow_dtype_cast
        elif DTensor is not None and isinstance(leaf, DTensor):
            found = _dtensor_piece(key, leaf)
            if found is None:
                continue
            dest, offset, gshape, _ = found
            box, flat, mismatch, cast_leaf = list(dest.shape), None, False, cast
        elif isinstance(leaf, torch.Tensor):
            dest, mismatch, cast_leaf = leaf, False, cast
            gshape = list(dest.shape)
            offset, box, flat = [0] * dest.dim(), gshape, None
        else:
            if isinstance(parent, tuple):  # refused before any byte is read
                raise TypeError(f"{key}: cannot replace an element of a tuple; use a list in the target state dict")
            objects.append(object_piece(key))
            object_leaves.append((key, leaf, parent, index))
            continue
        ptr, nbytes = targets.buffer(key, dest)
        flags = {"flat_range": flat, "allow_shape_mismatch": mismatch, "allow_dtype_cast": cast_leaf}
        tensors.append(piece(key, dtype_name(dest.dtype, key), gshape, offset, box, ptr, nbytes, **flags))
    return tensors, objects, object_leaves
