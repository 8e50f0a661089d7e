"""SBP rules, one module per op family; importing this package registers them all."""
from . import matmul, pointwise, view  # noqa: F401
