"""Every public name has a docstring and an entry in docs/api.md, and every call docs/api.md shows
exists with the parameters it shows (names, order, kinds, literal defaults).

Public names: ``gt.__all__``, ``gt.sbp.__all__``, ``gt.nn.__all__``, and the public methods and
properties of the classes a user holds (global tensors, placements, SBP values, boxing plans,
compiled functions, the ZeRO optimizer, the comm_stats record). A name counts as documented in
docs/api.md when it appears there in backticks, qualified as the page writes it
(``gt.randn``, ``gt.sbp.split``, ``gt.nn.megatron_plan``, ``GlobalTensor.full_tensor``)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import globaltensor as gt
import globaltensor.nn as gnn

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MODULES = {"gt": gt, "gt.sbp": gt.sbp, "gt.nn": gnn}
CLASSES = [gt.GlobalTensor, gt.Placement, gt.sbp.SbpValue, gt.Plan, gt.Step, gt.CompiledFunction,
           gnn.ZeroOptimizer]


def _module_names() -> list:
    return [(f"{prefix}.{name}", getattr(mod, name)) for prefix, mod in MODULES.items() for name in mod.__all__]


def _member_names() -> list:
    """Public methods and properties each class defines itself (not torch.Tensor's or Optimizer's)."""
    out = []
    for cls in CLASSES:
        for name, value in vars(cls).items():
            if name.startswith("_") or not (inspect.isfunction(value) or isinstance(value, (property, classmethod,
                                                                                            staticmethod))):
                continue
            out.append((f"{cls.__name__}.{name}", value))
    return out


def _docstring(value):
    """The object's own docstring: a class's is not inherited; data (an SBP instance, a plan dict) is
    documented by docs/api.md alone."""
    if isinstance(value, (classmethod, staticmethod)):
        value = value.__func__
    if inspect.isclass(value):                         # not a dataclass's generated "Name(field: type, ...)"
        doc = value.__doc__ or ""
        return None if doc.startswith(f"{value.__name__}(") else doc
    if inspect.isfunction(value) or inspect.ismodule(value) or isinstance(value, property):
        return value.__doc__
    if callable(value) and hasattr(value, "__wrapped__"):          # functools.lru_cache
        return value.__wrapped__.__doc__
    return "data"


PUBLIC = _module_names() + _member_names()


def test_the_lists_are_not_empty():
    assert len(_module_names()) > 60 and len(_member_names()) > 30


@pytest.mark.parametrize("name,value", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_public_name_has_a_docstring(name, value):
    doc = _docstring(value)
    assert doc and doc.strip(), f"{name} has no docstring"


def test_every_public_name_is_in_the_api_reference():
    text = API.read_text()
    documented = set(re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", text))
    missing = [name for name, _ in PUBLIC if name not in documented]
    assert not missing, f"docs/api.md does not document: {missing}"


# -- the other way: what docs/api.md says exists, with the parameters it says ------------------------------

ROW = re.compile(r"^\| `([A-Za-z_][\w.]*)\(([^`]*)\)`", re.M)
ROOTS = {"gt": gt, "gt.sbp": gt.sbp, "gt.nn": gnn}


def _resolve(name: str):
    """The object a documented name means: ``gt.nn.llama_plan``, ``GlobalTensor.full_tensor``,
    ``gt.local_map.rank`` (an attribute of a public function); None where nothing has that name."""
    for prefix in sorted(ROOTS, key=len, reverse=True):
        if name.startswith(prefix + "."):
            obj = ROOTS[prefix]
            rest = name[len(prefix) + 1:]
            break
    else:
        owner, _, rest = name.partition(".")
        obj = next((c for c in CLASSES if c.__name__ == owner), None)
        if obj is None:
            return None
    for part in rest.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _documented_params(text: str) -> list:
    """``[(name, kind, has_default, default text)]`` of a documented parameter list; kind is
    ``"positional"`` (before a bare ``*``), ``"keyword"``, ``"*"`` or ``"**"``."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{" and 1 or (ch in ")]}" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    out, keyword = [], False
    for p in (p for p in parts if p):
        if p == "*":
            keyword = True
            continue
        if p.startswith("**"):
            out.append((p[2:], "**", False, None))
            continue
        if p.startswith("*"):
            out.append((p[1:], "*", False, None))
            keyword = True
            continue
        name, eq, default = p.partition("=")
        out.append((name.strip(), "keyword" if keyword else "positional", bool(eq), default.strip()))
    return out


_KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
          inspect.Parameter.KEYWORD_ONLY: "keyword", inspect.Parameter.VAR_POSITIONAL: "*",
          inspect.Parameter.VAR_KEYWORD: "**"}


def _actual_params(obj) -> list:
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    return [(p.name, _KINDS[p.kind], p.default is not inspect.Parameter.empty, p.default) for p in params]


def _literal(text: str):
    """A documented default as a Python value, or a marker where it is prose (``25 MB``, ``[...]``)."""
    import ast
    if "..." in text:
        return _PROSE
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _PROSE


_PROSE = object()
DOCUMENTED = ROW.findall(API.read_text())


def test_the_documented_calls_are_many():
    assert len(DOCUMENTED) > 90


@pytest.mark.parametrize("name,params", DOCUMENTED, ids=[n for n, _ in DOCUMENTED])
def test_a_documented_call_exists_with_the_parameters_it_shows(name, params):
    """Each ``name(params)`` row of docs/api.md names something the package has, with the same
    parameters in the same order and kinds (positional, keyword-only after ``*``, ``*args``,
    ``**kwargs``), defaults where the signature has them, and a default that reads as a Python value
    (``0``, ``None``, ``"cpu"``) equal to the signature's."""
    obj = _resolve(name)
    assert obj is not None, f"docs/api.md documents {name}, which the package does not have"
    documented, actual = _documented_params(params), _actual_params(obj)
    assert [(n, k, d) for n, k, d, _ in documented] == [(n, k, d) for n, k, d, _ in actual], \
        f"{name}: docs/api.md shows ({params}), the package has {inspect.signature(obj)}"
    for (pname, _, has, text), (_, _, _, value) in zip(documented, actual):
        shown = _literal(text) if has else _PROSE
        if shown is not _PROSE:
            assert shown == value, f"{name}: docs/api.md gives {pname}={text}, the package {value!r}"


def test_every_documented_module_name_is_public():
    """Every ``gt.x`` / ``gt.sbp.x`` / ``gt.nn.x`` docs/api.md writes in backticks is in its module's
    ``__all__`` (or an attribute of such a name, ``gt.local_map.rank``)."""
    text = API.read_text()
    names = set(re.findall(r"`(gt(?:\.sbp|\.nn)?\.[A-Za-z_]\w*)", text))
    public = {f"{prefix}.{n}" for prefix, mod in MODULES.items() for n in mod.__all__} | set(MODULES)
    unknown = sorted(names - public)
    assert not unknown, f"docs/api.md names what no __all__ exports: {unknown}"
