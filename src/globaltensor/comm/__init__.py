"""Worlds: simulated ranks in one process or one rank per process, behind one collective interface."""
from .current import get_world, rank, set_timeout, set_world, simulate, world_size
from .errors import CollectiveError, ConsistencyError, collective_call
from .stats import CommStats, comm_stats
from .world import Transfer, World

__all__ = ["World", "Transfer", "get_world", "set_world", "simulate", "rank", "world_size", "comm_stats", "CommStats",
           "set_timeout", "CollectiveError", "ConsistencyError", "collective_call"]
