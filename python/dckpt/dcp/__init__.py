"""dckpt checkpoints through PyTorch DCP: ``dcp.save``, ``dcp.async_save`` and ``dcp.load``.

::

    import torch.distributed.checkpoint as dcp
    from dckpt.dcp import DckptStorageReader, DckptStorageWriter

    dcp.save(state_dict, storage_writer=DckptStorageWriter("s3://bucket/run/step-100"))
    dcp.load(state_dict, storage_reader=DckptStorageReader("s3://bucket/run/step-100"))

Both sides keep DCP's planner in charge (what each rank writes, what region of which stored
tensor goes where) and dckpt's engine doing the bytes. A checkpoint has one form whichever
API wrote it: ``dckpt.torch.load``, ``DckptStorageReader``, the CLI (``inspect``,
``validate``, ``convert``, ``export``) and any other layout read what either writes.

**Writing** (:class:`DckptStorageWriter`). In ``write_data`` every rank maps its items onto
dckpt's pieces (a DTensor's or FSDP2 parameter's local chunk, a plain tensor, an object)
and all ranks make one collective save: the global plan is proved to cover every tensor
exactly once before a byte is written (``dckpt.CoverageError`` otherwise), the tensor
replicas DCP's dedup dropped are still compared as ``replica_check`` says (objects keep the
copy DCP chose, as DCP's own writer does, unlike ``dckpt.torch.save``), every byte is
checksummed, and the commit is dckpt's (metadata last). ``dcp.async_save`` works with the
thread-based executor (the default) and the process-based one; its future's result is
DCP's ``Metadata``, whose ``storage_data`` is dckpt's outcome. A directory holding a checkpoint
of DCP's own writer (its ``.metadata``, which a plain ``dcp.load`` would read) is refused
unless ``replace=True``, which removes that file once the save commits. DCP catches what a rank
raises and raises its ``CheckpointException`` (a ``BaseException``) on every rank; inside
it, each rank's error is dckpt's typed one, the same on every rank:
:func:`dckpt_error` returns it.

**Reading** (:class:`DckptStorageReader`).

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

**Objects.** DCP flattens every dict of a state dict, and every list holding a dict or a
tensor, down to its leaves (``optim.param_groups.0.lr``); ``dckpt.torch`` stores a dict or
list with no tensor inside as one object (``optim.param_groups``). The writer regroups
DCP's leaves into dckpt's objects; the reader offers each single object both as the leaves
DCP flattens it into, listed in the metadata as DCP's own writer lists them, and whole,
found by its own key but not listed, so a flattened state dict and a placeholder
(``{"cfg": None}``) both find it and each dict gets back the keys it holds. A group whose
leaves differ between ranks (torchtitan's ``{"dataloader": {f"dp_rank_{k}": ...,
"world_size": n}}``) would be one object each rank holds otherwise: the ranks' groups meet
in the global plan, and such a group is stored as its parts (``dataloader.dp_rank_0``,
``dataloader.world_size``), each judged again; the reader offers the group whole too, each
rank given the keys its own dict holds. An object holding a dict keyed by numbers is
listed whole: DCP's planner then loads objects whole (torch 2.3's flattening), so that int
keys and lists that lost empty items come back as the state dict holds them; but that
flattening makes an empty dict beside a tensor a key of its own, never stored, which only
``DefaultLoadPlanner(allow_partial_load=True)`` lets pass. DCP's default planner ``torch.load``s what
``load_bytes`` gets, so each object is decoded and handed over as a ``torch.save`` of its
value: the plain values stored as JSON always; pickles only with ``allow_pickle=True``
(loading a pickle runs code); objects in other encodings (raw bytes saved through the Rust
API) are refused, naming the key. An object at a position of a grid
(``dckpt.torch.Object``, Megatron's ShardedObject) has the key Megatron gives it in
torch_dist checkpoints, ``KEY/shard_<offset>_<grid shape>`` with ``.``-joined numbers
(``rng/shard_0.1_2.2``).

Strictness is DCP's: a key of the state dict that is not stored raises DCP's own ``Missing
key in checkpoint state_dict`` error (unless the planner allows partial loads), and stored
tensors nobody asks for are not read. Single objects are read and decoded with the
metadata, on every rank, to offer DCP the leaves it flattens them into (with
``allow_pickle`` that unpickles them too, asked for or not). ``location`` is a path or an ``s3://`` URL (``AWS_*``
from the environment), as for :mod:`dckpt.torch`; ``checkpoint_id=`` of ``dcp.save`` and
``dcp.load`` may give it instead.
"""

from __future__ import annotations

import dckpt
from dckpt.dcp._reader import DckptStorageReader, object_fqn
from dckpt.dcp._writer import DckptStorageWriter

__all__ = ["DckptStorageReader", "DckptStorageWriter", "dckpt_error", "object_fqn"]


def dckpt_error(exc: BaseException) -> dckpt.DckptError | None:
    """The dckpt error inside ``exc``: ``exc`` itself, or for DCP's ``CheckpointException``
    the first failed rank's error where it is one of dckpt's (the same on every rank);
    else ``None``."""
    if isinstance(exc, dckpt.DckptError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for rank in sorted(failures):
            found = failures[rank]
            err = found[0] if isinstance(found, tuple) else found
            if isinstance(err, dckpt.DckptError):
                return err
    return None
