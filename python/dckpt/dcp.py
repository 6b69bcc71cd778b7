"""Read dckpt checkpoints with PyTorch DCP: ``torch.distributed.checkpoint.load``.

::

    import torch.distributed.checkpoint as dcp
    from dckpt.dcp import DckptStorageReader

    dcp.load(state_dict, storage_reader=DckptStorageReader("ckpt/step-100"))

loads a checkpoint written by :func:`dckpt.torch.save` (or by the Rust engine and CLI) into
any state dict DCP can load into (DTensors of any mesh and placements, FSDP2, torchtitan,
plain tensors), through DCP's own planner: DCP decides which region of which stored tensor
goes where, dckpt reads the bytes.

- ``read_metadata`` synthesises DCP's :class:`Metadata` from dckpt's index (the msgpack
  metadata the native module decodes; nothing is unpickled): a
  ``TensorStorageMetadata`` per tensor whose chunks are dckpt's stored chunks (a tensor
  stored in flat ZeRO-1 ranges has no box chunks, and is presented as one chunk, the
  whole tensor: dckpt assembles any region from its flat pieces), a
  ``BytesStorageMetadata`` per object.
- ``read_data`` turns every tensor item of the rank's plan into a global region (its
  storage chunk's offset plus the item's storage offsets, its lengths) and reads all of
  them, with every object item, in ONE call of the engine in this process alone (a world
  of one; every byte checked against its checksum), straight into the tensors
  ``planner.resolve_tensor`` returns where they are contiguous host memory of the stored
  dtype, else through a temporary copied in afterwards (as DCP's own reader, a target of
  another dtype gets the values cast); then ``planner.commit_tensor``.

Objects. DCP's default planner ``torch.load``s what ``load_bytes`` gets, so each object is
decoded and handed over as a ``torch.save`` of its value: the plain values
``dckpt.torch`` stores as JSON always; its pickles only with ``allow_pickle=True`` (loading
a pickle runs code); objects in other encodings (raw bytes saved through the Rust API) are
refused, naming the key. An object at a position of a grid (``dckpt.torch.Object``,
Megatron's ShardedObject) has the key Megatron gives it in torch_dist checkpoints,
``KEY/shard_<offset>_<grid shape>`` with ``.``-joined numbers (``rng/shard_0.1_2.2``); a
single object has its own key. DCP flattens the dicts of a state dict, while ``dckpt.torch``
stores a dict of plain values (no tensor inside) as one object: ask for it with a
placeholder that is not a dict (``{"cfg": None}``) and DCP puts the stored dict there.

Strictness is DCP's: a key of the state dict that is not stored raises DCP's own
``Missing key in checkpoint state_dict`` error (unless the planner allows partial loads),
and stored keys nobody asks for are not read. ``location`` is a path or an ``s3://`` URL
(``AWS_*`` from the environment), as for :mod:`dckpt.torch`.
"""

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
from dckpt.torch import decode_object, gc_paused, local_checkpointer, torch_dtype

__all__ = ["DckptStorageReader", "object_fqn"]

# The metadata file whose presence makes a directory a dckpt checkpoint (docs/format.md).
_META_FILE = "dckpt.meta"


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
    """What ``storage_data`` maps an object's ``MetadataIndex`` to."""

    key: str
    grid_shape: tuple[int, ...]
    grid_offset: tuple[int, ...]


class DckptStorageReader(StorageReader):
    """A DCP ``StorageReader`` over the dckpt checkpoint at ``location`` (a path or an
    ``s3://`` URL). ``allow_pickle=True`` lets it hand over objects that ``dckpt.torch``
    stored as pickles (loading a pickle runs code)."""

    def __init__(self, location: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.location = str(location)
        self.allow_pickle = allow_pickle
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return self.location

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
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
        index = dckpt.metadata(self.location)
        sd_meta: dict[str, Any] = {}
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
        md = Metadata(state_dict_metadata=sd_meta, storage_data=storage)
        try:  # StorageMeta is newer than some torch releases DCP loads with
            from torch.distributed.checkpoint.metadata import StorageMeta

            md.storage_meta = StorageMeta(checkpoint_id=self.location, save_id=index["save_id"], load_id=self.load_id)
        except ImportError:  # pragma: no cover - older torch
            pass
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ValueError("DckptStorageReader: the metadata has no storage_data; use the one read_metadata returned")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @gc_paused  # a few objects per item: see dckpt.torch.gc_paused
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
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
            dtype = torch_dtype(stored.dtype)
            buf = dest
            # Targets that share memory are the native side's to fill through temporaries.
            direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
            if not direct:
                buf = torch.empty(lengths, dtype=dtype, pin_memory=dest.device.type == "cuda")
            offset = [c + int(s) for c, s in zip(stored.offset, item.storage_offsets)]
            ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
            tensors.append(tensor_piece(stored.key, stored.dtype, stored.global_shape, offset, lengths, ptr, nbytes))
            targets.append((item, dest, buf))

        # Keys stored but not in the plan are the planner's business (partial state dicts).
        ckpt = local_checkpointer()
        with torch.no_grad():
            _, datas = ckpt.load(self.location, tensors, objects, missing="raise", unexpected="ignore")
            cuda = False
            for item, dest, buf in targets:
                if buf is not dest:
                    dest.copy_(buf, non_blocking=dest.device.type == "cuda")
                    cuda = cuda or dest.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            for item, dest, _ in targets:
                planner.commit_tensor(item, dest)
        del targets

        for (item, stored), data in zip(object_items, datas):
            fqn = item.storage_index.fqn
            if data is None:  # the engine found every requested key, so this is damage
                raise dckpt.FormatError(f"object {fqn!r}: not returned by the checkpoint at {self.location}")
            value = decode_object(fqn, data, self.allow_pickle)
            out = io.BytesIO()
            torch.save(value, out)
            out.seek(0)
            planner.load_bytes(item, out)

        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
