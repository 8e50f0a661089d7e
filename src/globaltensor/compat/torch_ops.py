"""The ``aten`` and ``prims`` op namespaces, tolerant of ops this torch lacks.

torch adds and removes aten ops between releases (2.14 has no ``aten.cholesky``); naming one at
import time through ``torch.ops.aten`` raises ``AttributeError`` and takes the whole library down.
Every module of the package names ops through :data:`aten` / :data:`prims` here instead: an op
this torch has is torch's own ``OpOverloadPacket`` / ``OpOverload``; one it lacks is a
:class:`MissingOp`, which equals no real op, has no overloads, and raises only when called.
``register_rule`` skips missing ops, so a rule table may name ops of every supported release.
"""
from __future__ import annotations

import torch


class MissingOp:
    """An op (packet or overload) this torch does not have: ``aten.cholesky``, ``aten.cholesky.default``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr: str) -> "MissingOp":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingOp(f"{self.name}.{attr}")

    def overloads(self) -> list:
        return []

    @property
    def tags(self) -> tuple:
        return ()

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name} does not exist in torch {torch.__version__}")

    def __eq__(self, other) -> bool:
        return isinstance(other, MissingOp) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("MissingOp", self.name))

    def __repr__(self) -> str:
        return f"<missing op {self.name} (torch {torch.__version__})>"


class _Namespace:
    """``torch.ops.<name>``, giving a :class:`MissingOp` for an op torch lacks."""

    def __init__(self, name: str):
        self._name = name
        self._ns = getattr(torch.ops, name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:
            return getattr(self._ns, attr)
        except AttributeError:
            return MissingOp(f"{self._name}.{attr}")


def exists(op) -> bool:
    """Whether ``op`` is an op of this torch (not a :class:`MissingOp`)."""
    return not isinstance(op, MissingOp)


aten = _Namespace("aten")
prims = _Namespace("prims")
