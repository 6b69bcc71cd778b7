"""``save``: a state dict's leaves as native pieces, handed to the process group's
checkpointer."""

from __future__ import annotations

from typing import Any

import torch

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
    _main,
    _own_key,
    _plain,
    _Staging,
    dtype_name,
)
from dckpt.torch._objects import compared_as, encode_object


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
    layout: dict[str, str] | None = None,
):
    """Saves ``state_dict`` at ``location`` (a path or ``s3://`` URL), collectively over
    ``process_group``. Returns the outcome (a dict: ``save_id``, ``bytes``, ``files``,
    ``chunks``, ``rank_bytes``, ``plan_reused``, and ``phases``: for ``stage``, ``plan``,
    ``write`` and ``commit`` the slowest rank and its ``seconds``) once the checkpoint is committed
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
    the ranks. Unless it is ``"off"``, plain values and :class:`Object` copies that several
    ranks hold are compared too, whole (JSON and plain values holding bytes with their
    dicts' keys sorted; pickles of classes not at all): one that another rank holds
    otherwise raises ``dckpt.CoverageError`` naming its key and the ranks.

    ``layout``: entries recorded in the checkpoint's layout besides ``world_size`` (what
    :class:`CheckpointManager` records of a step: the step and when its save began)."""
    return _save(state_dict, location, None, process_group, async_save, replace, allow_pickle, collective, replica_check, layout)


def _save(state_dict, location, local, process_group, async_save, replace, allow_pickle, collective, replica_check, layout):
    """:func:`save`, and with ``local`` (the native ``Checkpointer.save``'s dict) the
    node-local tier too; ``location`` may then be ``None``."""
    ckpt, rank = _process._checkpointer(process_group, collective)
    staging = _Staging()
    keep: list[Any] = []  # every tensor whose address is handed over, alive until the call returns
    where = None if location is None else str(location)
    # A failure here may be this rank's alone (a value only it holds): the others hear of it.
    with _process.tell_others(ckpt, lambda why: ckpt.save(where, [], [], replace=replace, local=local, caller_failed=why)):
        # The collector is off for the walk only: the native save below may run for minutes
        # with the GIL released while other threads allocate.
        _process.check_choice("replica_check", replica_check, ("sample", "all", "off"))
        with _gc_off(), torch.no_grad():
            # `leaves` keeps every leaf alive until the call returns, the short path's included.
            leaves = _leaves(state_dict)
            tensors, objects = _pieces(leaves, rank == 0, allow_pickle, staging, keep, replica_check != "off")
        staging.sync()
    layout = {**{str(k): str(v) for k, v in (layout or {}).items()}, "world_size": str(ckpt.world_size)}
    try:
        out = ckpt.save(
            where,
            tensors,
            objects,
            replace=replace,
            async_save=async_save,
            layout=layout,
            replica_check=replica_check,
            local=local,
        )
    finally:
        del keep
    if async_save:
        h = AsyncSave(out)
        _process._track(h)
        return h
    return out


def _pieces(
    leaves, first: bool, allow_pickle: bool, staging: _Staging, keep: list, compare: bool
) -> tuple[list, list]:
    """The native pieces of ``leaves``: plain tensors are main on the group's ``first``
    rank; device tensors are staged on the host (kept in ``keep``). Objects are compared
    across ranks only where ``compare`` (the replica check not off), which spares their
    digests otherwise."""

    def compared(value, data: bytes, asked: bool = True) -> dict:
        return compared_as(value, data) if compare and asked else {"compare": False}

    tensors: list[TensorPiece] = []
    objects: list[ObjectPiece] = []
    piece = tensor_piece
    strided = torch.strided
    for key, leaf, _, _ in leaves:
        if type(leaf) in _PLAIN and leaf.layout is strided and leaf.is_cpu and leaf.is_contiguous() and not leaf.is_neg():
            # The common case, kept short: 20,000 small tensors spend their time here.
            # Quantized dtypes have no name: such tensors take the long way; sparse ones
            # too, whose `is_contiguous` raises torch's own error, not one naming the key; and
            # negated views, whose memory holds the values' negatives (see `_Staging.host`).
            name = _DTYPES.get(leaf.dtype)
            if name is not None:
                shape = leaf.shape  # a tuple: the native side takes any sequence
                tensors.append(piece(key, name, shape, (0,) * len(shape), shape, leaf.data_ptr(), leaf.nbytes, main=first))
                continue
        key = _own_key(key, leaf)
        if isinstance(leaf, Object):
            data = encode_object(key, leaf.value, allow_pickle)
            shape = [int(d) for d in leaf.global_shape]
            offset = [int(d) for d in leaf.global_offset]
            how = compared(leaf.value, data, leaf.compare)
            objects.append(object_piece(key, shape, offset, main=_main(leaf.replica_id), data=data, **how))
            continue
        if isinstance(leaf, Shard):
            data = _plain(leaf.data)
            offset, box, flat = leaf._box(key)
            gshape = [int(d) for d in leaf.global_shape]
            is_main = _main(leaf.replica_id)
        elif DTensor is not None and isinstance(leaf, DTensor):
            found = _dtensor_piece(key, leaf)
            if found is None:
                continue
            local, offset, gshape, is_main = found
            data, box, flat = _plain(local), list(local.shape), None
        elif isinstance(leaf, torch.Tensor):
            data = _plain(leaf)
            gshape = list(data.shape)
            offset, box, flat, is_main = [0] * data.dim(), gshape, None, first
        else:
            data = encode_object(key, leaf, allow_pickle)
            objects.append(object_piece(key, main=first, data=data, **compared(leaf, data)))
            continue
        if data.layout is not torch.strided:
            raise TypeError(f"{key}: a {data.layout} tensor has no dense form here; store t.to_dense()")
        name = dtype_name(data.dtype, key)  # refused before a device copy is made
        host = staging.host(data, key)
        keep.append(host)
        ptr, nbytes = _descriptor_buffer(host)
        tensors.append(piece(key, name, gshape, offset, box, ptr, nbytes, flat_range=flat, main=is_main))
    return tensors, objects
