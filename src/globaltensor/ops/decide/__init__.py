"""Deciding how a call of an op runs, in three stages, each a function of its own module:
``route`` (route.py: which path, from the op and its record), ``candidates`` (candidates.py: the
nd-signatures its rule admits) and ``choose`` (cost.py: the cheapest). Their result is a
:class:`Decision` (decision.py), data the executor runs; list ops are planned in lists.py."""
from .candidates import Problem, candidates, in_kinds
from .cost import choose, cost
from .decision import Decision, on_pieces, through_twin
from .lists import decide_list, list_kind
from .route import Route, route

__all__ = ["Route", "route", "Problem", "candidates", "in_kinds", "choose", "cost",
           "Decision", "on_pieces", "through_twin", "decide_list", "list_kind"]
