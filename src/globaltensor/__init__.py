"""globaltensor: eager global tensors for PyTorch with an SBP type system.

    import globaltensor as gt
    gt.simulate(4)
    p = gt.placement("cpu", ranks=[0, 1, 2, 3])
    x = gt.randn(8, 5, placement=p, sbp=gt.sbp.split(0))
    y = x.to_global(sbp=gt.sbp.broadcast)      # boxing: all-gather
"""
from . import sbp
from .boxing import Plan, Step
from .comm import CollectiveError, ConsistencyError, comm_stats, get_world, rank, set_timeout, simulate, world_size
from .observe import CommProfile, comm_profile, set_log_level
from .observe.consistency import set_check
from .placement import Placement, placement
from .from_local import distribute, install_tensor_methods, to_global
from .tensor import GlobalTensor
from .ops import arange, empty, full, manual_seed, ones, rand, randn, register_rule, zeros
from .ops.explicit import ImplicitBoxingError, explicit
from .ops.dispatch import dispatch_cache_clear, dispatch_cache_info, set_dispatch_cache_size
from .ops.fallback import fallback_calls, fallback_calls_clear
from .ops.executor.lists import install_foreach_support
from .nn.optim_pieces import install_optimizer_pieces
from .nn.fed_numbers import install_fed_numbers
from .boxing_preview import boxing_plan
from .viz import render_sharding, visualize
from . import nn
from .nn.local_map import local_map
from .nn.auto import calibrate
from .actor_rt import CaptureError, CompileError, CompiledFunction, GraphError, compile
from .interop import from_dtensor, install_dcp_protocol, install_to_dtensor, to_dtensor

install_tensor_methods()
install_foreach_support()
install_optimizer_pieces()
install_fed_numbers()
install_to_dtensor()
install_dcp_protocol()

__version__ = "0.1.0"

__all__ = [
    "sbp", "placement", "Placement", "GlobalTensor", "to_global", "distribute", "local_map", "simulate", "rank", "world_size",
    "get_world", "comm_stats", "randn", "rand", "zeros", "ones", "full", "empty", "arange", "manual_seed",
    "boxing_plan", "Plan", "Step", "register_rule", "visualize", "render_sharding", "nn",
    "compile", "CompiledFunction", "CaptureError", "CompileError", "GraphError",
    "to_dtensor", "from_dtensor",
    "comm_profile", "CommProfile", "set_log_level",
    "set_timeout", "set_check", "CollectiveError", "ConsistencyError", "calibrate", "explicit", "ImplicitBoxingError",
    "dispatch_cache_info", "dispatch_cache_clear", "set_dispatch_cache_size", "fallback_calls", "fallback_calls_clear",
]
