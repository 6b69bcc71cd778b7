"""``DckptStorageWriter``: DCP's ``dcp.save`` and ``dcp.async_save`` writing dckpt checkpoints."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import dckpt
from dckpt import object_piece, tensor_piece
from dckpt.dcp import _nest
from dckpt.torch import _process, encode_object, gc_paused
from dckpt.torch._leaves import _descriptor_buffer, _plain, _Staging, dtype_name

__all__ = ["DckptStorageWriter"]


def _dcp_metadata(location: str) -> str | None:
    """The metadata file of a checkpoint torch's FileSystemWriter wrote at ``location`` on
    local disk, where there is one: a plain ``dcp.load(checkpoint_id=location)`` reads it."""
    path = os.path.join(location, ".metadata")
    return path if "://" not in location and os.path.lexists(path) else None


def _where(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    """An item's identity across plans: DCP's global plan rewrites the index hints."""
    return index.fqn, tuple(int(x) for x in (index.offset or ()))


@dataclasses.dataclass(frozen=True)
class _Groups:
    """A local plan's ``storage_data``: the rank's object groups, key -> its leaves."""

    groups: dict[str, tuple[tuple, ...]]


@dataclasses.dataclass(frozen=True)
class _Split:
    """A final plan's ``storage_data``: which of the rank's groups to store as their parts."""

    keys: frozenset[str]


class _Seen:
    """The coordinator's memory, for DCP's plan cache (a rank whose plan did not change is
    sent none, and keeps its cached final plan): per cache, its global plans as they were
    when this writer last sent every rank its split (while they stand, so do the ranks'
    final plans), and its merged local plans as last seen."""

    settled: dict[Any, Any] = {}
    lists: dict[Any, Any] = {}


def _dcp_cache(plans: list[SavePlan]):
    """``(key, merged local plans, global plans)`` of DCP's save-plan cache that ``plans``
    came from, or ``(None, None, None)`` (no cache; or none was sent and every cache stands
    as this writer left it): the cache whose global plans are the very plans sent (DCP resends the
    objects it caches), or where none was sent, the one whose merged local plans are new
    since the last save (a local plan changed, no rank's share did), else the one whose
    ranks' final plans this writer did not split (another writer saved with it). Every
    rank's latest local plan is there. DCP's private state, read only: without it a rank
    whose plan DCP did not resend could not be told a new split."""
    local = getattr(SavePlanner, "_cached_all_plans", None) or {}
    glob = getattr(SavePlanner, "_cached_global_plan", None) or {}
    n = len(plans)
    keys = [k for k, g in glob.items() if len(g) == n and len(local.get(k) or ()) == n]
    sent = [(r, p) for r, p in enumerate(plans) if p.usable]
    if sent:
        found = [k for k in keys if all(glob[k][r] is p for r, p in sent)]
    else:
        found = [k for k in keys if _Seen.lists.get(k) is not local[k]]
        found = found or [k for k in keys if _Seen.settled.get(k) is not glob[k]]
    _Seen.lists = dict(local)
    if len(found) > 1:
        raise ValueError(
            f"DckptStorageWriter: DCP's plan caches {sorted(map(str, found))} may each be this save's (no rank sent "
            "a plan, and this writer did not split their ranks' final plans); save with the planner's plan caching off"
        )
    return (found[0], local[found[0]], glob[found[0]]) if len(found) == 1 else (None, None, None)


def _object_groups(items: list[WriteItem], mappings: dict | None):
    """dckpt's objects of DCP's items as this rank's own items group them (object key ->
    its path's length and its leaves), and each object leaf's path."""
    mappings = mappings or {}

    def path(fqn: str) -> tuple:
        return tuple(mappings.get(fqn, (fqn,)))

    objects = {i.index.fqn: path(i.index.fqn) for i in items if i.type == WriteItemType.BYTE_IO}
    tensors = [path(i.index.fqn) for i in items if i.type != WriteItemType.BYTE_IO]
    return _nest.group_objects(objects, tensors), objects


def _leaf_paths(groups: dict, paths: dict) -> dict[str, tuple[tuple, ...]]:
    """What a local plan tells the coordinator of its groups: key -> its leaves' paths inside it."""
    return {k: tuple(sorted((paths[f][root:] for f in fqns), key=repr)) for k, (root, fqns) in groups.items()}


def _plan_groups(plan: SavePlan) -> dict[str, tuple[tuple, ...]]:
    """The object groups of a rank's local plan (``_leaf_paths``); of another writer's plan,
    found in DCP's cache, made here from its items."""
    if isinstance(plan.storage_data, _Groups):
        return plan.storage_data.groups
    return _leaf_paths(*_object_groups(list(plan.items), plan.planner_data))


class DckptStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes a dckpt checkpoint at ``location`` (a path or an
    ``s3://`` URL; or the ``checkpoint_id`` given to ``dcp.save``).

    DCP's planner decides what each rank writes (its dedup of replicas, DTensor and FSDP2
    shards, objects); in ``write_data`` every rank hands its items to dckpt's engine in one
    collective save over ``process_group`` (the default group when ``None``; pass the group
    ``dcp.save`` gets when it is not the default): the coverage of every tensor is proved
    before a byte is written, the tensor replicas DCP dropped are compared as
    ``replica_check`` says (``"sample"``, ``"all"``, ``"off"``; objects keep the copy DCP
    chose, as its own writer does), every byte is checksummed, and the engine
    commits. The checkpoint is what ``dckpt.torch.save`` writes for the same state: tensors
    under DCP's flat keys (which are dckpt's), objects regrouped as ``dckpt.torch`` groups
    them (a dict or list without a tensor inside is one object), stored as JSON when plain,
    as a pickle only with ``allow_pickle``; but for what DCP's flattening drops before any
    writer sees it (a container that holds no leaf, such as an optimizer's ``state`` before
    its first step; dict keys that are not strings), which ``dckpt.torch.load`` and
    ``dcp.load`` take back from the state dict's own containers, as DCP's own load keeps
    them (the layout's ``objects_from`` is ``dcp_leaves``). A group whose leaves differ between ranks
    (torchtitan's ``{"dataloader": {f"dp_rank_{k}": ..., "world_size": n}}``) is stored as
    its parts instead, under DCP's flat keys (``dataloader.dp_rank_0``, each part whole
    where the ranks hold it alike): the ranks' groups meet in ``prepare_global_plan``.
    ``replace=True`` overwrites a committed checkpoint (else ``dckpt.AlreadyExists``), or one
    torch's ``FileSystemWriter`` wrote there, whose ``.metadata`` goes once this save commits.
    For ``dcp.save(no_dist=True)`` (one process of a job saving alone) make it with
    ``process_group=dckpt.torch.LOCAL``.

    ``dcp.save`` returns DCP's ``Metadata``, whose ``storage_data`` is dckpt's save outcome
    (``save_id``, ``bytes``, ``files``, ``phases``...), and whose ``storage_meta`` carries that
    ``save_id``; ``writer.outcome`` holds the outcome too. DCP
    reports a failure of any rank as its ``CheckpointException`` on every rank, carrying
    each rank's own error: dckpt's typed errors, the same on every rank
    (:func:`dckpt.dcp.dckpt_error` takes it out).
    """

    def __init__(
        self,
        location: str | os.PathLike | None = None,
        *,
        replace: bool = False,
        replica_check: str = "sample",
        allow_pickle: bool = False,
        process_group=None,
    ) -> None:
        super().__init__()
        if replica_check not in ("sample", "all", "off"):
            raise ValueError(f"replica_check={replica_check!r}: expected 'sample', 'all' or 'off'")
        self.location = None if location is None else str(location)
        self.replace = replace
        self.replica_check = replica_check
        self.allow_pickle = allow_pickle
        self.process_group = process_group
        self.save_id = uuid.uuid4().hex
        self.outcome: dict | None = None
        self._local_items: list[WriteItem] | None = None
        self._local_groups = None  # _object_groups of _local_items
        # Made here, on the caller's thread: the first dckpt call on a group makes its gloo
        # group, a collective that must not start on an async save's worker thread.
        if not _process.is_local(process_group):
            _process._checkpointer(process_group, None)

    # Pickled for DCP's process-based async save: the child has its own job and group.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_local_items"] = None
        state["_local_groups"] = None
        return state

    @property
    def checkpoint_id(self) -> str | None:
        return self.location

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.location = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.outcome = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """An ``s3://`` URL, or a path under a directory this process may write."""
        s = str(checkpoint_id)
        if s.startswith("s3://"):
            return True
        if "://" in s:
            return False
        parent = os.path.dirname(os.path.abspath(s))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        return bool(parent) and os.access(parent, os.W_OK)

    def storage_meta(self) -> StorageMeta | None:
        # The committed save's id once there is one (dckpt's, as in the checkpoint's metadata).
        save_id = self.outcome["save_id"] if self.outcome else self.save_id
        return StorageMeta(checkpoint_id=self.location, save_id=save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "DckptStorageWriter: dcp.save(use_collectives=False) writes per-rank checkpoints; "
                "a dckpt checkpoint is committed by all ranks together"
            )
        if self.location is None:
            raise ValueError("DckptStorageWriter: no location; give one, or dcp.save(checkpoint_id=...)")
        rank = kwargs.get("rank")
        if rank is not None and rank != _process.rank_and_world(self.process_group)[0]:
            # dcp.save(no_dist=True) tells every rank it is rank 0: a save of one process,
            # where this writer's group would save collectively (and wait for the others).
            raise ValueError(
                "DckptStorageWriter: dcp.save(no_dist=True) saves from one process; "
                "make the writer with process_group=dckpt.torch.LOCAL"
            )
        stale = _dcp_metadata(self.location)
        if stale is not None and not self.replace:
            # Left there, it would still be what a plain dcp.load of the location reads.
            raise dckpt.AlreadyExists(
                f"DckptStorageWriter: a PyTorch DCP checkpoint is at {self.location} ({stale}); "
                "choose another location or pass replace=True to replace it"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # DCP's dedup drops replicas from the global plan without a trace: the full local
        # plan is kept so they can still be compared. With plan caching an unchanged plan
        # arrives empty, and DCP's own cache holds it (write_data).
        self._local_items = list(plan.items) if plan.usable else None
        self._local_groups = None
        if not plan.usable:
            return plan
        self._local_groups = _object_groups(self._local_items, plan.planner_data)
        return dataclasses.replace(plan, storage_data=_Groups(_leaf_paths(*self._local_groups)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        n = len(plans)
        world = _process.rank_and_world(self.process_group)[1]
        if n != world:
            # dcp.save(no_dist=True) on rank 0, or a process group given to DCP and not to
            # the writer: the native save would wait for ranks that never join it.
            raise ValueError(
                f"DckptStorageWriter: DCP planned a save of {n} rank(s) and the writer's group has {world}; "
                "give the writer the group DCP saves with (process_group=dckpt.torch.LOCAL to save from one "
                "process, as with dcp.save(no_dist=True))"
            )
        key, cached_local, cached_global = _dcp_cache(plans)
        if key is None and not all(p.usable for p in plans):
            if not any(p.usable for p in plans):
                return plans  # DCP's cache as this writer left it: every rank's split stands
            raise ValueError(
                "DckptStorageWriter: DCP's plan cache is not where it was, so a rank whose plan it did not resend "
                "cannot be told how to store its objects; save with the planner's plan caching off"
            )
        # With DCP's cache, a rank's local plan may have changed although its plan arrives
        # empty (its share of the deduped items did not): the merged local plans have it.
        groups = [_plan_groups(p) for p in cached_local or plans]
        split = _nest.split_groups(groups)
        out = []
        for rank, p in enumerate(plans):
            held = groups[rank]
            # Its split groups, and the parts of them split in turn.
            mine = frozenset(k for k in split if k in held or any(g in split and k.startswith(g + ".") for g in held))
            if not p.usable:
                # Its cached final plan was split for other plans, or by another writer (not at
                # all): sent again, split as now.
                p = cached_global[rank]
            out.append(dataclasses.replace(p, storage_data=_Split(mine)))
        if key is not None:
            _Seen.settled[key] = cached_global
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        ckpt, _ = _process._checkpointer(self.process_group, None)
        # Maybe this rank's alone: every rank fails with it, none waits.
        with _process.tell_others(ckpt, lambda why: ckpt.save(self.location, [], [], replace=self.replace, caller_failed=why)):
            split = self._split(plan, ckpt.rank)
            tensors, objects, keep, results = self._pieces(plan, planner, split)
        # Its objects are rebuilt from DCP's flattened leaves: a load fills them into the
        # state dict's own containers (``_nest.restore_dropped``).
        layout = {"world_size": str(ckpt.world_size), "objects_from": "dcp_leaves"}
        try:
            self.outcome = ckpt.save(
                self.location, tensors, objects, replace=self.replace, layout=layout, replica_check=self.replica_check
            )
        finally:
            del keep
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The engine has committed (dckpt's metadata is written last, by its own protocol);
        # DCP's Metadata carries the outcome back to the caller.
        metadata.storage_data = self.outcome
        metadata.storage_meta = self.storage_meta()
        stale = _dcp_metadata(self.location) if self.replace else None
        if stale is not None:
            # The torch checkpoint replaced: only now, so that a failed save leaves it whole.
            try:
                os.remove(stale)
            except FileNotFoundError:
                pass

    @staticmethod
    def _split(plan: SavePlan, rank: int) -> frozenset[str]:
        """The groups the final plan says to store as their parts. A plan without that word
        did not come from this writer's ``prepare_global_plan``: its groups would be stored
        whole, each with one rank's leaves only."""
        if not isinstance(plan.storage_data, _Split):
            raise ValueError(
                f"DckptStorageWriter: rank {rank}'s final plan was not made by this writer's prepare_global_plan "
                "(a planner's finish_plan that drops storage_data, or another writer's plan in DCP's plan cache); "
                "save with the planner's plan caching off"
            )
        return plan.storage_data.keys

    def _full_local_items(self, plan: SavePlan, planner: SavePlanner) -> list[WriteItem]:
        if self._local_items is not None:
            return self._local_items
        cached = getattr(SavePlanner, "_cached_save_plan", {}).get(getattr(planner, "_cached_plans_key", None))
        # Without DCP's cache, the final plan is all this rank knows of: no replicas.
        return list(cached.items) if cached is not None else list(plan.items)

    @gc_paused  # a few objects per item: see dckpt.torch.gc_paused (not the native save: an
    # async save's thread would keep the collector off for the training thread meanwhile)
    def _pieces(self, plan: SavePlan, planner: SavePlanner, split: frozenset[str]):
        """This rank's native pieces: every item of its full local plan, main where DCP's
        final plan kept it; and the write results of the final plan."""
        kept = {_where(i.index) for i in plan.items}
        items = self._full_local_items(plan, planner)
        staging = _Staging()
        keep: list[Any] = []
        tensors, object_items = [], []
        results = []
        with torch.no_grad():
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    object_items.append(item)
                    continue
                main = _where(item.index) in kept
                td = item.tensor_data
                data = planner.resolve_data(item)
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"{item.index.fqn}: the planner resolved a {type(data).__name__} for a tensor item")
                data = _plain(data)
                if list(data.shape) != list(td.chunk.sizes):
                    raise ValueError(
                        f"{item.index.fqn}: the planner resolved a tensor of shape {list(data.shape)} "
                        f"for a chunk of {list(td.chunk.sizes)}"
                    )
                if data.layout is not torch.strided:
                    raise TypeError(f"{item.index.fqn}: a {data.layout} tensor has no dense form here")
                name = dtype_name(data.dtype, item.index.fqn)  # refused before a device copy is made
                host = staging.host(data, item.index.fqn)
                keep.append(host)
                ptr, nbytes = _descriptor_buffer(host)
                offset = [int(x) for x in td.chunk.offsets]
                tensors.append(
                    tensor_piece(
                        item.index.fqn, name, [int(d) for d in td.size], offset,
                        [int(d) for d in td.chunk.sizes], ptr, nbytes, main=main,
                    )
                )
                if main:
                    results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
            staging.sync()
        objects = self._objects(items, kept, planner, results, split)
        return tensors, objects, keep, results

    def _objects(self, items: list[WriteItem], kept: set, planner: SavePlanner, results: list, split) -> list:
        """dckpt's objects of DCP's object items: regrouped (see ``_nest``), each main on the
        rank whose final plan kept its first leaf; a group in ``split`` as its parts."""
        mappings = getattr(planner, "mappings", None) or {}
        by_fqn = {i.index.fqn: i for i in items if i.type == WriteItemType.BYTE_IO}
        out = []
        # Grouped once per plan: in prepare_local_plan, unless DCP's cache sent none.
        found = self._local_groups if items is self._local_items else None
        groups, paths = found or _object_groups(items, mappings)
        for key, (root, fqns) in groups.items():
            for okey, depth, leaves in _nest.parts(key, root, fqns, paths, split):
                entries = [(paths[f][depth:], self._value(by_fqn[f], planner)) for f in leaves]
                data = encode_object(okey, _nest.rebuild(entries), self.allow_pickle)
                main = _where(by_fqn[min(leaves)].index) in kept
                # Not compared: DCP keeps the copy its planner chose, whatever the others hold.
                out.append(object_piece(okey, main=main, data=data, compare=False))
                for f in leaves:
                    if _where(by_fqn[f].index) in kept:
                        results.append(WriteResult(index=by_fqn[f].index, size_in_bytes=len(data), storage_data=None))
        return out

    def _value(self, item: WriteItem, planner: SavePlanner) -> Any:
        lookup = getattr(planner, "lookup_object", None)
        if lookup is not None:
            return lookup(item.index)
        data = planner.resolve_data(item)  # a planner of its own: what DCP would write
        if isinstance(data, io.BytesIO):
            data.seek(0)
            return torch.load(data, weights_only=not self.allow_pickle)
        return data

