"""How DCP's flat keys and dckpt's object keys meet.

DCP flattens a state dict down to its leaves: every dict, and every list holding a dict or
a tensor (``optim.param_groups.0.lr``). ``dckpt.torch`` descends only into containers that
hold tensors: a dict or list without a tensor inside is one object (``optim.param_groups``,
a list of dicts). A checkpoint has one form, dckpt's, whichever API wrote it:

- the writer regroups DCP's object leaves into dckpt's objects (:func:`group_objects`),
  but a group whose leaves differ between ranks is stored as its parts, under DCP's flat
  keys (:func:`split_groups`, :func:`parts`);
- the reader offers each stored object to DCP both whole and as the leaves DCP would
  flatten it into (:func:`dcp_leaves`), so that a flat request and a placeholder both find it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    the keys are the indices 0 to n-1, else a dict."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    children: dict[Any, list[tuple[Path, Any]]] = {}
    for rel, value in entries:
        if not rel:
            raise ValueError("a leaf and a container at one path")
        children.setdefault(rel[0], []).append((rel[1:], value))
    if all(isinstance(k, int) for k in children) and sorted(children) == list(range(len(children))):
        return [rebuild(children[k]) for k in range(len(children))]
    return {str(k): rebuild(v) for k, v in children.items()}


def is_index(key: str) -> bool:
    """Whether a str key may stand for a list index or an int key: the digits ``str`` gives
    for a number (``"3"``, not ``"03"``)."""
    return key.isascii() and key.isdigit() and str(int(key)) == key


def has_index_keys(value: Any) -> bool:
    """Whether ``value`` holds a dict with a key :func:`is_index` (at any depth)."""
    if isinstance(value, Mapping):
        return any(is_index(str(k)) or has_index_keys(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(has_index_keys(v) for v in value)
    return False


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


def split_groups(per_rank: Iterable[dict[str, tuple[Path, ...]] | None]) -> set[str]:
    """The object keys to store as their parts, of every rank's groups (object key -> the
    paths of its leaves inside it; ``None`` for a rank not known): a key some rank holds
    with other leaves than another (torchtitan's ``dataloader`` holds ``dp_rank_<k>`` and
    ``world_size``), and the keys of a leaf the ranks put under different keys. Merged,
    such a group would be one object whose value each rank holds otherwise. Its parts, one
    per child, are judged the same way in turn, so that a rank's ``dp_rank_<k>`` stays one
    object however much it holds."""
    level = [dict(g or {}) for g in per_rank]
    split: set[str] = set()
    while any(level):
        paths_of: dict[str, tuple[Path, ...]] = {}
        key_of: dict[str, str] = {}
        bad: set[str] = set()
        for groups in level:
            for key, paths in groups.items():
                if paths_of.setdefault(key, paths) != paths:
                    bad.add(key)
                for p in paths:
                    leaf = join((key, *p))
                    if key_of.setdefault(leaf, key) != key:
                        bad.update((key, key_of[leaf]))
        split |= bad
        level = [_children({k: v for k, v in groups.items() if k in bad}) for groups in level]
    return split


def _children(groups: dict[str, tuple[Path, ...]]) -> dict[str, tuple[Path, ...]]:
    """The groups one level down: each child of each group, with its leaves' paths."""
    out: dict[str, list[Path]] = {}
    for key, paths in groups.items():
        for p in paths:
            if p:  # a group that is one leaf has no parts
                out.setdefault(join((key, p[0])), []).append(p[1:])
    return {k: tuple(v) for k, v in out.items()}


def parts(key: str, root: int, fqns: list[str], paths: dict[str, Path], split: set[str] | frozenset[str]):
    """The objects of the group ``key`` (its path ``root`` long, its leaves ``fqns``):
    ``[(object key, its path's length, its leaves)]``, the group itself unless ``split``
    names it, else the parts of each of its children."""
    if key not in split:
        return [(key, root, fqns)]
    children: dict[Any, list[str]] = {}
    out = []
    for f in fqns:
        if len(paths[f]) > root:
            children.setdefault(paths[f][root], []).append(f)
        else:
            out.append((key, root, [f]))
    for child, fs in children.items():
        out.extend(parts(join((key, child)), root + 1, fs, paths, split))
    return out


def containers(object_keys: Iterable[str], taken: set[str], tensor_keys: Iterable[str]) -> dict[str, list[str]]:
    """The dotted prefixes of ``object_keys`` under which no tensor lies and that name
    nothing offered already (``taken``): prefix -> the object keys under it. A group the
    writer stored as its parts is such a prefix."""
    tensor_prefixes = {k[:i] for k in tensor_keys for i, c in enumerate(k) if c == "."}
    out: dict[str, list[str]] = {}
    for key in object_keys:
        for i, c in enumerate(key):
            if c == "." and key[:i] not in taken and key[:i] not in tensor_prefixes:
                out.setdefault(key[:i], []).append(key)
    return out


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


def _dropped(value: Any) -> bool:
    """Whether DCP's flattening leaves nothing of ``value``: a mapping whose values all
    leave nothing (``{}``, ``{"a": {}}``), or a list it descends into (one holding a
    mapping) whose items all leave nothing (``[{}]``). Other lists are leaves, empty too."""
    if isinstance(value, Mapping):
        return all(_dropped(v) for v in value.values())
    if isinstance(value, list) and any(isinstance(v, Mapping) for v in value):
        return all(_dropped(v) for v in value)
    return False


def restore_dropped(
    target: Any, stored: Any, missing: Callable[[tuple], bool] | None = None, exact: bool = False
) -> Any:
    """``stored``, an object rebuilt from DCP's flattened leaves, with the shape DCP's
    flattening lost taken back from ``target``, the state dict's own value at its place (as
    DCP's own load, leaf by leaf into the target, keeps it): the containers that left no
    leaf (an optimizer's ``state`` before its first step), the dict keys that were not
    strings, a list whose dropped items made it come back as a dict of digit keys, and a
    tuple stored as a list. What ``stored`` holds otherwise wins. A key of ``target`` that
    ``stored`` lacks goes, unless ``missing`` (given its path) says to keep it or raises, as
    DCP's per-leaf load does; with ``exact`` (that load's own keys), so does a key of
    ``stored`` that a dict of ``target`` lacks."""

    def walk(target: Any, stored: Any, path: tuple) -> Any:
        if isinstance(target, Mapping) and isinstance(stored, dict):
            out: dict[Any, Any] = {}
            seen: set[Any] = set()
            for k, v in target.items():
                sk = k if k in stored else str(k)
                if sk in stored:
                    out[k] = walk(v, stored[sk], (*path, k))
                    seen.add(sk)
                elif _dropped(v) or (missing is not None and missing((*path, k))):
                    out[k] = v
            if not exact:
                out.update((k, v) for k, v in stored.items() if k not in seen)
            return out
        if isinstance(target, list) and isinstance(stored, dict):
            indices = {str(i) for i in range(len(target))}
            if stored.keys() <= indices and all(str(i) in stored or _dropped(t) for i, t in enumerate(target)):
                return [walk(t, stored[str(i)], (*path, i)) if str(i) in stored else t for i, t in enumerate(target)]
        if isinstance(target, list) and isinstance(stored, list) and len(target) == len(stored):
            return [walk(t, s, (*path, i)) for i, (t, s) in enumerate(zip(target, stored))]
        if isinstance(target, tuple) and isinstance(stored, list) and len(target) == len(stored):
            # Stored as a list (JSON has no tuple): the state dict's tuple, as DCP keeps it
            # (an optimizer's `betas`), a named one included.
            items = [walk(t, s, (*path, i)) for i, (t, s) in enumerate(zip(target, stored))]
            return type(target)(*items) if hasattr(target, "_fields") else type(target)(items)
        return stored

    return walk(target, stored, ())
