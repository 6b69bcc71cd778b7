"""dckpt's collective calls over a torch.distributed process group.

The native engine calls these methods (through ``dckpt._dckpt``) to agree on a plan and
on every rank's success. They run on a *dedicated* gloo group: gloo carries CPU tensors
whatever the job's default backend is (NCCL included), it opens no fixed port (its
rendezvous goes through the job's store), and a group of its own keeps dckpt's messages
out of the training traffic, so a background save may use it from another thread.

Messages are bytes moved as uint8 CPU tensors, sizes first: a gather and a scatter send
each message at its own size, rank to root or root to rank (gloo's collectives need equal
sizes, and padding to the largest cost the root the world times the largest); an
all-gather pads, as every rank receives everything anyway. No pickles.
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

_I64_MIN = -(1 << 63)
_U32 = (1 << 32) - 1

# One gloo group per distinct process group (by its ranks), made on first use: `new_group`
# is collective, and every rank makes its first dckpt call on a group in the same order.
_groups: dict[tuple[int, ...], object] = {}
_groups_lock = threading.Lock()
# Every TorchCollective, so that releasing the groups reaches the references they hold.
_collectives: weakref.WeakSet[TorchCollective] = weakref.WeakSet()


def _timeout() -> timedelta:
    """How long a call waits for the others: ``DCKPT_COLLECTIVE_TIMEOUT_MS``, else the
    native collectives' 10 minutes (torch's own default, 30, left a rank that died alone
    unnoticed three times as long)."""
    import os

    from dckpt._dckpt import RequestError

    ms = os.environ.get("DCKPT_COLLECTIVE_TIMEOUT_MS")
    if not ms:
        return timedelta(minutes=10)
    try:
        n = int(ms)
    except ValueError:
        n = 0
    if n <= 0:
        # Named, as the native collectives name a bad setting: int()'s own message did not.
        raise RequestError(f"DCKPT_COLLECTIVE_TIMEOUT_MS: cannot parse {ms!r} as a positive number of milliseconds")
    return timedelta(milliseconds=n)


def _gloo_group(ranks: tuple[int, ...]):
    with _groups_lock:
        g = _groups.get(ranks)
        if g is not None and g not in dist.distributed_c10d._world.pg_map:
            # Destroyed with the job's groups (destroy_process_group, then a new job in the
            # same process): a new one is made, as every rank of the new job does.
            g = None
        if g is None:
            world = dist.get_world_size()
            kwargs = {"backend": "gloo", "timeout": _timeout()}
            if len(ranks) != world:
                # Only the group's members make dckpt calls on it, so only they may be asked
                # to join its creation.
                kwargs["use_local_synchronization"] = True
            g = dist.new_group(list(ranks), **kwargs)
            _groups[ranks] = g
        return g


def _reset_after_fork() -> None:
    global _groups_lock, _collectives
    # The parent's groups and lock are not the child's to use, nor to destroy: their
    # worker threads do not exist here, so they are kept, never released.
    _leaked.extend(_groups.values())
    _groups.clear()
    _groups_lock = threading.Lock()
    _collectives = weakref.WeakSet()


_leaked: list[object] = []


def release_groups() -> None:
    """Destroys dckpt's gloo groups and drops every reference dckpt holds to them; later
    calls on a TorchCollective fail. Called at interpreter exit, before finalisation.

    Why: a gloo worker thread drops its reference to a finished collective's work *after*
    the caller's wait returned, and dropping it releases the work's tensors, which takes
    the GIL. If that thread gets the GIL only once the interpreter is finalising, Python
    ends the thread inside a noexcept C++ destructor and the process aborts
    (``terminate called without an active exception``). Dropping the last reference to
    the group runs ``~ProcessGroupGloo`` with the GIL released (torch's holder does so),
    which joins the workers after they have finished, while the interpreter still runs."""
    with _groups_lock:
        groups = list(_groups.values())
        _groups.clear()
    for c in list(_collectives):
        c._group = None
    while groups:
        g = groups.pop()
        # torch's own registry holds the group until it is destroyed (the user's
        # destroy_process_group() of the default group destroys it too).
        if dist.is_initialized() and g in dist.distributed_c10d._world.pg_map:
            try:
                dist.destroy_process_group(g)
            except Exception:  # exiting: a group that cannot shut down is dropped anyway
                pass
        del g  # the last reference: joins the group's workers here


def _to_tensor(data: bytes, size: int) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.uint8)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _to_bytes(t: torch.Tensor, n: int) -> bytes:
    return t[:n].numpy().tobytes()


class TorchCollective:
    """dckpt's collective calls on a dedicated gloo group over ``process_group``'s ranks
    (the default group when ``None``). Made once per process group and reused; the methods
    are what the native ``Checkpointer`` calls, one thread at a time."""

    def __init__(self, process_group=None):
        pg = process_group if process_group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(pg))
        self._group = _gloo_group(ranks)
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        self._global = [dist.get_global_rank(self._group, r) for r in range(self._world)]
        _collectives.add(self)

    @property
    def _pg(self):
        # Never None to torch.distributed: that would mean the default group.
        if self._group is None:
            raise RuntimeError("dckpt's gloo group was released (the interpreter is exiting)")
        return self._group

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._world

    def barrier(self) -> None:
        # An all-reduce rather than dist.barrier: gloo's barrier takes no device hints, and
        # this is what every other call is made of.
        dist.all_reduce(torch.zeros(1, dtype=torch.int64), group=self._pg)

    def _sizes(self, n: int) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world)]
        dist.all_gather(out, torch.tensor([n], dtype=torch.int64), group=self._pg)
        return [int(t.item()) for t in out]

    def all_gather(self, data: bytes) -> list[bytes]:
        sizes = self._sizes(len(data))
        m = max(sizes)
        if m == 0:
            return [b""] * self._world
        out = [torch.empty(m, dtype=torch.uint8) for _ in range(self._world)]
        dist.all_gather(out, _to_tensor(data, m), group=self._pg)
        return [_to_bytes(t, n) for t, n in zip(out, sizes)]

    def gather(self, root: int, data: bytes) -> list[bytes] | None:
        # The sizes to the root alone, then each message at its own size, rank to root: a
        # gather padded to the largest held world x largest bytes on the root, and its
        # all-gather of sizes cost every rank the world (the square of it in all).
        dst = self._global[root]
        n = torch.tensor([len(data)], dtype=torch.int64)
        if self._rank != root:
            dist.gather(n, None, dst=dst, group=self._pg)
            if data:
                self._batch([(dst, _to_tensor(data, len(data)))], [])
            return None
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world)]
        dist.gather(n, counts, dst=dst, group=self._pg)
        sizes = [int(t.item()) for t in counts]
        bufs = [torch.empty(k, dtype=torch.uint8) for k in sizes]
        self._batch([], [(self._global[r], b) for r, b in enumerate(bufs) if sizes[r] and r != root])
        return [data if r == root else _to_bytes(b, k) for r, (b, k) in enumerate(zip(bufs, sizes))]

    def broadcast(self, root: int, data: bytes | None) -> bytes:
        src = self._global[root]
        size = torch.tensor([len(data) if self._rank == root else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self._pg)
        n = int(size.item())
        if n == 0:
            return b""
        buf = _to_tensor(data, n) if self._rank == root else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self._pg)
        return data if self._rank == root else _to_bytes(buf, n)

    def scatter(self, root: int, parts: list[bytes] | None) -> bytes:
        # Each rank's size, then its bytes at that size, root to rank: a broadcast of every
        # size cost each rank the world, and parts padded to the largest world x largest.
        src = self._global[root]
        n = torch.zeros(1, dtype=torch.int64)
        if self._rank == root:
            dist.scatter(n, [torch.tensor([len(p)], dtype=torch.int64) for p in parts], src=src, group=self._pg)
            sends = [(self._global[r], _to_tensor(p, len(p))) for r, p in enumerate(parts) if p and r != root]
            self._batch(sends, [])
            return parts[root]
        dist.scatter(n, None, src=src, group=self._pg)
        k = int(n.item())
        if k == 0:
            return b""
        buf = torch.empty(k, dtype=torch.uint8)
        self._batch([], [(src, buf)])
        return _to_bytes(buf, k)

    def exchange(self, sends: list[tuple[int, bytes]], sources: list[int]) -> list[bytes]:
        """Point to point: each ``(to, message)`` of ``sends`` goes to group rank ``to``;
        returns one message from each rank of ``sources``, in that order (a peer's several
        messages in the order it sent them). Lengths first, then the bytes, each round one
        batch of gloo sends and receives, so the bytes go rank to rank."""
        if not sends and not sources:
            return []
        lens_out = [torch.tensor([len(m)], dtype=torch.int64) for _, m in sends]
        lens_in = [torch.zeros(1, dtype=torch.int64) for _ in sources]
        self._batch([(self._global[to], t) for (to, _), t in zip(sends, lens_out)],
                    [(self._global[r], t) for r, t in zip(sources, lens_in)])
        sizes = [int(t.item()) for t in lens_in]
        data_out = [(self._global[to], _to_tensor(m, len(m))) for to, m in sends if m]
        data_in = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self._batch(data_out, [(self._global[r], t) for r, t, n in zip(sources, data_in, sizes) if n])
        return [_to_bytes(t, n) for t, n in zip(data_in, sizes)]

    def _batch(self, sends: list, recvs: list) -> None:
        ops = [dist.P2POp(dist.isend, t, peer, group=self._pg) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self._pg) for peer, t in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def all_reduce_u64(self, values: list[int], op: str) -> list[int]:
        if not values:
            return []
        if op == "sum":
            # Two 32-bit halves in int64 lanes cannot overflow for any world below 2^31;
            # the carry is folded back in, wrapping at 2^64 as the native sum does.
            lo = torch.tensor([v & _U32 for v in values], dtype=torch.int64)
            hi = torch.tensor([v >> 32 for v in values], dtype=torch.int64)
            both = torch.cat([lo, hi])
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self._pg)
            n = len(values)
            return [((int(both[n + i]) << 32) + int(both[i])) & ((1 << 64) - 1) for i in range(n)]
        if op not in ("min", "max"):
            raise ValueError(f"unknown reduction {op!r}")
        # u64 -> i64 shifted by 2^63 keeps the order, so min and max commute with it.
        t = torch.tensor([v + _I64_MIN for v in values], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self._pg)
        return [int(x) - _I64_MIN for x in t.tolist()]
