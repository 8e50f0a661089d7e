"""The expected classes of the OpInfo ops that are not clean, kept in ``expected.json``.

``expected.json`` holds two maps, ``fallback`` and ``raises``, from an op's id (``name`` or
``name.variant``) to the reason it is there. An op listed nowhere is expected clean; no op
may be expected wrong. :func:`regenerate` rebuilds the file from a run's classes, keeping a
listed op's reason while it stays in its class (hand-edited reasons survive) and deriving
one for a newly listed op from what its cases showed:

    PYTHONPATH=src python tools/op_coverage.py --update-expected
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

PATH = Path(__file__).with_name("expected.json")
LISTED = ("fallback", "raises")


def load(path: Path = PATH) -> dict:
    """``{op id: (class, reason)}`` for every listed op."""
    data = json.loads(path.read_text())
    return {name: (cls, reason) for cls in LISTED for name, reason in data.get(cls, {}).items()}


def expected_class(listed: dict, name: str) -> str:
    return listed.get(name, ("clean", ""))[0]


def derived_reason(cls: str, outcomes) -> str:
    """A reason from the cases: the ops that fell back (and why), or the errors raised."""
    if cls == "fallback":
        ops = sorted({f for _, _, o in outcomes for f in o.fell_back})
        dynamic = [f for f in ops if _dynamic_shape(f)]
        why = "output shape depends on the data" if dynamic and len(dynamic) == len(ops) else "no rule"
        return f"gathered to broadcast ({why}): {', '.join(ops)}"
    errors = sorted({o.detail for _, _, o in outcomes if o.cls == "raises"})
    if any("Sparse" in e or "sparse" in e for e in errors):
        return "sparse layouts: a global tensor's pieces are strided tensors; " + errors[0]
    return "; ".join(errors)


def _dynamic_shape(name: str) -> bool:
    packet, _, overload = name.removeprefix("aten.").partition(".")
    op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
    return op is not None and torch.Tag.dynamic_output_shape in op.tags


def regenerate(classes: dict, outcomes: dict, path: Path = PATH) -> dict:
    """Write the lists for ``classes`` (``{op id: class}``) with ``outcomes`` (``{op id: cases}``)."""
    old = load(path) if path.exists() else {}
    data = {cls: {} for cls in LISTED}
    for name in sorted(classes):
        cls = classes[name]
        if cls == "wrong":
            raise ValueError(f"{name} gives a wrong answer: fix it, it cannot be listed as expected")
        if cls in LISTED:
            kept = old.get(name)
            data[cls][name] = kept[1] if kept and kept[0] == cls else derived_reason(cls, outcomes[name])
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data
