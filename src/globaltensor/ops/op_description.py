"""The consistency check before an op (gt.set_check): the op, its global inputs' layouts and pieces,
its plain tensors and scalars, described for observe/consistency.py to compare across ranks."""
from __future__ import annotations

import torch

from ..comm import get_world
from ..observe.consistency import View, confirm, describe_global, describe_plain, describe_value
from ..tensor import GlobalTensor
from .schema.args import SCALARS
from .schema.op_record import record



def _describe(views, label: str, v, written: bool = False) -> None:
    if type(v) is GlobalTensor:
        describe_global(views, label, v._layout, v._pieces, values=not written)
    elif isinstance(v, torch.Tensor):
        describe_plain(views, label, v)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _describe(views, f"{label}[{i}]", x, written)
    elif isinstance(v, SCALARS):
        describe_value(views, label, v)


def confirm_op(func, args, kwargs) -> None:
    """Every rank is about to run ``func`` on the same layouts, plain tensors and scalars."""
    world = get_world()
    views = {r: View() for r in world.local_ranks}
    names = record(func).names
    # an argument the op writes may be a buffer it only fills (bernoulli_ on empty_like): its values
    # are not compared here, the next op that reads it compares them
    written = {a.name for a in record(func).written}
    for i, v in enumerate(args):
        name = names[i] if i < len(names) else str(i)
        _describe(views, f"argument {name}", v, name in written)
    for k, v in (kwargs or {}).items():
        _describe(views, f"argument {k}", v, k in written)
    confirm(f"op {func}", views, world)
