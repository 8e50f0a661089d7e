"""The expected classes of the OpInfo ops that are not clean, kept in ``expected.json``.

``expected.json`` holds two maps, ``fallback`` and ``raises``, from an op's id (``name`` or
``name.variant``) to the reason it is there. An op listed nowhere is expected clean; no op
may be expected wrong. :func:`regenerate` rebuilds the file from a run's classes: a reason
derived from what the cases showed (the aten ops that fell back and why, the errors) starts
with ``auto:`` and is derived afresh each time; a hand-written reason (anything else) is kept
while the op stays in its class:

    PYTHONPATH=src python tools/op_coverage.py --update-expected
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

PATH = Path(__file__).with_name("expected.json")
#: the torch release the lists were made on: the development pin (the Makefile's TORCH). Which ops a
#: torch decomposes, and into what, changes between releases, so on another release the classes may
#: move either way; there the suite still fails on any wrong answer or unclear error.
PINNED = "2.13"
LISTED = ("fallback", "raises")


def load(path: Path = PATH) -> dict:
    """``{op id: (class, reason)}`` for every listed op."""
    data = json.loads(path.read_text())
    return {name: (cls, reason) for cls in LISTED for name, reason in data.get(cls, {}).items()}


def on_pinned_torch() -> bool:
    return torch.__version__.split("+")[0].rsplit(".", 1)[0] == PINNED


def expected_class(listed: dict, name: str) -> str:
    return listed.get(name, ("clean", ""))[0]


AUTO = "auto: "
# why an aten op goes through the fallback, where it is not simply a missing rule
WHY = {
    "aten._to_copy.default": "_to_copy with explicit layout=/device= (softmax dtype=, .to()) has no rule yet",
    "aten._local_scalar_dense.default": "reads a value as a Python number (.item()): the value is gathered",
    "prims.item.default": "reads a value as a Python number: the value is gathered",
    "aten.as_strided.default": "as_strided addresses storage, which a global tensor's pieces do not share",
    "aten.equal.default": "returns a Python bool, not a tensor",
    "aten.allclose.default": "returns a Python bool, not a tensor",
    "aten.multinomial.default": "random: draws depend on the whole tensor",
    "aten.rrelu_with_noise.default": "random noise drawn from torch's generator",
    "aten.fractional_max_pool2d.default": "random pooling regions",
    "aten.fractional_max_pool3d.default": "random pooling regions",
}


def derived_reason(cls: str, outcomes) -> str:
    """A reason from the cases: the ops that fell back (and why), or the errors raised."""
    if cls == "fallback":
        ops = sorted({f for _, _, o in outcomes for f in o.fell_back})
        whys = sorted({WHY.get(f) or ("output shape depends on the data" if _dynamic_shape(f) else "no rule")
                       for f in ops})
        return f"{AUTO}gathered to broadcast ({'; '.join(whys)}): {', '.join(ops)}"
    errors = sorted({o.detail for _, _, o in outcomes if o.cls == "raises"})
    return AUTO + "; ".join(errors)


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
            hand = kept and kept[0] == cls and not kept[1].startswith(AUTO)
            data[cls][name] = kept[1] if hand else derived_reason(cls, outcomes[name])
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data
