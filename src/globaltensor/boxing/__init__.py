"""Boxing: plan (pure, cached) and execute the conversion of a global tensor between layouts."""
from .executor import execute
from .layout import Layout
from .plan import Plan, Step
from .planner import plan_boxing

__all__ = ["Layout", "Plan", "Step", "plan_boxing", "execute"]
