"""The bytes of object leaves: one tag byte, then the body (docs/format.md, "Object bytes
written by the Python package"). ``J``: JSON, for plain values, which keeps int and float
apart (a tuple becomes a list); ``B``: bytes as they are (a ``bytearray`` comes back as
``bytes``); ``P``: a pickle, only with ``allow_pickle``, on save and on load alike, since
loading a pickle runs code."""

from __future__ import annotations

import json
import pickle
from typing import Any

_JSON, _BYTES, _PICKLE = b"J", b"B", b"P"


def _is_plain(v) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if x is None or isinstance(x, (bool, int, float, str)):
            continue
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                return False
            stack.extend(x.values())
        else:
            return False
    return True


def encode_object(key: str, value: Any, allow_pickle: bool) -> bytes:
    """The stored bytes of ``value``: JSON when it is plain (``None``, ``bool``, ``int``,
    ``float``, ``str`` and lists, tuples and str-keyed dicts of these), the bytes themselves
    for ``bytes`` (a state that pickles itself, as torchtitan's dataloader does, needs no
    ``allow_pickle`` to be saved: only its own code unpickles it), else a pickle with
    ``allow_pickle``, else ``TypeError`` naming ``key``."""
    if _is_plain(value):
        return _JSON + json.dumps(value, separators=(",", ":")).encode()
    if isinstance(value, (bytes, bytearray)):
        return _BYTES + bytes(value)
    if not allow_pickle:
        raise TypeError(
            f"{key}: a {type(value).__name__} is not a plain value (None, bool, int, float, str, lists and "
            "str-keyed dicts of these) nor bytes; pass allow_pickle=True to save and load it as a pickle"
        )
    return _PICKLE + pickle.dumps(value)


def decode_object(key: str, data: bytes, allow_pickle: bool) -> Any:
    """The value of stored bytes that :func:`encode_object` wrote. A pickle needs
    ``allow_pickle`` (``TypeError`` otherwise); any other tag is ``ValueError``."""
    tag, body = data[:1], data[1:]
    if tag == _JSON:
        return json.loads(body)
    if tag == _BYTES:
        return bytes(body)
    if tag == _PICKLE:
        if not allow_pickle:
            raise TypeError(f"{key}: stored as a pickle; pass allow_pickle=True to load it (loading a pickle runs code)")
        return pickle.loads(body)
    raise ValueError(f"{key}: not an object written by dckpt.torch (tag {tag!r})")
