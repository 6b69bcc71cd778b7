"""What one process keeps: a native checkpointer per process group (so repeated saves
reuse their plan), the background saves in flight, state reset in a forked child, the
saves finished at exit, and the TCP star's rendezvous through the job's store."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from typing import Any

import torch.distributed as dist

from dckpt import _dckpt
from dckpt.torch import _collective
from dckpt.torch._collective import TorchCollective


class _Local:
    def __repr__(self) -> str:
        return "dckpt.torch.LOCAL"


LOCAL = _Local()
"""``process_group=LOCAL``: this process alone, a world of one, even inside a job."""


class _Process:
    """This process's checkpointers and background saves."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        # Each with the job's default group it was made in (None for LOCAL).
        self.checkpointers: dict[Any, tuple[Any, _dckpt.Checkpointer, Any]] = {}
        # Held until done even when the caller drops its handle: exit waits for them.
        self.pending: list[Any] = []
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
        except Exception as e:
            # Nobody waited for this save: its failure is said here or nowhere (a last
            # checkpoint the user believes is there).
            logging.getLogger("dckpt").error("a background save still running at exit failed: %s", e)
    with p.lock:
        cps = list(p.checkpointers.values())
        p.checkpointers.clear()
    for _, c, _ in cps:
        c.close()
    # Joins the gloo groups' worker threads while the interpreter can still answer them.
    _collective.release_groups()


def _track(handle) -> None:
    """Keeps a background save's handle until it is done, so that exit waits for it."""
    p = _proc
    with p.lock:
        p.pending = [x for x in p.pending if not x.done()] + [handle]


@contextlib.contextmanager
def tell_others(ckpt: _dckpt.Checkpointer, call):
    """Around the making of this rank's pieces: where it fails, ``call(why)`` makes the native
    call the other ranks of ``ckpt`` are in with ``caller_failed=why``, which fails on every
    rank in its first round, naming this rank and the error (as its class where that is a
    known one), rather than leaving the others to wait for this one until the collective
    times out; then this rank's own error is raised. What the call raises here is the
    others' news. A world of one has no others, and its location is left untouched."""
    try:
        yield
    except Exception as error:
        if ckpt.world_size > 1:
            try:
                call(f"{type(error).__name__}: {error}")
            except Exception:  # noqa: BLE001 - this rank's own error is raised below
                pass
        raise


def check_choice(name: str, value, choices: tuple) -> None:
    """Refuses an option outside ``choices``, naming it: called inside :func:`tell_others`, so
    a value given to one rank only fails every rank at once (checked natively, it failed
    this rank before the call the others wait in)."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}")


def local_checkpointer() -> _dckpt.Checkpointer:
    """This process's native checkpointer for a world of one (``process_group=LOCAL``),
    made at the first call and kept, like every group's, until exit or a fork."""
    return _checkpointer(LOCAL, None)[0]


def is_local(process_group) -> bool:
    """Whether ``process_group`` means a world of one here: ``LOCAL``, no job, or a child
    forked from a job's rank (its peers are the parent's, not its own)."""
    return (
        process_group is LOCAL
        or _proc.inherited_job
        or not dist.is_available()
        or not dist.is_initialized()
    )


def check_collective(collective: str | None) -> tuple[str, bool]:
    """The collective ``collective`` names (``DCKPT_COLLECTIVE``'s where ``None``) and
    :func:`mapped_reads`, each checked, without making a checkpointer: one over TCP waits for
    every rank to connect, so a caller that may refuse a step on one rank checks with this,
    agrees, and only then makes it."""
    if collective is None:
        collective = os.environ.get("DCKPT_COLLECTIVE", "gloo")
    if collective not in ("gloo", "tcp"):
        raise ValueError(f"collective={collective!r}: expected 'gloo' or 'tcp'")
    return collective, mapped_reads()


def rank_and_world(process_group) -> tuple[int, int]:
    """This rank's index in ``process_group`` and the group's size, with no collective
    made (see :func:`check_collective`)."""
    if is_local(process_group):
        return 0, 1
    pg = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(group=pg)
    if rank < 0:  # torch answers -1 (and warns) rather than raising
        raise ValueError(f"rank {dist.get_rank()} of the job is not in the process group it was given")
    return rank, dist.get_world_size(group=pg)


def _checkpointer(process_group, collective: str | None) -> tuple[_dckpt.Checkpointer, int]:
    """The native checkpointer for ``process_group`` and this rank's index in it."""
    # Refused when wrong even where the checkpointer is kept.
    collective, mapped = check_collective(collective)
    p = _proc
    local = is_local(process_group)
    if local:
        cache_key: Any = LOCAL
    else:
        pg = process_group if process_group is not None else dist.group.WORLD
        cache_key = (collective, tuple(dist.get_process_group_ranks(pg)))
    job = None if local else dist.group.WORLD
    with p.lock:
        hit = p.checkpointers.get(cache_key)
        if hit is not None and hit[2] is not job:
            # Made in a job since destroyed (destroy_process_group, then init_process_group
            # again in this process): its groups are gone, so it is closed and made anew.
            del p.checkpointers[cache_key]
            stale, hit = hit[1], None
        else:
            stale = None
    if stale is not None:
        stale.close()
    if hit is not None:
        return hit[1], hit[1].rank
    if local:
        c = _dckpt.Checkpointer(None, mapped_reads=mapped)
    elif collective == "tcp":
        c = _tcp_checkpointer(pg, cache_key[1], mapped)
    else:
        c = _dckpt.Checkpointer(TorchCollective(pg), mapped_reads=mapped)
    with p.lock:
        p.checkpointers[cache_key] = (process_group, c, job)
    return c, c.rank


# TCP worlds made so far, per group's ranks: the store prefix of each is per group, so
# its count must be too (a subgroup's world must not shift the next WORLD one's prefix on
# only some of its ranks).
_tcp_worlds: dict[tuple[int, ...], int] = {}


def mapped_reads() -> bool:
    """Whether ``DCKPT_MAPPED_READS`` asks for loads that copy out of mappings of the files
    (``1``; ``0`` or unset: reads by system call). A warm load runs faster; the cost is a
    process-wide ``SIGBUS`` handler, installed on first use, that turns an unreadable page of
    a mapped file into an error and hands every other ``SIGBUS`` to the handler before it."""
    value = os.environ.get("DCKPT_MAPPED_READS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"DCKPT_MAPPED_READS={value!r}: expected '0' or '1'")
    return value == "1"


def _tcp_checkpointer(pg, ranks: tuple[int, ...], mapped: bool) -> _dckpt.Checkpointer:
    """dckpt's TCP star over ``pg``'s ranks, rendezvoused through the job's store."""
    import secrets
    import socket
    from datetime import timedelta

    # Every rank of the group makes its n-th TCP world over it in the same order: one store
    # prefix per (group, n).
    n = _tcp_worlds.get(ranks, 0) + 1
    _tcp_worlds[ranks] = n
    prefix = f"dckpt/tcp/{'-'.join(map(str, ranks))}/{n}/"
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    timeout = float(os.environ.get("DCKPT_RENDEZVOUS_TIMEOUT_MS", "300000")) / 1000.0
    if rank == 0:
        host = os.environ.get("DCKPT_TCP_HOST") or socket.gethostbyname(socket.gethostname())
        job_id = f"dckpt-{secrets.token_hex(8)}"

        def announce(port: int) -> None:
            store.set("addr", f"{host} {port} {job_id}")

        return _dckpt.Checkpointer.tcp(0, world, host, 0, job_id, timeout, announce, mapped_reads=mapped)
    # A timeout for this wait only: `set_timeout` would change the job's shared store client
    # (every later barrier and NCCL setup of the process) through the prefix store.
    store.wait(["addr"], timedelta(seconds=timeout))
    host, port, job_id = store.get("addr").decode().split(" ")
    return _dckpt.Checkpointer.tcp(rank, world, host, int(port), job_id, timeout, mapped_reads=mapped)
