"""Save and load PyTorch state dicts with dckpt.

``save(state_dict, location)`` writes every byte of every global tensor once, whatever
the parallel layout, and ``load(state_dict, location)`` fills the given tensors in place,
in whatever layout *they* describe (resharding). ``location`` is a path or an
``s3://bucket/prefix`` URL (credentials and endpoint from the ``AWS_*`` environment).

The state dict is nested dicts and lists; each leaf gets the dotted path to it as its key
(``model.layers.0.weight``, list indices as numbers). Leaves:

- a plain ``torch.Tensor``: the whole tensor, the same on every rank of the group; saved
  once (by the group's first rank; the others hold replicas);
- a DTensor: its local shard, placed by its mesh and placements (``Shard(d)``, uneven
  splits included, and ``Replicate``, over any number of mesh dimensions; ``Partial`` is
  refused);
- :class:`Shard`: an explicit piece of a global tensor, for framework-defined sharding
  (Megatron, ZeRO-1 flat buffers);
- :class:`Object`: an explicit per-rank object in a grid (RNG states);
- anything else is an object: plain Python values (``None``, ``bool``, ``int``, ``float``,
  ``str`` and lists, tuples and str-keyed dicts of these, with no tensor inside) are
  stored as JSON (tuples come back as lists), saved once (common state: a value another
  rank holds otherwise, compared with the dicts' keys sorted, fails the save with
  ``CoverageError`` on every rank, as does one only other ranks hold; a value of each
  rank's own goes in an :class:`Object`, or under a key of its own); ``bytes`` as they are
  (a ``bytearray`` comes back as ``bytes``), and plain values holding bytes as a pickle
  that names no class (a ``bytearray`` inside comes back as one; copies on other ranks
  that hold ``bytes`` there compare equal, and the main copy's types are stored), loaded without ``allow_pickle`` by an unpickler that refuses every
  class; other values are pickled, only with ``allow_pickle=True`` (on ``load`` too:
  loading a pickle runs code). Plain values holding bytes are compared across ranks by
  a canonical form of their values and types (the dicts' keys sorted, a tuple not a list);
  other pickles are not: equal values can pickle to different bytes. ``load`` replaces such a leaf of the target, ``None``
  included, with the stored value. The copies of an :class:`Object` that ranks hold as
  replicas are compared in the same way.

Collectives: inside an initialised torch.distributed job, dckpt talks over a dedicated
gloo group over ``process_group``'s ranks (the default group when ``None``), created at
the first call on that group; no port of its own. Without an initialised job, or with
``process_group=LOCAL``, the process is a world of one (reading a checkpoint alone inside
a job, say). For very large worlds, ``collective="tcp"`` (or ``DCKPT_COLLECTIVE=tcp`` in the
environment) uses dckpt's own TCP star instead, which keeps Python out of the collective
path: the group's first rank listens on an ephemeral port and publishes ``host:port`` in
the job's store (the default process group's), where the others read it. That rank's
host is ``DCKPT_TCP_HOST`` when set, else its hostname's address; it must be reachable
from every rank. Never ``MASTER_PORT``.

Reads: from local disk by system calls, unless ``DCKPT_MAPPED_READS=1`` (read when a
group's checkpointer is made): loads then copy out of mappings of the files, as the CLI
does, checking each piece of every read in cache just before it is copied, which makes a
warm load faster. It installs, on first use, a process-wide ``SIGBUS`` handler that turns
an unreadable page of a mapped file into an error and hands every other ``SIGBUS`` to the
handler before it: the host's to allow.

Every rank of the group makes the same calls in the same order. Errors are
``dckpt.DckptError`` subclasses, raised identically on every rank.

Processes: a native checkpointer is kept per process group (a save of the same structure
reuses the previous plan). A forked child (a DataLoader worker) starts afresh as a world
of one and never touches the parent's engines; background saves still running when the
interpreter exits are finished first, then dckpt's gloo groups are destroyed (their worker
threads joined) before the interpreter finalises.

Helpers for code that builds on this module (``dckpt.dcp`` does): :func:`encode_object`
and :func:`decode_object` (the stored bytes of object leaves, docs/format.md),
:func:`local_checkpointer` (this process's native checkpointer for a world of one) and
:func:`gc_paused` (a decorator that keeps the cyclic collector off during a walk).
"""

from __future__ import annotations

# Cut by concern: _leaves (dtypes, Shard, Object, the walk, host data), _objects (object
# bytes), _process (checkpointers per group, fork, exit, TCP rendezvous), _save, _load.
from dckpt.torch._collective import TorchCollective
from dckpt.torch._leaves import (
    Object,
    Shard,
    _descriptor_buffer,
    _dtensor_piece,
    dtype_name,
    gc_paused,
    torch_dtype,
)
from dckpt.torch._load import load, metadata
from dckpt.torch._objects import decode_object, encode_object
from dckpt.torch._process import LOCAL, _checkpointer, _shutdown, local_checkpointer
from dckpt.torch._save import AsyncSave, save

__all__ = [
    "LOCAL",
    "AsyncSave",
    "CheckpointManager",
    "ManagedAsyncSave",
    "Object",
    "Shard",
    "TorchCollective",
    "decode_object",
    "dtype_name",
    "encode_object",
    "gc_paused",
    "load",
    "local_checkpointer",
    "metadata",
    "save",
    "torch_dtype",
]

from dckpt.torch._manager import CheckpointManager, ManagedAsyncSave  # noqa: E402
