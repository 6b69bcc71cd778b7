"""python/dckpt/_dckpt.pyi against the native module: every name the stub declares exists in
dckpt._dckpt and every public name of the module is declared, and each function's and
method's parameters (names, kinds, which have defaults, literal defaults) agree with what the
module reports in ``__text_signature__``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from dckpt import _dckpt

STUB = Path(__file__).resolve().parents[1] / "dckpt" / "_dckpt.pyi"

_KINDS = {
    "posonly": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonly": inspect.Parameter.KEYWORD_ONLY,
}


def _stub() -> dict[str, ast.AST]:
    """The stub's top-level classes and functions, less typing-only Protocols."""
    out = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            if any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
                continue
            out[node.name] = node
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = node
    return out


def _literal(node: ast.expr | None):
    """The default's value where the stub spells a literal (``...`` and names are not)."""
    if node is None:
        return inspect.Parameter.empty
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return ...
    return ... if value is Ellipsis else value


def _stub_params(fn: ast.FunctionDef, drop_self: bool) -> list[tuple[str, inspect._ParameterKind, object]]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [
        (p.arg, _KINDS["posonly"] if p in a.posonlyargs else _KINDS["args"], _literal(d))
        for p, d in zip(positional, defaults)
    ]
    params += [(p.arg, _KINDS["kwonly"], _literal(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if drop_self:
        params = params[1:]
    return params


def _native_params(obj, drop_self: bool) -> list[tuple[str, inspect._ParameterKind, object]]:
    params = list(inspect.signature(obj).parameters.values())
    if drop_self and params and params[0].name in ("self", "$self"):
        params = params[1:]
    # pyo3 writes `...` for a default it cannot spell as a literal.
    return [(p.name, p.kind, ... if p.default is Ellipsis else p.default) for p in params]


def _agree(what: str, stub, native) -> list[str]:
    if len(stub) != len(native):
        return [f"{what}: the stub has parameters {[p[0] for p in stub]}, the module {[p[0] for p in native]}"]
    problems = []
    for (sn, sk, sd), (nn, nk, nd) in zip(stub, native):
        if (sn, sk) != (nn, nk):
            problems.append(f"{what}: parameter {sn} ({sk.name}) in the stub, {nn} ({nk.name}) in the module")
        elif (sd is inspect.Parameter.empty) != (nd is inspect.Parameter.empty):
            problems.append(f"{what}: parameter {sn} has a default on one side only")
        elif sd is not ... and nd is not ... and sd != nd:
            problems.append(f"{what}: parameter {sn} defaults to {sd!r} in the stub, {nd!r} in the module")
    return problems


def _is_static(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _class_problems(name: str, node: ast.ClassDef, cls: type) -> list[str]:
    problems = []
    stub_bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
    native_bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if stub_bases != native_bases:
        problems.append(f"{name}: bases {stub_bases} in the stub, {native_bases} in the module")
    if issubclass(cls, BaseException):
        return problems  # their attributes (rank, keys) are set on each instance raised
    members = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    init = members.pop("__init__", None)
    if init is not None:
        problems += _agree(f"{name}()", _stub_params(init, True), _native_params(cls, False))
    elif inspect.signature(cls).parameters:
        problems.append(f"{name}: the module's constructor takes parameters the stub does not declare")
    native = {n for n in vars(cls) if not n.startswith("_")}
    if set(members) != native:
        problems.append(
            f"{name}: only in the stub {sorted(set(members) - native)}, only in the module {sorted(native - set(members))}"
        )
    for m, fn in members.items():
        if m not in native:
            continue
        attr = vars(cls)[m]
        if _is_property(fn):
            if not inspect.isgetsetdescriptor(attr) and not isinstance(attr, property):
                problems.append(f"{name}.{m}: a property in the stub, a {type(attr).__name__} in the module")
            continue
        static = _is_static(fn)
        if static != isinstance(attr, staticmethod):
            problems.append(f"{name}.{m}: static on one side only")
        problems += _agree(f"{name}.{m}", _stub_params(fn, not static), _native_params(getattr(cls, m), not static))
    return problems


def test_the_stub_declares_exactly_the_native_module():
    stub = _stub()
    native = {n for n in dir(_dckpt) if not n.startswith("_")}
    assert set(stub) == native, (
        f"only in {STUB.name}: {sorted(set(stub) - native)}; only in dckpt._dckpt: {sorted(native - set(stub))}"
    )
    problems = []
    for name, node in stub.items():
        obj = getattr(_dckpt, name)
        if isinstance(node, ast.ClassDef):
            if not isinstance(obj, type):
                problems.append(f"{name}: a class in the stub, a {type(obj).__name__} in the module")
                continue
            problems += _class_problems(name, node, obj)
        else:
            if isinstance(obj, type) or not callable(obj):
                problems.append(f"{name}: a function in the stub, a {type(obj).__name__} in the module")
                continue
            problems += _agree(name, _stub_params(node, False), _native_params(obj, False))
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_drifted_stub():
    # The comparison itself: a parameter renamed, one made keyword-only, a default changed.
    src = "def f(a, b=1, *, c=None): ...\ndef g(a, c=2): ...\ndef h(a, *, b=1): ...\n"
    fns = {n.name: n for n in ast.parse(src).body}

    def native(a, b=1, *, c=None):
        pass

    assert _agree("f", _stub_params(fns["f"], False), _native_params(native, False)) == []
    assert _agree("g", _stub_params(fns["g"], False), _native_params(native, False))
    assert _agree("h", _stub_params(fns["h"], False), _native_params(native, False))
