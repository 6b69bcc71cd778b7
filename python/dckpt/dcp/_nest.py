"""How DCP's flat keys and dckpt's object keys meet.

DCP flattens a state dict down to its leaves: every dict, and every list holding a dict or
a tensor (``optim.param_groups.0.lr``). ``dckpt.torch`` descends only into containers that
hold tensors: a dict or list without a tensor inside is one object (``optim.param_groups``,
a list of dicts). A checkpoint has one form, dckpt's, whichever API wrote it:

- the writer regroups DCP's object leaves into dckpt's objects (:func:`group_objects`);
- the reader offers each stored object to DCP both whole and as the leaves DCP would
  flatten it into (:func:`dcp_leaves`), so that a flat request and a placeholder both find it.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch.distributed.checkpoint._nested_dict import flatten_state_dict

Path = tuple[Any, ...]  # DCP's object path: str dict keys, int list indices


def group_root(path: Path, tensor_prefixes: set[Path]) -> Path:
    """The path of the object ``dckpt.torch`` makes of the leaf at ``path``: its shortest
    prefix with no tensor under it (``tensor_prefixes``: every prefix of a tensor's path)."""
    for n in range(1, len(path) + 1):
        if path[:n] not in tensor_prefixes:
            return path[:n]
    return path  # a tensor's own path: not an object leaf (the caller's mistake)


def prefixes(paths: Iterable[Path]) -> set[Path]:
    """Every non-empty prefix of every path, the paths included."""
    out: set[Path] = set()
    for p in paths:
        for n in range(1, len(p) + 1):
            out.add(p[:n])
    return out


def rebuild(entries: list[tuple[Path, Any]]) -> Any:
    """The container the leaves ``(path relative to it, value)`` came from: a list where
    every key is an index, else a dict."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    children: dict[Any, list[tuple[Path, Any]]] = {}
    for rel, value in entries:
        if not rel:
            raise ValueError("a leaf and a container at one path")
        children.setdefault(rel[0], []).append((rel[1:], value))
    if all(isinstance(k, int) for k in children):
        return [rebuild(children[k]) for k in sorted(children)]
    return {str(k): rebuild(v) for k, v in children.items()}


def join(path: Path) -> str:
    """DCP's flat key of ``path``."""
    return ".".join(map(str, path))


def group_objects(object_paths: dict[str, Path], tensor_paths: Iterable[Path]) -> dict[str, tuple[int, list[str]]]:
    """dckpt's object key -> (the length of its path, the DCP leaves it is made of, as flat
    keys in order)."""
    tp = prefixes(tensor_paths)
    groups: dict[str, tuple[int, list[str]]] = {}
    for fqn, path in object_paths.items():
        root = group_root(path, tp)
        groups.setdefault(join(root), (len(root), []))[1].append(fqn)
    return groups


def dcp_leaves(key: str, value: Any) -> dict[str, Path]:
    """The leaves DCP flattens the object ``value`` stored at ``key`` into: flat key ->
    path inside ``value``. Empty where DCP keeps it whole."""
    try:
        flat, mappings = flatten_state_dict({key: value})
    except ValueError:  # two leaves with one flat key ("a.b" and a["b"]): offer it whole only
        return {}
    if list(flat) == [key]:
        return {}
    return {fqn: tuple(path[1:]) for fqn, path in mappings.items()}


def get_at(value: Any, path: Path) -> Any:
    """The part of ``value`` at ``path`` (a key of :func:`dcp_leaves`)."""
    for p in path:
        if isinstance(value, dict) and p not in value:  # DCP's path has str() of the key
            p = next(k for k in value if str(k) == p)
        value = value[p]
    return value
