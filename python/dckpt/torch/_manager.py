"""Checkpoints over a training run: ``dckpt.torch.CheckpointManager``.

Each step is an ordinary checkpoint under the run root, ``step-<N>`` (N zero-padded, so
names sort as numbers), saved and loaded by ``dckpt.torch.save`` / ``load``; ``latest`` is
a small JSON pointer written after that step's commit. Everything else is the native run
manager's (``dckpt::manager::RunRoot``): refusing a committed step and recording the
step's start before its save, the pointer and retention after it, listing, the latest
step and gc. It runs collectively over the process group, rank 0 doing the storage work,
so every rank returns the same or raises the same error (with its ``rank``); this module
is only the state-dict glue around it.

With ``local=TEMPLATE`` a node-local tier sits beside the run root: each rank's state
saved as it holds it under its node's directory, with copies on other nodes, restored from
there first (``dckpt::local``, the native engine's)."""

from __future__ import annotations

import operator
import os
import zlib

import torch.distributed as dist

from dckpt import _dckpt
from dckpt.torch import _process
from dckpt.torch._objects import _lead


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
        return self._result is not None or self._handle is None or self._handle.done()

    def wait(self) -> dict:
        if self._result is None:
            self._manager._finish()
        ok, value = self._result
        if not ok:
            raise value
        return value

    def _finish(self) -> None:
        try:
            out = self._manager._after_commit(self.step, self._handle.wait() if self._handle is not None else {})
        except Exception as e:
            # Raised by the next call, which may save another step: say whose error it is.
            _lead(e, f"step {self.step}, saved in the background")
            self._result = (False, e)
            raise
        self._result = (True, out)


class CheckpointManager:
    """One checkpoint per step under ``root`` (a path or ``s3://`` URL), keeping the last
    ``keep_last`` committed steps and every step that is a multiple of ``keep_every``
    (neither: every step), never the latest committed step nor one being saved. Every rank
    of ``process_group`` makes the same calls in the same order.

    ``save(step, state_dict, async_save=False)`` refuses a committed step
    (``dckpt.AlreadyExists``), and one the local tier holds whole unless the run root is
    due at it (its save there is then taken as retried, and the local copy kept); a
    background save's retention runs when it is waited on or at the next call.
    ``latest()`` is the newest committed step (or ``None``), never an uncommitted or
    damaged one; ``load_latest(state_dict)`` loads it in place and returns
    its step; ``steps()`` lists every step directory; ``gc()`` removes what dead saves
    left (uncommitted steps older than the latest, stray data files, temporaries) and the
    steps retention does not keep.

    ``local``: a node-local tier at this path template (``{node}`` and ``{rank}`` expand,
    e.g. ``"/local/nvme/run-a/{node}"``), saved at every step divisible by
    ``local_every``, each rank's part with ``local_copies`` copies (its own and the rest on
    other nodes), the newest ``local_keep`` complete steps kept; the run root is then saved
    at every step divisible by ``persistent_every`` (default 100; without a local tier,
    every step). Nodes are ``ranks_per_node`` consecutive ranks (default:
    ``LOCAL_WORLD_SIZE``, torchrun's). ``load_latest`` then restores the newest step it
    can prove whole: each rank's part from its own copy, else a peer's, else the run root's
    step of that number, else the whole restore from the run root's latest; every byte is
    checked, and ``last_restore`` says where each part came from and why it fell back."""

    def __init__(
        self,
        root,
        keep_last: int | None = None,
        keep_every: int | None = None,
        *,
        process_group=None,
        local: str | None = None,
        local_every: int = 1,
        local_copies: int = 2,
        local_keep: int = 1,
        persistent_every: int | None = None,
        ranks_per_node: int | None = None,
    ):
        self.root = str(root)
        # Checked here, where a bad value failed every save after its step had committed.
        # No step is a multiple of 0 but step 0: keep_every=0 read literally kept none.
        self.keep_last = _count_or_none(keep_last, "keep_last", 0, "a number of steps")
        self.keep_every = _count_or_none(keep_every, "keep_every", 1, "a step interval")
        self.process_group = process_group
        self.local = None if local is None else str(local)
        self.local_every = int(local_every)
        self.local_copies = int(local_copies)
        self.local_keep = int(local_keep)
        self.persistent_every = int(persistent_every if persistent_every is not None else (100 if local else 1))
        if ranks_per_node is not None:
            ranks_per_node = _ranks_per_node(ranks_per_node, "ranks_per_node")
        self.ranks_per_node = ranks_per_node
        self.last_restore: dict | None = None
        self._pending: ManagedAsyncSave | None = None
        self._run: tuple[tuple, _dckpt.RunRoot] | None = None

    def _url(self, step: int) -> str:
        return self.root.rstrip("/") + "/" + _dckpt.RunRoot.step_dir(int(step))

    def _root(self) -> _dckpt.RunRoot:
        """The native run root over the group's collective (a world of one outside a
        job), made at first use and again where the process or the job changed."""
        from dckpt.torch import TorchCollective

        local = _process.is_local(self.process_group)
        # The job's default group too: one destroyed and made again in this process leaves
        # the old run root's collective without its groups.
        key = (os.getpid(), local, None if local else dist.group.WORLD)
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
        removed = []
        if "save_id" in outcome:
            removed = self._root().finish_step(int(step), outcome["save_id"], self.keep_last, self.keep_every)
        return {**outcome, "step": int(step), "removed": removed}

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` saves (the local tier, the run root)."""
        step = int(step)
        local = self.local is not None and self.local_every > 0 and step % self.local_every == 0
        return local, self.persistent_every > 0 and step % self.persistent_every == 0

    def _local_dir(self) -> tuple[str, int]:
        """This rank's node-local directory, and the ranks per node. Makes no collective: it
        is looked at before the ranks agree to go on (see ``_process.check_collective``)."""
        rank, _ = _process.rank_and_world(self.process_group)
        rpn = self.ranks_per_node
        if rpn is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                raise ValueError("local tier: ranks_per_node not given, and LOCAL_WORLD_SIZE is not set (torchrun sets it)")
            rpn = _ranks_per_node(env, "LOCAL_WORLD_SIZE")
            _check_node(self.process_group, rpn)
        node = rank // int(rpn)
        if "{node}" not in self.local and "{rank}" not in self.local:
            # As the native tier refuses it: on a shared file system every "copy on another
            # node" would be the same file.
            raise ValueError(
                f"local tier: the template {self.local!r} names neither {{node}} nor {{rank}}: "
                "every node would share one directory"
            )
        return self.local.replace("{node}", str(node)).replace("{rank}", str(rank)), int(rpn)

    def _config(self, rpn: int | None) -> int:
        """A digest of what decides a step's way through the collectives, the ranks per node
        ``rpn`` as this rank resolved them (from ``LOCAL_WORLD_SIZE``, which can differ by
        node): ranks whose managers were made otherwise (a node-local directory given on some
        nodes only) are refused by ``_agree`` rather than left waiting in different calls."""
        tiers = (self.local is not None, self.local_every, self.local_copies, self.local_keep)
        return zlib.crc32(repr((tiers, self.persistent_every, rpn)).encode())

    def _agree(self, step: int, problem: Exception | None, rpn: int | None = None) -> None:
        """Goes on on every rank only where every rank gives ``step`` and none found a
        ``problem`` (raised here: its own on the rank that found it, one naming that rank on
        the others). Arguments and the environment can differ by rank or node, and a rank
        that raised alone would leave the others waiting in the next collective until it
        timed out."""
        try:
            self._root().same_step(step, refused=problem is not None, config=self._config(rpn))
        except Exception:
            if problem is None:
                raise
        if problem is not None:
            raise problem

    def save(self, step: int, state_dict, async_save: bool = False, **kwargs):
        """Saves ``state_dict`` as ``step`` to the tiers it is due on (keyword arguments go
        to ``dckpt.torch.save``, but for ``replace``, which a managed step refuses). Returns
        the outcome with ``"step"``, ``"removed"`` and, where the local tier was saved,
        ``"local"``, or with ``async_save`` a :class:`ManagedAsyncSave` (both tiers go on
        in the background from one copy of the state). Where the local tier's storage fails
        (a full node-local disk), the run root's save still goes on, and the outcome says why
        under ``"local_error"`` (logged once as a warning); the step then restores from the
        run root."""
        from dckpt.torch._save import _save

        # Every argument is checked before the step begins (a step begun and then refused
        # would be refused again as already committed), and every rank hears of a refusal.
        allow_pickle = kwargs.pop("allow_pickle", False)
        collective = kwargs.pop("collective", None)
        replica_check = kwargs.pop("replica_check", "sample")
        replace = kwargs.pop("replace", False)
        problem, n, local_due, persistent_due, found = None, 0, False, False, None
        try:
            if kwargs:
                raise TypeError(f"step {step}: unexpected keyword arguments {sorted(kwargs)}")
            if replace:
                raise ValueError(f"step {step}: a managed step is saved once; replace is refused")
            if replica_check not in ("sample", "all", "off"):
                raise ValueError(f"step {step}: replica_check={replica_check!r}: expected 'sample', 'all' or 'off'")
            # A wrong collective refused here; made only once the ranks agree (over TCP,
            # making one waits for every rank, and a rank refusing here would not come).
            _process.check_collective(collective)
            n = int(step)
            if n != step or not 0 <= n < 1 << 64:
                n = 0
                raise ValueError(f"step {step!r}: expected a whole number from 0 to 2^64 - 1")
            local_due, persistent_due = self.due(n)
            if local_due:  # before the step begins: a wrong LOCAL_WORLD_SIZE is refused here
                found = self._local_dir()
        except Exception as e:
            problem = e
        try:  # the save in flight: its error, raised on every rank, comes first
            self._finish()
        except Exception as e:
            if problem is not None:  # said too, not lost
                e.add_note(f"and step {step} itself: {type(problem).__name__}: {problem}")
            problem = e
        self._agree(n, problem, None if found is None else found[1])  # the same step on every rank too
        step = n
        if not (local_due or persistent_due):
            out = ManagedAsyncSave(self, step, None)
            out._result = (True, {"step": step, "removed": []})
            return out if async_save else out.wait()
        layout, url, local = None, None, None
        if found is not None:
            directory, rpn = found
            local = {
                "dir": directory,
                "step": step,
                "ranks_per_node": rpn,
                "copies": self.local_copies,
                "keep": self.local_keep,
                "run": self._root().location,  # a restore takes this run's local steps only
                # A step the local tier holds whole is refused as a committed one is,
                # unless the run root is due: then its save there is retried, and it is kept.
                "if_whole": "keep" if persistent_due else "refuse",
            }
        if persistent_due:
            layout, url = self._root().begin_step(step)["layout"], self._url(step)
        out = _save(state_dict, url, local, self.process_group, async_save, False, allow_pickle, collective, replica_check, layout)
        if async_save:
            self._pending = ManagedAsyncSave(self, step, out)
            return self._pending
        return self._after_commit(step, out)

    def in_flight(self) -> int | None:
        """The step being saved in the background, if one is."""
        return None if self._pending is None else self._pending.step

    def latest(self) -> int | None:
        """The latest committed step, or ``None``."""
        return self.latest_info()["step"]

    def latest_info(self) -> dict:
        """``{"step", "directory", "save_id", "from_pointer", "skipped": [{"step", "reason",
        "unreadable"}]}`` (``unreadable``: its metadata is there but could not be read here)."""
        self._finish()
        return self._root().latest()

    def load_latest(self, state_dict, info: bool = False, **kwargs):
        """Loads the latest step into ``state_dict`` in place (keyword arguments go to
        ``dckpt.torch.load``); its step, or ``None`` where there is none. With a local tier,
        the newest step it can prove whole, from the fastest place (see the class); where the
        run root holds no step and this run's local steps cannot be restored whole here
        (their nodes away, another layout), ``RuntimeError`` naming them, on every rank:
        they are the run's only checkpoints, so they are kept. With
        ``info``, ``last_restore`` instead: ``{"step", "sources": {"own", "peer",
        "persistent"}, "fallbacks": [why...], "local": native outcome}``."""
        from dckpt.torch import load
        from dckpt.torch._load import _load

        # Refused on every rank (see ``_agree``): the local restore would not read unknown
        # keywords, and a rank that raised alone would leave the others waiting.
        unknown = sorted(set(kwargs) - {"strict", "allow_pickle", "collective", "unexpected"})
        problem = TypeError(f"load_latest: unexpected keyword arguments {unknown}") if unknown else None
        try:
            _process.check_collective(kwargs.get("collective"))
        except Exception as e:
            problem = problem or e
        found = self.latest_info()
        latest = found["step"]
        newer = [s for s in found["skipped"] if latest is None or s["step"] > latest]
        for s in newer:
            if s.get("unreadable"):
                # It may be whole: resuming before it would lose its progress without a word.
                raise RuntimeError(
                    f"step {s['step']} is newer than the latest step it could read ({latest}), but "
                    f"{s['reason']}: restore once it reads (or remove it)"
                )
        passed = [f"step {s['step']}: {s['reason']}" for s in newer]
        pg, world = self.process_group, self._world()
        self.last_restore = None
        if self.local is None:
            self._agree(0 if latest is None else latest, problem)
            if latest is not None:
                load(state_dict, self._url(latest), process_group=pg, **kwargs)
                self.last_restore = {"step": latest, "sources": _sources(0, 0, world), "fallbacks": passed, "local": None}
            return self.last_restore if info else latest
        strict, allow_pickle = kwargs.get("strict", True), kwargs.get("allow_pickle", False)
        collective, unexpected = kwargs.get("collective"), kwargs.get("unexpected")
        directory, rpn = "", None
        try:
            if problem is None:
                directory, rpn = self._local_dir()
        except Exception as e:
            problem = e
        self._agree(0 if latest is None else latest, problem, rpn)
        where = {"min_step": latest, "run": self._root().location}
        # The newest whole local step first; where one fails to restore whole and the run root
        # has no copy of it, the next older local step (newer than the run root's latest): an
        # abandoned step's markers go below, so one passed over here could never restore.
        tried, first_failed = [], None
        while True:
            got = _load(state_dict, directory, where, pg, strict, allow_pickle, collective, unexpected)
            step, failed = got["step"], list(got["failed"])
            if step is None or not failed or self._root().committed(step):
                break
            tried += [*got["reasons"], f"local step {step} is not whole and the run root has no step {step}"]
            first_failed = first_failed or got
            where = {**where, "below": step}
        fallbacks = tried + list(got["reasons"]) + passed
        r = {"step": step, "sources": _sources(got["own"], got["peer"], len(failed)), "fallbacks": fallbacks, "local": got}
        if step is not None and failed:  # and the run root holds the step (above)
            # Only the failed parts are asked for; the other ranks ask for nothing.
            mine = self._rank() in failed
            _load(state_dict if mine else {}, self._url(step), None, pg, strict, allow_pickle, collective, "ignore")
            r["fallbacks"].append(f"the parts of ranks {failed} came from the run root's step {step}")
        elif step is None:
            if latest is None:
                if first_failed is not None:
                    raise RuntimeError(
                        f"local step {first_failed['step']} cannot be restored whole and the run root holds no step"
                    )
                if got["not_whole"]:
                    # The run's only checkpoints: unmarked here, they could never be restored,
                    # though their nodes or layout may come back.
                    raise RuntimeError(
                        f"local steps {list(got['not_whole'])} of this run cannot be restored whole here "
                        f"({'; '.join(got['reasons'])}) and the run root holds no step: restore them with the nodes "
                        "and layout they were saved with, or remove them from the node-local directories to start afresh"
                    )
                self._unmark_local(directory, None)  # nothing to resume from, and no marked step of this run
                return None
            r["fallbacks"].append(f"the whole restore is the run root's step {latest}")
            load(state_dict, self._url(latest), process_group=pg, **kwargs)
            r["step"], r["sources"] = latest, _sources(0, 0, world)
        self._unmark_local(directory, int(r["step"]))
        self.last_restore = r
        return r if info else r["step"]

    def _unmark_local(self, directory: str, after: int | None) -> None:
        """Local steps of this run newer than the one resumed from (all, with ``None``) are an
        abandoned branch: their markers go, so that gc never keeps one as the newest over
        this run's own steps."""
        from dckpt.torch._process import _checkpointer

        _checkpointer(self.process_group, None)[0].unmark_local_newer(directory, after, self._root().location)

    def _rank(self) -> int:
        return _process.rank_and_world(self.process_group)[0]

    def _world(self) -> int:
        return _process.rank_and_world(self.process_group)[1]

    def steps(self) -> list[dict]:
        """Every step directory: ``{"step", "directory", "committed", "bytes", "objects",
        "save_id", "saved_at_unix", "layout", "problem"}``."""
        self._finish()
        return self._root().steps()

    def gc(self, dry_run: bool = False) -> dict:
        """Removes what dead saves left and what retention does not keep; the report. With a
        local tier, also this rank's files of the run's local steps that ``local_keep`` does
        not keep (``"local_steps"``: the steps removed; not with ``dry_run``)."""
        self._finish()
        report = self._root().gc(self.keep_last, self.keep_every, [], dry_run)
        if self.local is not None and not dry_run:
            directory, rpn = self._local_dir()
            ckpt = _process._checkpointer(self.process_group, None)[0]
            report["local_steps"] = ckpt.gc_local(directory, rpn, self.local_copies, self.local_keep, self._root().location)
        return report


def _check_node(process_group, rpn: int) -> None:
    """With ranks per node from torchrun (``LOCAL_WORLD_SIZE``), copies go by consecutive
    ranks per node: this rank's node (``GROUP_RANK``, torchrun's count of the job's ranks, not
    a process group's) must be its job rank's."""
    if _process.is_local(process_group):
        return
    job_rank = dist.get_rank()
    group = os.environ.get("GROUP_RANK")
    if group is not None and int(group) != job_rank // rpn:
        raise ValueError(
            f"local tier: rank {job_rank} is on node {group} (GROUP_RANK), not {job_rank // rpn} "
            "(rank // LOCAL_WORLD_SIZE): dckpt places copies by consecutive ranks per node"
        )


def _count_or_none(value, name: str, least: int, what: str) -> int | None:
    """``value`` as a whole number of at least ``least``, or ``None``; ``ValueError`` naming
    ``name`` otherwise (a float, a bool, a negative number)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r}: expected {what} (a whole number), or None") from None
    if n < least:
        raise ValueError(f"{name}={value!r}: expected {what} of at least {least}, or None")
    return n


def _ranks_per_node(value, name: str) -> int:
    """``value`` as a count of ranks per node; ``ValueError`` naming ``name`` otherwise."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"local tier: {name}={value!r}: expected a whole number of ranks per node") from None
    if n < 1:
        raise ValueError(f"local tier: {name}={value!r}: a node holds at least one rank")
    return n


def _sources(own: int, peer: int, persistent: int) -> dict:
    return {"own": int(own), "peer": int(peer), "persistent": int(persistent)}
