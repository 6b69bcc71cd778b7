"""``DckptStorageReader``: DCP's ``dcp.load`` reading dckpt checkpoints."""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import dckpt
from dckpt import ObjectPiece, TensorPiece, object_piece, tensor_piece
from dckpt.dcp import _nest
from dckpt.torch import decode_object, gc_paused, local_checkpointer, torch_dtype
from dckpt.torch._load import _refuse_meta

__all__ = ["DckptStorageReader", "object_fqn"]

# The metadata file whose presence makes a directory a dckpt checkpoint (docs/format.md).
_META_FILE = "dckpt.meta"
_NONE = object()


def _segments(rel: str) -> tuple:
    """The path of a dotted key below its container: numbers as list indices (only those
    ``str`` gives back: ``"00"`` stays a dict key)."""
    return tuple(int(s) if _nest.is_index(s) else s for s in rel.split("."))


def object_fqn(key: str, grid_shape, grid_offset) -> str:
    """The DCP key of a stored object: ``key`` for a single object, Megatron's
    ``key/shard_<offset>_<shape>`` for one at ``grid_offset`` of a grid."""
    if not grid_shape:
        return key
    return f"{key}/shard_{'.'.join(str(int(x)) for x in grid_offset)}_{'.'.join(str(int(x)) for x in grid_shape)}"


@dataclass(frozen=True)
class _TensorChunk:
    """What ``storage_data`` maps a tensor chunk's ``MetadataIndex`` to."""

    key: str
    dtype: str  # dckpt's dtype name
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # of the chunk, in the global tensor


@dataclass(frozen=True)
class _StoredObject:
    """What ``storage_data`` maps an object's ``MetadataIndex`` to: the object, or the part
    of it at ``path`` that DCP flattens it into (``_nest.dcp_leaves``)."""

    key: str
    grid_shape: tuple[int, ...]
    grid_offset: tuple[int, ...]
    path: tuple | None = None
    container: bool = False  # a group stored as its parts, offered whole (_offer_containers)


class _ByName(dict):
    """DCP's ``state_dict_metadata`` here: the keys DCP's flattening finds, listed as
    FileSystemWriter's metadata lists them; and ``whole``, objects found by their own key
    only (``in``, ``[]``, ``get``), for a state dict holding a placeholder there or a planner
    that does not flatten. Listed, such a key is one a flattened state dict lacks, which
    DCP's planner takes for a torch 2.3 checkpoint: it then flattens the state dict the 2.3
    way, where an empty dict beside a tensor is a key of its own, never stored."""

    def __init__(self) -> None:
        super().__init__()
        self.whole: dict[str, Any] = {}

    def __missing__(self, key: str) -> Any:
        return self.whole[key]

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self.whole

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def offer(self, key: str, value: Any, md: Any) -> None:
        """Offers ``value`` whole at ``key``, listed only where its leaves cannot give it back:
        a dict keyed by numbers (int keys, or a list that lost items), which DCP's flattening
        turns into str keys; loaded whole, the state dict's own container takes them back."""
        (self if _nest.has_index_keys(value) else self.whole)[key] = md


def partial_or_missing(planner: LoadPlanner, fqn: str):
    """What becomes of a key of the state dict's container at ``fqn`` that the stored one
    lacks: kept under ``allow_partial_load``, else DCP's own error for a missing key (it was
    dropped without a word)."""

    def missing(path: tuple) -> bool:
        if getattr(planner, "allow_partial_load", False):
            return True
        raise RuntimeError(f"Missing key in checkpoint state_dict: {'.'.join([fqn, *map(str, path)])}.")

    return missing


class DckptStorageReader(StorageReader):
    """A DCP ``StorageReader`` over the dckpt checkpoint at ``location`` (a path or an
    ``s3://`` URL; or the ``checkpoint_id`` given to ``dcp.load``). ``allow_pickle=True``
    lets it hand over objects that ``dckpt.torch`` stored as pickles (loading a pickle runs
    code)."""

    def __init__(self, location: str | os.PathLike | None = None, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.location = None if location is None else str(location)
        self.allow_pickle = allow_pickle
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex
        # key -> decoded value of the single objects read with the metadata
        self._values: dict[str, Any] = {}
        # key -> a group stored as its parts under a key that also holds a stored value
        self._shadowed: dict[str, Any] = {}

    @property
    def checkpoint_id(self) -> str | None:
        return self.location

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._values = {}
        self._shadowed = {}
        if checkpoint_id:
            self.location = str(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """An ``s3://`` URL, or a directory holding a committed dckpt checkpoint."""
        s = str(checkpoint_id)
        if s.startswith("s3://"):
            return True
        return os.path.isfile(os.path.join(s, _META_FILE))

    def read_metadata(self) -> Metadata:
        # No **kwargs on purpose: DCP then does not retry with rank-local metadata, which
        # dckpt does not have.
        if self.location is None:
            raise ValueError("DckptStorageReader: no location; give one, or dcp.load(checkpoint_id=...)")
        index = dckpt.metadata(self.location)
        sd_meta = _ByName()
        storage: dict[MetadataIndex, Any] = {}
        for key, t in index["tensors"].items():
            gshape = tuple(int(d) for d in t["shape"])
            props = TensorProperties(dtype=torch_dtype(t["dtype"]))
            if t["flat_chunks"]:
                boxes = [((0,) * len(gshape), gshape)]
            else:
                boxes = [(tuple(int(x) for x in o), tuple(int(x) for x in s)) for o, s in t["chunks"]]
            chunks = []
            for i, (offset, shape) in enumerate(boxes):
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape)))
                storage[MetadataIndex(key, offset, i)] = _TensorChunk(key, t["dtype"], gshape, offset)
            sd_meta[key] = TensorStorageMetadata(properties=props, size=torch.Size(gshape), chunks=chunks)
        for key, o in index["objects"].items():
            grid = tuple(int(d) for d in o["grid_shape"])
            for entry in o["entries"]:
                fqn = object_fqn(key, grid, entry)
                sd_meta[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StoredObject(key, grid, tuple(int(x) for x in entry))
        # A single object is also offered as the leaves DCP flattens it into, so a state
        # dict's `optim.param_groups.0.lr` finds the stored `optim.param_groups` (which
        # stays found by its own key: `_ByName.offer`).
        self._values = self._read_values([k for k, o in index["objects"].items() if not o["grid_shape"]])
        flattened = set()
        for key, value in self._values.items():
            leaves = _nest.dcp_leaves(key, value)
            if leaves:
                flattened.add(key)
                sd_meta.offer(key, value, sd_meta.pop(key))
            for fqn, path in leaves.items():
                if fqn not in sd_meta:
                    sd_meta[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = _StoredObject(key, (), (), path)
        self._offer_containers(index, sd_meta, storage, flattened)
        md = Metadata(state_dict_metadata=sd_meta, storage_data=storage)
        try:  # StorageMeta is newer than some torch releases DCP loads with
            from torch.distributed.checkpoint.metadata import StorageMeta

            md.storage_meta = StorageMeta(checkpoint_id=self.location, save_id=index["save_id"], load_id=self.load_id)
        except ImportError:  # pragma: no cover - older torch
            pass
        return md

    def _offer_containers(self, index: dict, sd_meta: _ByName, storage: dict, flattened: set[str]) -> None:
        """Offers a group the writer stored as its parts (its leaves differ between ranks,
        ``_nest.split_groups``) whole too, as the dict of all its stored leaves: DCP asks for
        it whole where the state dict holds a placeholder there, and where it reads a state
        dict the way torch 2.3 flattened it (``_ByName``). Not a group: the prefix of a key
        beside an object DCP flattens (``{"a.b": 1, "a": {"c": 2}}``) or inside one."""
        found = _nest.containers(list(self._values), set(), index["tensors"])
        for prefix, keys in found.items():
            if prefix in flattened or getattr(storage.get(MetadataIndex(prefix)), "path", None) is not None:
                continue
            try:
                # A list's parts are its indices (DCP's paths hold ints there).
                value = _nest.rebuild([(_segments(k[len(prefix) + 1 :]), self._values[k]) for k in keys])
            except ValueError:  # a leaf and a container at one path: offered as leaves only
                continue
            if prefix in sd_meta:
                # One rank stored a value at the key, another a group under it: each rank
                # is given what its own state holds there (`read_data`).
                self._shadowed[prefix] = value
                continue
            self._values[prefix] = value
            sd_meta.offer(prefix, value, BytesStorageMetadata())
            storage[MetadataIndex(prefix)] = _StoredObject(prefix, (), (), container=True)

    @staticmethod
    def _target(planner: LoadPlanner, fqn: str) -> Any:
        """What the state dict being loaded holds at ``fqn``; ``None`` where the planner
        does not say."""
        target = getattr(planner, "original_state_dict", None)
        try:
            for p in getattr(planner, "mappings", {}).get(fqn, (fqn,)):
                target = target[p]
        except (KeyError, IndexError, TypeError):
            return None
        return target

    def _own_part(self, value: Any, planner: LoadPlanner, fqn: str) -> Any:
        """Of a group offered whole, the keys (or list items) the state dict's own container
        at its place holds, as DCP would load them leaf by leaf (each torchtitan rank its own
        ``dp_rank_<k>``); all of it where the planner does not say or holds no container
        there. A group rebuilt as a dict of digit keys (another rank held a dict there) fills
        a list by its indices, and a list fills a dict of digit keys."""
        target = self._target(planner, fqn)
        if not target or not isinstance(target, (dict, list)) or not isinstance(value, (dict, list)):
            return value
        stored = value if isinstance(value, dict) else {str(i): v for i, v in enumerate(value)}
        keys = range(len(target)) if isinstance(target, list) else target
        missing = [k for k in keys if str(k) not in stored]
        if missing:
            raise KeyError(f"DckptStorageReader: {fqn}.{missing[0]} is not stored in {self.location}")
        if isinstance(target, list):
            return [stored[str(i)] for i in keys]
        return {k: stored[str(k)] for k in target}

    def _read_values(self, keys: list[str]) -> dict[str, Any]:
        """The decoded values of the single objects ``keys`` whose value can be decoded
        here (JSON; pickles with ``allow_pickle``); one read of this process."""
        if not keys:
            return {}
        pieces = [object_piece(k) for k in keys]
        _, datas = local_checkpointer().load(self.location, [], pieces, missing="raise", unexpected="ignore")
        out = {}
        for key, data in zip(keys, datas):
            if data is None:
                continue
            try:
                out[key] = decode_object(key, data, self.allow_pickle)
            # A pickle not allowed, raw bytes, or one this process cannot unpickle (a class it
            # cannot import, CUDA tensors on a host without): offered whole only, and decoded
            # (or refused) only if a load asks for it.
            except Exception:
                continue
        return out

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ValueError("DckptStorageReader: the metadata has no storage_data; use the one read_metadata returned")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        tensors, objects, object_items, targets = self._pieces(plan, planner)
        # Keys stored but not in the plan are the planner's business (partial state dicts).
        ckpt = local_checkpointer()
        with torch.no_grad():
            _, datas = ckpt.load(self.location, tensors, objects, missing="raise", unexpected="ignore")
            cuda: set[torch.device] = set()
            for item, dest, buf in targets:
                if buf is not dest:
                    dest.copy_(buf, non_blocking=dest.device.type == "cuda")
                    if dest.device.type == "cuda":
                        cuda.add(dest.device)
            # Without a device `synchronize` waits for the current one only: the planner
            # would be handed a target on another whose copy has not landed.
            for device in cuda:
                torch.cuda.synchronize(device)
            for item, dest, _ in targets:
                planner.commit_tensor(item, dest)
        del targets

        fetched = iter(datas)
        for item, stored in object_items:
            fqn = item.storage_index.fqn
            # A rank whose state holds a group where another rank's held a value gets the
            # group's parts (they were read with the metadata), not that value. An empty
            # dict gets nothing where the planner flattens, as DCP's own flattening drops it
            # and loads nothing there; a planner that does not asks for the stored value.
            target = self._target(planner, fqn)
            shadowed = self._shadowed.get(fqn, _NONE)
            read = stored.key not in self._values
            data = next(fetched) if read else None  # every object read is taken, used or not
            if isinstance(target, dict) and not target and getattr(planner, "flatten_state_dict", False):
                value = {}
            elif shadowed is not _NONE and isinstance(target, (dict, list)):
                value = self._own_part(shadowed, planner, fqn)
            elif not read:
                value = _nest.get_at(self._values[stored.key], stored.path or ())
                if stored.container:
                    value = self._own_part(value, planner, fqn)
            elif data is None:  # the engine found every requested key, so this is damage
                raise dckpt.FormatError(f"object {fqn!r}: not returned by the checkpoint at {self.location}")
            else:
                value = _nest.get_at(decode_object(fqn, data, self.allow_pickle), stored.path or ())
            if isinstance(target, (dict, list, tuple)):
                # DCP asked for a container whole: what its flattening drops (empty dicts,
                # keys that were not strings) the state dict's own container keeps; a key the
                # checkpoint lacks is missing, and where the planner flattens, one the state
                # dict lacks is not loaded, as DCP's load of each leaf finds them.
                flat = getattr(planner, "flatten_state_dict", False)
                value = _nest.restore_dropped(target, value, partial_or_missing(planner, fqn), exact=flat)
            out = io.BytesIO()
            torch.save(value, out)
            out.seek(0)
            planner.load_bytes(item, out)

        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @gc_paused  # a few objects per item: see dckpt.torch.gc_paused (not the native load: it
    # releases the GIL for as long as it reads, and other threads would run without the collector)
    def _pieces(self, plan: LoadPlan, planner: LoadPlanner):
        """The native pieces of ``plan``'s items, its object items, and ``(read item, what
        resolve_tensor gave, the buffer read into)`` for each tensor item."""
        tensors: list[TensorPiece] = []
        objects: list[ObjectPiece] = []
        object_items = []
        # (read item, what resolve_tensor gave, the buffer read into)
        targets: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for item in plan.items:
            stored = self.storage_data.get(item.storage_index)
            if stored is None:
                raise KeyError(
                    f"DckptStorageReader: {item.storage_index.fqn!r} at {list(item.storage_index.offset or [])} "
                    f"is not in the metadata of {self.location}"
                )
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(stored, _StoredObject):
                    raise TypeError(f"{item.storage_index.fqn}: stored as a tensor, requested as an object")
                if stored.key not in self._values:  # else read with the metadata
                    objects.append(object_piece(stored.key, stored.grid_shape, stored.grid_offset))
                object_items.append((item, stored))
                continue
            if not isinstance(stored, _TensorChunk):
                raise TypeError(f"{item.storage_index.fqn}: stored as an object, requested as a tensor")
            dest = planner.resolve_tensor(item).detach()
            lengths = [int(x) for x in item.lengths]
            if list(dest.shape) != lengths:
                raise ValueError(
                    f"{stored.key}: the planner resolved a target of shape {list(dest.shape)} for a read of {lengths}"
                )
            _refuse_meta(stored.key, dest)
            dtype = torch_dtype(stored.dtype)
            buf = dest
            # Targets that share memory are the native side's to fill through temporaries.
            direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous() and not dest.is_neg()
            if not direct:
                buf = torch.empty(lengths, dtype=dtype, pin_memory=dest.device.type == "cuda")
            offset = [c + int(s) for c, s in zip(stored.offset, item.storage_offsets)]
            ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
            tensors.append(tensor_piece(stored.key, stored.dtype, stored.global_shape, offset, lengths, ptr, nbytes))
            targets.append((item, dest, buf))
        return tensors, objects, object_items, targets
