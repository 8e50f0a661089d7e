"""``gt.nn.auto_plan``: candidate roles per placement axis (candidates.py), each costed by a meta run
through the dispatcher (cost.py: its collectives, and each rank's kernels tallied by compute.py),
its step predicted on a device (predict.py; devices.py's table, or this machine as
``gt.calibrate()`` measured it: calibration.py, kernel_timing.py), the fastest that fits kept
(plan.py) and explained (explain.py). At scale, ``gt.nn.plan_at_scale`` costs a transformer's
layouts from its shape (transformer_shape.py) on one representative rank per role
(scale_model.py) over every degree (scale_search.py)."""
from .calibration import calibrate
from .plan import AutoPlan, auto_plan

__all__ = ["AutoPlan", "auto_plan", "calibrate"]
