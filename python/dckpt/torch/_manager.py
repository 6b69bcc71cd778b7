"""Checkpoints over a training run: ``dckpt.torch.CheckpointManager``.

Each step is an ordinary checkpoint under the run root, ``step-<N>`` (N zero-padded, so
names sort as numbers), saved and loaded by ``dckpt.torch.save`` / ``load``; ``latest`` is
a small JSON pointer written after that step's commit. What touches the root itself
(listing, the pointer, retention, gc) is the native run manager's (``dckpt::manager``),
called on rank 0 of the process group; its answer, or its exception, reaches every rank,
so every rank returns or raises the same."""

from __future__ import annotations

import importlib
import json

import torch.distributed as dist

from dckpt import _dckpt


class ManagedAsyncSave:
    """A step saved in the background. ``wait()`` returns its outcome once it is committed,
    the pointer names it and retention has run (``"removed"``: the steps deleted), or raises
    its error; again on every later call, also when the manager finished it first (its next
    call does)."""

    def __init__(self, manager: "CheckpointManager", step: int, handle) -> None:
        self._manager = manager
        self.step = step
        self._handle = handle
        self._result: tuple[bool, object] | None = None  # (ok, outcome or exception)

    def done(self) -> bool:
        return self._result is not None or self._handle.done()

    def wait(self) -> dict:
        if self._result is None:
            self._manager._finish()
        ok, value = self._result
        if not ok:
            raise value
        return value

    def _finish(self) -> None:
        try:
            out = self._manager._after_commit(self.step, self._handle.wait())
        except Exception as e:
            self._result = (False, e)
            raise
        self._result = (True, out)


class CheckpointManager:
    """One checkpoint per step under ``root`` (a path or ``s3://`` URL), keeping the last
    ``keep_last`` committed steps and every step that is a multiple of ``keep_every``
    (neither: every step), never the latest committed step nor one being saved. Every rank
    of ``process_group`` makes the same calls in the same order.

    ``save(step, state_dict, async_save=False)`` refuses a committed step
    (``dckpt.AlreadyExists``); a background save's retention runs when it is waited on or
    at the next call. ``latest()`` is the newest committed step (or ``None``), never an
    uncommitted or damaged one; ``load_latest(state_dict)`` loads it in place and returns
    its step; ``steps()`` lists every step directory; ``gc()`` removes what dead saves
    left (uncommitted steps older than the latest, stray data files, temporaries) and the
    steps retention does not keep."""

    def __init__(self, root, keep_last: int | None = None, keep_every: int | None = None, *, process_group=None):
        self.root = str(root)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.process_group = process_group
        self._pending: ManagedAsyncSave | None = None

    def _url(self, step: int) -> str:
        return self.root.rstrip("/") + "/" + _dckpt.run_step_dir(int(step))

    def _world(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        pg = self.process_group
        return dist.get_rank(pg), dist.get_world_size(pg)

    def _on_root(self, fn):
        """``fn()`` on rank 0 of the group; every rank returns its value or raises its
        exception (of the same class, with the same message)."""
        rank, world = self._world()
        if world == 1:
            return fn()
        box: list = [None]
        if rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as e:  # sent to every rank, then raised on this one too
                box[0] = ("err", type(e).__module__, type(e).__qualname__, str(e))
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        answer = box[0]
        if answer[0] == "ok":
            return answer[1]
        _, module, name, message = answer
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            cls = RuntimeError
        raise cls(message)

    def _finish(self) -> None:
        """Finishes the save in flight, if any: its outcome (or error) stays with its handle,
        and an error is raised here too."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending._finish()

    def _after_commit(self, step: int, outcome: dict) -> dict:
        removed = self._on_root(
            lambda: json.loads(
                _dckpt.run_after_commit(self.root, int(step), outcome["save_id"], self.keep_last, self.keep_every)
            )
        )
        return {**outcome, "step": int(step), "removed": removed}

    def save(self, step: int, state_dict, async_save: bool = False, **kwargs):
        """Saves ``state_dict`` as ``step`` (keyword arguments go to ``dckpt.torch.save``,
        but for ``replace``, which a managed step refuses). Returns the outcome with
        ``"step"`` and ``"removed"``, or with ``async_save`` a :class:`ManagedAsyncSave`."""
        from dckpt.torch import save

        if kwargs.get("replace"):
            raise ValueError(f"step {step}: a managed step is saved once; replace is refused")
        self._finish()
        self._on_root(lambda: _dckpt.run_check_new_step(self.root, int(step)))
        out = save(state_dict, self._url(step), process_group=self.process_group, async_save=async_save, **kwargs)
        if async_save:
            self._pending = ManagedAsyncSave(self, int(step), out)
            return self._pending
        return self._after_commit(step, out)

    def in_flight(self) -> int | None:
        """The step being saved in the background, if one is."""
        return None if self._pending is None else self._pending.step

    def _scan(self) -> dict:
        self._finish()
        return self._on_root(lambda: json.loads(_dckpt.run_scan(self.root)))

    def latest(self) -> int | None:
        """The latest committed step, or ``None``."""
        return self._scan()["latest"]["step"]

    def latest_info(self) -> dict:
        """``{"step", "directory", "save_id", "from_pointer", "skipped": [{"step", "reason"}]}``."""
        return self._scan()["latest"]

    def load_latest(self, state_dict, **kwargs) -> int | None:
        """Loads the latest committed step into ``state_dict`` in place (keyword arguments
        go to ``dckpt.torch.load``); its step, or ``None`` where no step is committed."""
        from dckpt.torch import load

        step = self.latest()
        if step is None:
            return None
        load(state_dict, self._url(step), process_group=self.process_group, **kwargs)
        return step

    def steps(self) -> list[dict]:
        """Every step directory: ``{"step", "directory", "committed", "bytes", "objects",
        "save_id", "saved_at_unix", "layout", "problem"}``."""
        return self._scan()["steps"]

    def gc(self, dry_run: bool = False) -> dict:
        """Removes what dead saves left and what retention does not keep; the report."""
        self._finish()
        return self._on_root(
            lambda: json.loads(_dckpt.run_gc(self.root, self.keep_last, self.keep_every, [], dry_run))
        )
