"""The captured graph: piece-level ops and collectives, the values between them, and what a call feeds
and gets back.

Capture (capture.py) fills it; lowering (lower.py) turns it into per-rank tasks. Nothing here runs.

A *value* is one tensor the captured call saw: made by a node, or coming from outside the graph --
a piece of an argument, a plain tensor argument, a random call's key tensor (fed anew on every
call), or *state*: a tensor that existed before the call (a parameter's piece, an optimizer's
moment), which the graph reads and writes in place by reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Ref:
    """A tensor slot in a node's arguments: the value ``vid``."""
    vid: int


@dataclass(frozen=True)
class StorageRef:
    """A storage argument (``set_(storage, ...)``): the storage of the value ``vid`` on every call."""
    vid: int


@dataclass
class Value:
    vid: int
    kind: str                      # "node" | "arg" | "keys" | "number" | "state"
    rank: Optional[int] = None     # the rank whose piece this is (None: a process-level tensor)
    node: Optional[int] = None     # kind "node": the producing node and its output position
    out: int = 0
    arg: Optional[Tuple[int, Optional[int]]] = None   # kind "arg": (leaf index, rank or None for plain)
    keys: Optional[Tuple[int, int, Any]] = None       # kind "keys": (offset from the call's base, stream, device)
    number: Optional[Tuple[int, Any, Any]] = None     # kind "number": (leaf index, dtype, device) of a fed float
    tensor: Any = None             # kind "state": the tensor itself
    storage: Optional[tuple] = None
    nbytes: int = 0                # bytes of its storage, when the graph allocates it
    meta: Optional[tuple] = None   # (shape, strides, storage offset, dtype) of the tensor


@dataclass
class Node:
    index: int
    kind: str                      # "op" | "collective"
    target: Any                    # an OpOverload, or the World method's name
    args: Any                      # "op": (args, kwargs) with Refs; "collective": (flat leaves with Refs, spec)
    outs: List[int]                # value ids of the tensor outputs, in flattened order
    out_slots: Any                 # "op": None for one tensor, else the positions of the tensors in the result
    label: str                     # the global op (or boxing) this piece op belongs to
    rank: Optional[int] = None
    signature: str = ""            # the SBP signature that global op's Decision chose ("" for none)
    ranks: Tuple[int, ...] = ()    # "collective": the ranks of this process taking part
    segment: int = 0               # forward / backward alternations before this node
    backward: bool = False
    reads: Tuple[tuple, ...] = ()  # storages read (inputs) and written (mutated arguments)
    writes: Tuple[tuple, ...] = ()
    inputs: Tuple[int, ...] = ()   # the value ids it reads
    device: Any = None             # where its outputs are (a CUDA task runs on a CUDA stream)
    stream: str = "compute"        # the kind of stream it runs on: compute, copy (between devices), collective
    metas: dict = field(default_factory=dict)   # "op": input vid -> its Value's meta, as captured

    @property
    def name(self) -> str:
        op = self.target if isinstance(self.target, str) else str(self.target).replace("aten.", "")
        where = f"r{self.rank}" if self.kind == "op" else "r" + ",".join(map(str, self.ranks))
        return f"{self.index}:{op}@{where}"


@dataclass
class Output:
    """One leaf of what the function returns."""
    kind: str                      # "global" | "plain" | "const"
    layout: Any = None
    refs: Dict[int, int] = field(default_factory=dict)   # rank -> vid ("global"); {None: vid} ("plain")
    value: Any = None


@dataclass
class Captured:
    nodes: List[Node]
    values: Dict[int, Value]
    outputs: List[Output]
    out_spec: Any
    rebinds: list                  # (weakref to a GlobalTensor, rank, vid): its piece after every call
    grad_rebinds: list             # (argument leaf index, layout, {rank: vid}): the argument's .grad
    rng_consumed: int              # random counters one call reserves
    held_ranks: Tuple[int, ...]
    settings: tuple = ()           # (group, key, index): optimizer settings tasks read at each run
