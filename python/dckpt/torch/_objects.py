"""The bytes of object leaves: one tag byte, then the body (docs/format.md, "Object bytes
written by the Python package"). ``J``: JSON, for plain values, which keeps int and float
apart (a tuple becomes a list); ``B``: bytes as they are (a ``bytearray`` comes back as
``bytes``); ``P``: a pickle, only with ``allow_pickle``, on save and on load alike, since
loading a pickle runs code, but for plain values holding bytes (torchtitan's dataloader
state), which need no class to load and are loaded by an unpickler that refuses every one."""

from __future__ import annotations

import io
import json
import pickle
import zlib
from typing import Any

_JSON, _BYTES, _PICKLE = b"J", b"B", b"P"


_SCALARS = (type(None), bool, int, float, str)


def _is_plain(v, with_bytes: bool = False) -> bool:
    """Whether ``v`` is plain values (JSON's: subclasses of the builtin types included), or,
    ``with_bytes``, plain values and bytes of exactly the builtin types (what a pickle that
    names no class holds: a pickle of a subclass, an ``OrderedDict`` say, names its class).
    Each container is visited once: a value may share or contain itself."""
    is_a = (lambda x, types: type(x) in types) if with_bytes else isinstance
    scalars = (*_SCALARS, bytes, bytearray) if with_bytes else _SCALARS
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if is_a(x, scalars) or id(x) in seen:
            continue
        seen.add(id(x))
        if is_a(x, (list, tuple)):
            stack.extend(x)
        elif is_a(x, (dict,)):
            if not all(is_a(k, (str,)) for k in x):
                return False
            stack.extend(x.values())
        else:
            return False
    return True


class _NoClasses(pickle.Unpickler):
    """Loads plain values and bytes only: every class a pickle names is refused, so no
    code runs (the standard way of restricting an unpickler)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name}")


class TorchSaved:
    """A value to store as its ``torch.save`` archive, as torch_dist stores Megatron's
    ShardedObjects: loaded back by ``torch.load``, so tuples, tensors and the containers
    its ``weights_only`` mode knows come back as they were, with no ``allow_pickle``; a value
    that mode cannot load needs ``allow_pickle`` (refused at the save otherwise)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _torch_saved(key: str, value: Any, allow_pickle: bool) -> bytes:
    import torch

    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        _naming(key, e)
        raise
    data = buf.getvalue()
    if not allow_pickle:
        # Refused now rather than at the restore, where it would be too late to choose.
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise TypeError(
                f"{key}: a {type(value).__name__} that torch.load's weights_only mode cannot load; pass "
                "allow_pickle=True to save and load it (loading a pickle runs code)"
            ) from e
    return data


def encode_object(key: str, value: Any, allow_pickle: bool) -> bytes:
    """The stored bytes of ``value``: JSON when it is plain (``None``, ``bool``, ``int``,
    ``float``, ``str`` and lists, tuples and str-keyed dicts of these), the bytes themselves
    for ``bytes``, a pickle for plain values holding bytes (a state that pickles itself, as
    torchtitan's dataloader does, needs no ``allow_pickle``: only its own code unpickles
    it), else a pickle with ``allow_pickle``, else ``TypeError`` naming ``key``. What JSON
    or the pickle raise (a value that holds itself, a lambda) names ``key`` too. A
    :class:`TorchSaved` is stored as its ``torch.save`` archive."""
    if type(value) is TorchSaved:
        return _torch_saved(key, value.value, allow_pickle)
    if isinstance(value, (bytes, bytearray)):
        return _BYTES + bytes(value)
    plain = _is_plain(value)
    if not (plain or allow_pickle or _is_plain(value, with_bytes=True)):
        raise TypeError(
            f"{key}: a {type(value).__name__} is not a plain value (None, bool, int, float, str, lists and "
            "str-keyed dicts of these, and bytes); pass allow_pickle=True to save and load it as a pickle"
        )
    try:
        if plain:
            return _JSON + json.dumps(value, separators=(",", ":")).encode()
        # Protocol 5 writes a bytearray with an opcode of its own; 4 and below name its
        # class, which the unpickler that loads plain values refuses.
        return _PICKLE + pickle.dumps(value, protocol=5)
    except Exception as e:
        _naming(key, e)
        raise


def _naming(key: str, e: Exception) -> None:
    """Leads ``e``'s message with the key it is about: a failure of JSON or pickle names
    only the value's innards."""
    _lead(e, key, f"while encoding or decoding {key}")


def _lead(e: Exception, lead: str, note: str | None = None) -> None:
    """Leads ``e``'s message with ``lead``, in place (its type and attributes kept); where
    the message is not its first argument (built from attributes, as UnicodeDecodeError's
    is), adds ``note`` (``lead`` itself by default) for the traceback instead."""
    if e.args and isinstance(e.args[0], str) and str(e) == e.args[0]:
        e.args = (f"{lead}: {e.args[0]}", *e.args[1:])
    else:
        e.add_note(lead if note is None else note)


def compared_as(value: Any, data: bytes) -> dict:
    """How the save's replica check compares the copies other ranks hold of an object whose
    bytes :func:`encode_object` made ``data`` of ``value`` (``object_piece``'s arguments):
    JSON by a CRC-32 of the value with its keys sorted, as equal dicts built in another order
    are one value; bytes as they are; plain values holding bytes by a CRC-32 of
    :func:`_canonical`'s form, for the same reason; any other pickle not at all, as equal
    values can pickle to different bytes and only their classes know what equal means."""
    tag = data[:1]
    if tag == _JSON:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        return {"digest": zlib.crc32(canonical)}
    if tag == _BYTES:
        return {}
    digest = _canonical(value)  # None for a pickle of classes
    return {"compare": False} if digest is None else {"digest": digest}


_END = object()
# Items :func:`_canonical` walks again, in containers it walked before, before it gives up.
_EXPANSIONS_MAX = 100_000


def _canonical(value: Any) -> int | None:
    """CRC-32 of a canonical form of plain values and bytes (of the builtin types exactly,
    dicts keyed by str; ``None`` for anything else, which the walk meets as it goes, so
    that no other walk is needed first): each value a type tag and its contents, a
    container its length and then the digest of each item, a dict its items in key order. Equal values of
    one type digest alike (dicts built in another order; ``bytes`` and ``bytearray`` count
    as one type; a value shared or copied), and values of different types do not, whatever
    ``==`` says (a list and a tuple, ``1``, ``1.0`` and ``True``, ``0.0`` and ``-0.0``):
    their pickles, and so what a load gives back, differ. A container inside itself is
    written as how many containers up it opened. Each bytes object, and each container
    with no such reference to a container around it, is digested once however often it is
    shared (60 lists of two of the next hold 2^60 paths); one that refers to a container
    around it is digested where it stands, as its digest depends on that place. ``None``
    where that would walk more than :data:`_EXPANSIONS_MAX` items again (sharing and
    cycles at once): such a value is not compared. Walked with a stack, not recursion: any
    depth a pickle takes, this takes."""
    done: dict[int, bytes] = {}  # id -> the part a container or bytes object was digested to
    open_: dict[int, int] = {}  # id -> depth, the containers being walked
    frames: list[list] = []  # [id, the digest so far, its items left, the shallowest depth referred to]
    top, again, distinct = 0, 0, set()

    def emit(part) -> None:
        nonlocal top
        if frames:
            frames[-1][1] = zlib.crc32(part, frames[-1][1])
        else:
            top = zlib.crc32(part, top)

    def items(x, t):
        if t is dict:
            for k in sorted(x):
                yield k
                yield x[k]
        else:
            yield from x

    def visit(x) -> bool:
        nonlocal again
        t = type(x)
        i = id(x)
        if i in done:
            emit(done[i])
        elif i in open_:
            depth = open_[i]
            emit(b"@%x;" % (len(open_) - depth))
            frames[-1][3] = min(frames[-1][3], depth)
        elif t in (list, tuple, dict):
            if t is dict and not all(type(k) is str for k in x):
                return False
            if i in distinct:  # walked before, where its digest depended on the place
                again += len(x) + 1
                if again > _EXPANSIONS_MAX:
                    return False
            distinct.add(i)
            open_[i] = len(open_)
            head = b"{%x;" if t is dict else b"[%x;" if t is list else b"(%x;"
            frames.append([i, zlib.crc32(head % len(x)), items(x, t), open_[i]])
        elif t in (bytes, bytearray):
            done[i] = b"b%x:%08x" % (len(x), zlib.crc32(x))
            emit(done[i])
        elif x is None:
            emit(b"N")
        elif t is bool:
            emit(b"T" if x else b"F")
        elif t is int:
            emit(b"i%x;" % x)  # hex: any size (decimal is refused past 4300 digits)
        elif t is float:
            emit(b"f" + x.hex().encode() + b";")
        elif t is str:
            b = x.encode("utf-8", "surrogatepass")
            emit(b"s%x:" % len(b) + b)
        else:  # a class, a set, a subclass of a builtin: no canonical form here
            return False
        return True

    if not visit(value):
        return None
    while frames:
        frame = frames[-1]
        item = next(frame[2], _END)
        if item is not _END:
            if not visit(item):
                return None
            continue
        frames.pop()
        i, digest, _, reach = frame
        depth = open_.pop(i)
        part = b"c%08x" % digest
        if reach >= depth:  # nothing inside refers around it: the same digest anywhere
            done[i] = part
        elif frames:
            frames[-1][3] = min(frames[-1][3], reach)
        emit(part)
    return top


# A zip archive: what `torch.save` writes, and so what a torch_dist (DCP) checkpoint holds
# for each object, kept as it is when converted to dckpt. A tag of `P` is followed by a
# pickle's PROTO opcode (0x80), never by "K".
_TORCH_SAVE = b"PK\x03\x04"


def _torch_loaded(key: str, data: bytes, allow_pickle: bool) -> Any:
    """An object converted from torch_dist, loaded as DCP loads it: ``torch.load``, whose
    ``weights_only`` mode (tensors and plain values, no other class) is the default unless
    ``allow_pickle``."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if allow_pickle:
            _naming(key, e)
            raise
        raise TypeError(
            f"{key}: a torch.save object (converted from torch_dist) that names classes; "
            "pass allow_pickle=True to load it (loading a pickle runs code)"
        ) from e
    except Exception as e:
        _naming(key, e)
        raise


def decode_object(key: str, data: bytes, allow_pickle: bool) -> Any:
    """The value of stored bytes that :func:`encode_object` wrote, or of a ``torch.save``
    archive that a conversion from torch_dist kept. A pickle of anything but plain values
    and bytes needs ``allow_pickle`` (``TypeError`` otherwise); any other tag is
    ``ValueError``. What JSON or the pickle raise names ``key``."""
    if data.startswith(_TORCH_SAVE):
        return _torch_loaded(key, data, allow_pickle)
    tag, body = data[:1], data[1:]
    if tag == _BYTES:
        return bytes(body)
    if tag == _JSON or (tag == _PICKLE and allow_pickle):
        try:
            return json.loads(body) if tag == _JSON else pickle.loads(body)
        except Exception as e:  # damaged JSON, a class that moved since the save
            _naming(key, e)
            raise
    if tag == _PICKLE:
        try:
            value = _NoClasses(io.BytesIO(body)).load()
        except Exception:  # a class named, or a pickle this unpickler cannot read: refused below
            value = _PICKLE
        # A set or a complex needs no class either, but is not a plain value.
        if value is _PICKLE or not _is_plain(value, with_bytes=True):
            raise TypeError(f"{key}: stored as a pickle; pass allow_pickle=True to load it (loading a pickle runs code)")
        return value
    raise ValueError(f"{key}: not an object written by dckpt.torch (tag {tag!r})")
