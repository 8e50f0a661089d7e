"""Every public name has a docstring and an entry in docs/api.md.

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
