"""Megatron-Core ``dist_checkpointing`` strategies that save and load through dckpt.

::

    import dckpt.megatron
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, ckpt_dir,
                            sharded_strategy=dckpt.megatron.DckptSaveShardedStrategy())
    dist_checkpointing.load(sharded_state_dict, ckpt_dir)  # picked from metadata.json

The save strategy writes backend ``dckpt``, version 1 into Megatron's ``metadata.json``;
importing this module registers :class:`DckptLoadShardedStrategy` for that pair, so
``dist_checkpointing.load`` picks it by itself (and :class:`DckptSaveShardedStrategy`, so
``sharded_strategy=("dckpt", 1)`` names it). Megatron keeps its ``common.pt`` beside
dckpt's files in the same directory.

Mapping: a ``ShardedTensor`` becomes a :class:`dckpt.torch.Shard` of its key (its data
gets extent 1 on the ``prepend_axis_num`` prepended axes; ``axis_fragmentations`` is not
needed: dckpt proves coverage from the regions themselves); a ``ShardedObject`` becomes
a :class:`dckpt.torch.Object` at its grid position under its key. A piece is the main
copy of its region iff every entry of its ``replica_id`` is zero; the others are handed
to dckpt as replicas, which it does not write but compares, by checksum, with the main
copy (a save whose replicas differ is refused; a ShardedObject's replicas are not
compared, as Megatron's own strategies keep the main copy's value). Every save is checked before any byte is
written: a hole, an overlap or differing replicas raise ``dckpt.CoverageError`` on every
rank, and ``metadata.json`` is not written.

Objects are stored as torch_dist stores them, as ``torch.save`` archives, and loaded by
``torch.load`` in its ``weights_only`` mode: tensors, tuples, numpy and RNG states come back
as they were saved. A value that mode cannot load (an instance of a class of its own) needs
``allow_pickle=True`` on the save strategy (refused at the save otherwise) and on the load
strategy (loading a pickle runs code). To load such objects with the strategy picked from
``metadata.json``, register one that allows it::

    register_default_strategy(StrategyAction.LOAD_SHARDED, "dckpt", 1,
                              DckptLoadShardedStrategy(allow_pickle=True))

Versions: megatron-core up to 0.16. From 0.17 on, ``dist_checkpointing.save`` silently
replaces any save strategy that is not a ``TorchDistSaveShardedStrategy`` with
torch_dist, so constructing :class:`DckptSaveShardedStrategy` there raises
:class:`UnsupportedMegatronVersion` rather than letting a save quietly bypass dckpt.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import dckpt
import dckpt.torch as dt
from dckpt.torch import _process
from dckpt.torch._objects import TorchSaved

__all__ = [
    "DckptLoadShardedStrategy",
    "DckptSaveShardedStrategy",
    "UnsupportedMegatronVersion",
    "megatron_version",
]

BACKEND = "dckpt"
VERSION = 1

# The last megatron-core minor release whose `dist_checkpointing.save` runs any
# `SaveShardedStrategy` it is given (0.17.0 replaced foreign strategies with torch_dist).
_LAST_SUPPORTED = (0, 16)


class UnsupportedMegatronVersion(RuntimeError):
    """This megatron-core release cannot run dckpt's strategies as intended."""


def megatron_version() -> tuple[int, int, int]:
    """The installed megatron-core's ``(major, minor, patch)``."""
    from megatron.core import package_info
    from packaging.version import Version

    release = Version(package_info.__version__).release
    return tuple((release + (0, 0, 0))[:3])  # type: ignore[return-value]


def _check_version(version: tuple[int, int, int] | None = None) -> None:
    """Raises :class:`UnsupportedMegatronVersion` where ``version`` (the installed one by
    default) would not save through dckpt. The one place the version policy lives."""
    v = megatron_version() if version is None else tuple(version)
    if v[:2] > _LAST_SUPPORTED:
        raise UnsupportedMegatronVersion(
            f"megatron-core {'.'.join(map(str, v))} is not supported by dckpt.megatron (supported: up to "
            f"{'.'.join(map(str, _LAST_SUPPORTED))}.x): from 0.17 on, dist_checkpointing.save silently replaces "
            "any save strategy that is not a TorchDistSaveShardedStrategy subclass with torch_dist, so this "
            "checkpoint would be written by torch_dist, not dckpt. Install megatron-core<0.17, or save with "
            "dckpt.torch.save directly"
        )


try:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.base import (
        AsyncSaveShardedStrategy,
        LoadShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ImportError as e:  # 0.19 deleted strategies/base.py
    _check_version()
    raise ImportError(f"dckpt.megatron needs megatron-core's dist_checkpointing strategies: {e}") from e


# --------------------------------------------------------------------------------------
# the mapping


def _shard(sh: ShardedTensor, data: torch.Tensor) -> dt.Shard:
    if sh.flattened_range is not None:
        raise ValueError(f"{sh.key}: ShardedTensor.flattened_range is not supported (Megatron dropped it in 0.16)")
    # The data has no prepended axes; its region has extent 1 on each of them.
    view = data
    for _ in range(sh.prepend_axis_num):
        view = view.unsqueeze(0)
    return dt.Shard(
        view,
        tuple(sh.global_shape),
        tuple(sh.global_offset),
        replica_id=sh.replica_id,
        allow_shape_mismatch=sh.allow_shape_mismatch,
        key=sh.key,
        # torch_dist loads an fp32 checkpoint into bf16 parameters (and back), cast.
        allow_dtype_cast=True,
    )


def _object(sh: ShardedObject, loading: bool) -> dt.Object:
    # Not compared, as Megatron's own strategies do not: they keep the main copy's value
    # whatever its replicas hold, and a drop-in must not refuse saves they accept. Saved as
    # torch_dist saves them, a torch.save archive: stored as JSON, a tuple (Adam's betas)
    # came back a list, a defaultdict a dict; and a tensor (TE's _extra_state) needed
    # allow_pickle, so the default strategy saved no model with TE layers.
    value = sh.data if loading else TorchSaved(sh.data)
    return dt.Object(
        value, tuple(sh.global_shape), tuple(sh.global_offset), replica_id=sh.replica_id, key=sh.key, compare=False
    )


def _pieces(sharded_state_dict, loading: bool) -> tuple[list, list]:
    """dckpt leaves for every ShardedTensor and ShardedObject of the tree, in tree order,
    and, for a load, the tensors they fill (allocated where ``data`` is None)."""
    pieces: list = []
    targets: list = []
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            data = v.data
            if data is None:
                if not loading:
                    raise ValueError(f"{v.key}: a ShardedTensor without data cannot be saved")
                data = torch.empty(v.local_shape, dtype=v.dtype)
            if tuple(data.shape) != tuple(v.local_shape):
                raise ValueError(f"{v.key}: data of shape {tuple(data.shape)}, local_shape {tuple(v.local_shape)}")
            pieces.append(_shard(v, data))
            targets.append(data)
        elif isinstance(v, ShardedObject):
            pieces.append(_object(v, loading))
            targets.append(None)
        else:
            raise TypeError(
                f"a {type(v).__name__} in the sharded state dict: the strategy takes ShardedTensors and "
                "ShardedObjects (Megatron applies factories and splits off common values before it)"
            )
    return pieces, targets


# --------------------------------------------------------------------------------------
# save


def _wait_for_save(marker: str, trainer: int) -> None:
    """The async request's ``async_fn``, run in the process Megatron forks or spawns: returns
    once this rank's save has ended in the trainer (``marker`` is made then), or the trainer
    is gone. Megatron takes the request for done when this returns; returning at once made
    its next check run the finalize function, which then blocked training until the commit
    (the save overlapped one iteration). It touches nothing but the file system: dckpt
    writes from its own background thread in the trainer."""
    while not os.path.exists(marker):
        if os.getppid() != trainer:
            return
        time.sleep(0.02)


class _SaveEnded:
    """The marker file that tells :func:`_wait_for_save` this rank's save has ended (committed
    or failed): made by a thread of the trainer once the save's outcome is there, removed by
    the finalize function. A file, as Megatron's persistent worker is spawned, not forked,
    and gets the request's arguments pickled (no descriptor passes). Their directory goes
    with the last marker (a process that ends in ``os._exit``, as forked workers do, runs no
    exit handler to remove it)."""

    _lock = threading.Lock()
    _dir: str | None = None
    _pending = 0
    _count = itertools.count()

    def __init__(self, handle: dt.AsyncSave) -> None:
        with _SaveEnded._lock:
            if _SaveEnded._dir is None:
                _SaveEnded._dir = tempfile.mkdtemp(prefix="dckpt-megatron-async-")
            _SaveEnded._pending += 1
            self.dir = _SaveEnded._dir
        self.path = os.path.join(self.dir, str(next(_SaveEnded._count)))
        self.finalized = False
        threading.Thread(target=self._mark, args=(handle,), name="dckpt-megatron-save-ended", daemon=True).start()

    def _mark(self, handle: dt.AsyncSave) -> None:
        # Asked, not waited for: one waiter at a time (the exit's, the finalize function's).
        while not handle.done():
            time.sleep(0.02)
        # Not after the finalize function (an `async_fn` run in the trainer itself returns at
        # once, and the finalize function may come first): the marker would stay.
        with _SaveEnded._lock:
            if not self.finalized:
                with open(self.path, "wb"):
                    pass

    def finalize(self, handle: dt.AsyncSave) -> None:
        # On every rank, in the trainer: the commit's outcome, or its error on every rank.
        try:
            handle.wait()
        finally:
            with _SaveEnded._lock:
                self.finalized = True
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                _SaveEnded._pending -= 1
                if _SaveEnded._pending == 0 and _SaveEnded._dir is not None:
                    shutil.rmtree(_SaveEnded._dir, ignore_errors=True)
                    _SaveEnded._dir = None


class DckptSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves Megatron's sharded state dict through dckpt (backend ``dckpt``, version 1).

    ``process_group``: the group to save over (default: the default group).
    ``replace``: replace a dckpt checkpoint already committed in the directory. By default
    (``None``, or ``True``) it is replaced, as ``dist_checkpointing.save`` overwrites a
    directory that is not empty (with a warning): Megatron has written its ``common.pt``
    over the old one's before the strategy runs, so refusing kept the old tensors beside
    the new common state, a mixed checkpoint that loads without an error. ``False``
    refuses (``dckpt.AlreadyExists``), for a caller that guards the directory itself
    before ``common.pt`` is written. ``allow_pickle``: store ShardedObjects that
    ``torch.load``'s ``weights_only`` mode cannot load. ``replica_check``: as ``dckpt.torch.save``'s (``"sample"``,
    ``"all"``, ``"off"``); a distributed optimizer with several instances writes its
    padding uninitialised under the same key on each, which only ``"off"`` lets through.
    ``"off"`` also lets through replicas that differ because their replica ids are wrong
    (expert-tensor-parallel shards described as copies of one smaller tensor: 1/ETP of the
    expert weights stored), which the check exists to catch; prefer ``"sample"``.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        *,
        process_group=None,
        replace: bool | None = None,
        allow_pickle: bool = False,
        replica_check: str = "sample",
    ) -> None:
        _check_version()
        if (backend, version) != (BACKEND, VERSION):
            raise ValueError(f"DckptSaveShardedStrategy writes backend {BACKEND!r} version {VERSION}, not {backend!r} {version}")
        super().__init__(backend, version)
        self.process_group = process_group
        self.replace = replace
        self.allow_pickle = allow_pickle
        self.replica_check = replica_check

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _save(self, sharded_state_dict, checkpoint_dir, async_save: bool):
        ckpt, _ = _process._checkpointer(self.process_group, None)
        # Maybe this rank's alone: every rank fails with it (as in dckpt.torch.save).
        with _process.tell_others(ckpt, lambda why: ckpt.save(str(checkpoint_dir), [], [], caller_failed=why)):
            pieces, _ = _pieces(sharded_state_dict, loading=False)
        replace = self.replace is not False
        return dt.save(
            pieces,
            str(checkpoint_dir),
            process_group=self.process_group,
            async_save=async_save,
            replace=replace,
            allow_pickle=self.allow_pickle,
            replica_check=self.replica_check,
        )

    def save(self, sharded_state_dict, checkpoint_dir: str | Path) -> None:
        """Saves and commits on every rank; raises what dckpt raises, on every rank."""
        self._save(sharded_state_dict, checkpoint_dir, async_save=False)

    def async_save(self, sharded_state_dict, checkpoint_dir: str | Path) -> AsyncRequest:
        """Copies the tensors into dckpt's staging (every rank, here) and returns; dckpt
        plans, checks, writes and commits in its background thread, in this process, over
        its own gloo group. The request's ``async_fn`` (run in a process Megatron forks or
        spawns, which has no part in the save) returns once this rank's save has ended, so
        Megatron's checks see it running until then and training goes on; its finalize
        function then returns the commit's outcome at once on every rank, or raises the
        save's error there
        (Megatron appends its ``metadata.json`` writer after it, so a refused save leaves
        no ``metadata.json``). The tensors may change once this returns."""
        handle = self._save(sharded_state_dict, checkpoint_dir, async_save=True)
        ended = _SaveEnded(handle)
        return AsyncRequest(_wait_for_save, (ended.path, os.getpid()), [functools.partial(ended.finalize, handle)])


# --------------------------------------------------------------------------------------
# load


class DckptLoadShardedStrategy(LoadShardedStrategy):
    """Loads a dckpt checkpoint into Megatron's sharded state dict, in whatever layout
    it describes: each ShardedTensor's data is filled in place (allocated when None;
    ``allow_shape_mismatch`` zero-pads or crops) and each ShardedObject replaced by its
    stored value. A requested key that is not stored raises ``dckpt.MissingKeys`` on every
    rank; stored keys nobody requests are left alone (Megatron's strict handling decides
    about them from :meth:`load_sharded_metadata`)."""

    def __init__(self, *, process_group=None, allow_pickle: bool = False) -> None:
        self.process_group = process_group
        self.allow_pickle = allow_pickle

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"DckptLoadShardedStrategy loads checkpoints of backend {BACKEND!r}; this one was written by "
                f"{loaded_backend!r} (metadata.json): load it with that backend's strategy"
            )

    def check_version_compatibility(self, loaded_version) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"DckptLoadShardedStrategy loads backend {BACKEND!r} version {VERSION}; this checkpoint says "
                f"version {loaded_version!r} (metadata.json): a newer dckpt wrote it"
            )

    def load(self, sharded_state_dict, checkpoint_dir: str | Path, async_strategy=None):
        # megatron-core 0.17+ passes `async_strategy` positionally; loading needs nothing of it.
        ckpt, _ = _process._checkpointer(self.process_group, None)
        where = str(checkpoint_dir)
        told = lambda why: ckpt.load(where, [], [], missing="raise", unexpected="ignore", caller_failed=why)  # noqa: E731
        with _process.tell_others(ckpt, told):  # maybe this rank's alone (as in dckpt.torch.load)
            pieces, targets = _pieces(sharded_state_dict, loading=True)
        dt.load(
            pieces,
            str(checkpoint_dir),
            process_group=self.process_group,
            strict=True,
            unexpected="ignore",
            allow_pickle=self.allow_pickle,
        )
        loaded = iter(zip(pieces, targets))

        def result(v):
            if not isinstance(v, (ShardedTensor, ShardedObject)):
                return v
            piece, target = next(loaded)
            return piece.value if target is None else target

        # nested_values and dict_list_map_outplace walk the tree in the same order.
        return dict_list_map_outplace(result, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        """``{key: ShardedTensor}`` of every stored tensor, without data or sharding (global
        shape and dtype only), read by this process alone."""
        meta = dckpt.metadata(str(checkpoint_dir))
        out: dict[str, ShardedTensor] = {}
        for key, t in meta["tensors"].items():
            proto = torch.empty(tuple(t["shape"]), dtype=dt.torch_dtype(t["dtype"]), device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, proto).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """:meth:`load_tensors_metadata` plus every stored object as a data-less
        ShardedObject under its ``unique_key`` (what Megatron's strict handling compares)."""
        meta = dckpt.metadata(str(checkpoint_dir))
        out: dict[str, Any] = {}
        for key, o in meta["objects"].items():
            shape = tuple(int(d) for d in o["grid_shape"])
            for offset in o["entries"]:
                obj = ShardedObject(key, None, shape, tuple(int(d) for d in offset), replica_id=0)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir))
        return out


if megatron_version()[:2] <= _LAST_SUPPORTED:
    # A new backend name persists in the registry (get_default_strategy re-registers only
    # torch_dist's entries), so dist_checkpointing.load finds this from metadata.json.
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, DckptLoadShardedStrategy())
    # And `dist_checkpointing.save(..., sharded_strategy=("dckpt", 1))` finds the saver.
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, DckptSaveShardedStrategy())
