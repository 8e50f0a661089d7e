"""Ops on global tensors: ``__torch_dispatch__`` as one pipeline (dispatch.py) -- the op's record
(schema/), the decision as data (decide/: route -> candidates -> cost), one executor for every
kind of decision (executor/), writes kept (writes/) -- with the SBP rules per op family (rules/),
the global factories and their sharding-invariant random numbers (factories.py, rng.py) and the
gather-to-broadcast fallback (fallback.py).

What it exports: ``register_rule`` (a rule for an op), the factories, ``decision_for`` (the
Decision a call runs) and ``Decision``; importing it installs the dispatcher and the rules."""
from . import rules as _rules  # noqa: F401  (registers the SBP rules)
from .decide import Decision
from .dispatch import decision_for
from .factories import arange, empty, full, manual_seed, ones, rand, randn, zeros
from .registry import register_rule

__all__ = ["register_rule", "decision_for", "Decision", "randn", "rand", "zeros", "ones", "full", "empty", "arange",
           "manual_seed"]
