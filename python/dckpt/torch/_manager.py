"""Checkpoints over a training run: ``dckpt.torch.CheckpointManager``.

Each step is an ordinary checkpoint under the run root, ``step-<N>`` (N zero-padded, so
names sort as numbers), saved and loaded by ``dckpt.torch.save`` / ``load``; ``latest`` is
a small JSON pointer written after that step's commit. Everything else is the native run
manager's (``dckpt::manager::RunRoot``): refusing a committed step and recording the
step's start before its save, the pointer and retention after it, listing, the latest
step and gc. It runs collectively over the process group, rank 0 doing the storage work,
so every rank returns the same or raises the same error (with its ``rank``); this module
is only the state-dict glue around it."""

from __future__ import annotations

import os

from dckpt import _dckpt
from dckpt.torch import _process


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
        self._run: tuple[tuple, _dckpt.RunRoot] | None = None

    def _url(self, step: int) -> str:
        return self.root.rstrip("/") + "/" + _dckpt.RunRoot.step_dir(int(step))

    def _root(self) -> _dckpt.RunRoot:
        """The native run root over the group's collective (a world of one outside a
        job), made at first use and again where the process or the job changed."""
        from dckpt.torch import TorchCollective

        local = _process.is_local(self.process_group)
        key = (os.getpid(), local)
        if self._run is None or self._run[0] != key:
            collective = None if local else TorchCollective(self.process_group)
            self._run = (key, _dckpt.RunRoot(self.root, collective))
        return self._run[1]

    def _finish(self) -> None:
        """Finishes the save in flight, if any: its outcome (or error) stays with its handle,
        and an error is raised here too."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending._finish()

    def _after_commit(self, step: int, outcome: dict) -> dict:
        removed = self._root().finish_step(int(step), outcome["save_id"], self.keep_last, self.keep_every)
        return {**outcome, "step": int(step), "removed": removed}

    def save(self, step: int, state_dict, async_save: bool = False, **kwargs):
        """Saves ``state_dict`` as ``step`` (keyword arguments go to ``dckpt.torch.save``,
        but for ``replace``, which a managed step refuses). Returns the outcome with
        ``"step"`` and ``"removed"``, or with ``async_save`` a :class:`ManagedAsyncSave`."""
        from dckpt.torch import save

        if kwargs.get("replace"):
            raise ValueError(f"step {step}: a managed step is saved once; replace is refused")
        self._finish()
        start = self._root().begin_step(int(step))
        url, pg = self._url(step), self.process_group
        out = save(state_dict, url, process_group=pg, async_save=async_save, layout=start["layout"], **kwargs)
        if async_save:
            self._pending = ManagedAsyncSave(self, int(step), out)
            return self._pending
        return self._after_commit(step, out)

    def in_flight(self) -> int | None:
        """The step being saved in the background, if one is."""
        return None if self._pending is None else self._pending.step

    def latest(self) -> int | None:
        """The latest committed step, or ``None``."""
        return self.latest_info()["step"]

    def latest_info(self) -> dict:
        """``{"step", "directory", "save_id", "from_pointer", "skipped": [{"step", "reason"}]}``."""
        self._finish()
        return self._root().latest()

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
        self._finish()
        return self._root().steps()

    def gc(self, dry_run: bool = False) -> dict:
        """Removes what dead saves left and what retention does not keep; the report."""
        self._finish()
        return self._root().gc(self.keep_last, self.keep_every, [], dry_run)
