"""``gt.nn.auto_plan``: candidate roles per placement axis (candidates.py), costed by a meta run
through the dispatcher (cost.py, calibrated by ``gt.calibrate()``: calibration.py), the least
modelled time kept (plan.py) and explained (explain.py)."""
from .calibration import calibrate
from .plan import AutoPlan, auto_plan

__all__ = ["AutoPlan", "auto_plan", "calibrate"]
