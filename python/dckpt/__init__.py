"""dckpt: distributed checkpointing for large models.

A sharded state is saved once (every byte of every global tensor exactly once,
checksummed, committed by writing the metadata last) to a local path or an ``s3://``
URL, and loaded back into any other parallel layout. The engine is Rust; this package
adapts Python values to it.

- :mod:`dckpt.torch`: ``save`` / ``load`` of PyTorch state dicts (plain tensors,
  DTensors, explicit :class:`dckpt.torch.Shard` pieces, plain Python values).
- :mod:`dckpt.dcp`: ``DckptStorageWriter`` and ``DckptStorageReader``, so that PyTorch DCP's
  ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` write and read dckpt checkpoints through
  DCP's own planner.
- :func:`metadata`: a checkpoint's index as plain Python values, read by this process.
- :func:`tensor_piece` and :func:`object_piece`: how a leaf is described to the native
  engine, a :class:`TensorPiece` (a region of a global tensor and the host buffer that
  holds it) or an :class:`ObjectPiece` (an object at a grid position and its bytes),
  checked when made; for adapters such as ``dckpt.dcp``.

Errors are one class per kind, all subclasses of :class:`DckptError`, raised with the
same type and message on every rank; ``err.rank`` is the rank that saw the failure.
"""

from dckpt._dckpt import (
    AlreadyExists,
    ChecksumError,
    CollectiveError,
    CommitUncertain,
    CoverageError,
    DckptError,
    FormatError,
    MissingKeys,
    NotACheckpoint,
    ObjectPiece,
    RequestError,
    StorageError,
    TensorPiece,
    UnexpectedKeys,
    metadata,
    object_piece,
    tensor_piece,
)

__all__ = [
    "AlreadyExists",
    "ChecksumError",
    "CollectiveError",
    "CommitUncertain",
    "CoverageError",
    "DckptError",
    "FormatError",
    "MissingKeys",
    "NotACheckpoint",
    "ObjectPiece",
    "RequestError",
    "StorageError",
    "TensorPiece",
    "UnexpectedKeys",
    "metadata",
    "object_piece",
    "tensor_piece",
]
