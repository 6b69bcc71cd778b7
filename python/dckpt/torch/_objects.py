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


def encode_object(key: str, value: Any, allow_pickle: bool) -> bytes:
    """The stored bytes of ``value``: JSON when it is plain (``None``, ``bool``, ``int``,
    ``float``, ``str`` and lists, tuples and str-keyed dicts of these), the bytes themselves
    for ``bytes``, a pickle for plain values holding bytes (a state that pickles itself, as
    torchtitan's dataloader does, needs no ``allow_pickle``: only its own code unpickles
    it), else a pickle with ``allow_pickle``, else ``TypeError`` naming ``key``. What JSON
    or the pickle raise (a value that holds itself, a lambda) names ``key`` too."""
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
        return _PICKLE + pickle.dumps(value)
    except Exception as e:
        raise _naming(key, e) from e


def _naming(key: str, e: Exception) -> Exception:
    """``e`` again, of its type where that takes a message alone, its message led by the key
    it is about: a failure of JSON or pickle names only the value's innards."""
    try:
        return type(e)(f"{key}: {e}")
    except Exception:  # a type that wants more arguments (JSONDecodeError)
        return ValueError(f"{key}: {type(e).__name__}: {e}")


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
    if _is_plain(value, with_bytes=True):
        return {"digest": _canonical(value)}
    return {"compare": False}


class _Close:
    """Marks, on :func:`_canonical`'s stack, where a container's items end."""

    __slots__ = ("id",)

    def __init__(self, ident: int):
        self.id = ident


def _canonical(value: Any) -> int:
    """CRC-32 of a canonical form of plain values and bytes (of the builtin types, which
    :func:`_is_plain` checked): each value a type tag and its contents, a container its
    length first, a dict its items in key order. Values Python calls equal digest alike
    (dicts built in another order, ``bytes`` and ``bytearray``); values it tells apart do
    not (a list and a tuple, ``1`` and ``True``, a str and its bytes). A container inside
    itself is written as how many containers up it opened. Walked with a stack, not
    recursion: any depth a pickle takes, this takes."""
    crc, stack, open_ = 0, [value], {}
    while stack:
        x = stack.pop()
        t = type(x)
        if t is _Close:
            del open_[x.id]
            continue
        if t in (list, tuple, dict) and id(x) in open_:
            part = b"@%d;" % (len(open_) - open_[id(x)])
        elif x is None:
            part = b"N"
        elif t is bool:
            part = b"T" if x else b"F"
        elif t is int:
            part = b"i%d;" % x
        elif t is float:
            part = b"f" + x.hex().encode() + b";"
        elif t is str:
            b = x.encode("utf-8", "surrogatepass")
            part = b"s%d:" % len(b) + b
        elif t in (bytes, bytearray):
            crc = zlib.crc32(b"b%d:" % len(x), crc)
            part = x  # not copied: a dataloader's state can be large
        else:  # list, tuple, dict: its items follow, then its close
            open_[id(x)] = len(open_)
            stack.append(_Close(id(x)))
            if t is dict:
                part = b"{%d;" % len(x)
                for k in sorted(x, reverse=True):
                    stack.append(x[k])
                    stack.append(k)
            else:
                part = (b"[%d;" if t is list else b"(%d;") % len(x)
                stack.extend(reversed(x))
        crc = zlib.crc32(part, crc)
    return crc


def decode_object(key: str, data: bytes, allow_pickle: bool) -> Any:
    """The value of stored bytes that :func:`encode_object` wrote. A pickle of anything but
    plain values and bytes needs ``allow_pickle`` (``TypeError`` otherwise); any other tag
    is ``ValueError``. What JSON or the pickle raise names ``key``."""
    tag, body = data[:1], data[1:]
    if tag == _BYTES:
        return bytes(body)
    if tag == _JSON or (tag == _PICKLE and allow_pickle):
        try:
            return json.loads(body) if tag == _JSON else pickle.loads(body)
        except Exception as e:  # damaged JSON, a class that moved since the save
            raise _naming(key, e) from e
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
