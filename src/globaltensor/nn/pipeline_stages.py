"""``pipeline_stages``: cut a model's repeated layers into pipeline stages without touching its forward.

    gt.nn.pipeline_stages(model, [stage0, stage1])          # layers 0..L/2-1 on stage0, the rest on stage1
    step = gt.compile(train_step, micro_batches=8, schedule="1f1b")

The model is laid out by ``plan`` on the first placement (``distribute_module``); then its
repeated layers -- the ``nn.ModuleList`` / ``nn.ModuleDict`` named ``layers``, by default the one
with the most children -- are cut into ``p * chunks_per_stage`` contiguous chunks (as many layers
each, or balanced by weights, or sizes given: ``cut=``, nn/pipeline_cut.py), chunk ``c``
moved to placement ``c mod p`` (each tensor keeping its SBP); with ``v_shape=True`` (two chunks per
stage, for ``schedule="zbv"``) down the placements and back up: chunk ``c`` to placement ``c`` for
``c < p``, else ``2p - 1 - c``, so the first placement holds the first chunk and the last. What
comes before the layers stays on the first stage (embeddings; modules with no parameters, such as a
rotary embedding, too); the modules with parameters after them (the final norm, the head) go with
the last chunk. A forward pre-hook on every moved module moves its global inputs to its placement:
the activation crossing to the next stage is a ``to_global`` like any other, and autograd sends its
gradient back. The model's forward is unchanged; give the loss its targets on the last chunk's
placement (the head's: ``model.lm_head.weight.placement``, the first under ``v_shape``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ..placement import Placement
from ..tensor import GlobalTensor
from .distribute import DEFAULT_BUCKET_BYTES, PlanLike, _entries, distribute_module
from .activation_layouts import is_activation_key
from .grad_buckets import GradBuckets, bucket_gradients
from .pipeline_cut import CutLike, chunk_sizes


def _refuse(why: str):
    raise ValueError(f"pipeline_stages: {why}")


def _layers(model: nn.Module, name: Optional[str]):
    if name is not None:
        try:
            container = model.get_submodule(name)
        except AttributeError:
            container = None
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            _refuse(f"layers={name!r} names no nn.ModuleList or nn.ModuleDict of {type(model).__name__} (it is "
                    f"{type(container).__name__})")
        return name, container
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    if not found:
        _refuse(f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict of layers to cut into stages")
    return max(found, key=lambda item: len(item[1]))


def _after(model: nn.Module, path: str) -> list:
    """``(name, module)`` of the modules registered after the branch that leads to ``path``, at every
    level, the innermost level's first (a final norm before the head)."""
    after = []
    module, prefix = model, ""
    for part in path.split("."):
        names = list(module._modules)
        after = [(prefix + n, module._modules[n]) for n in names[names.index(part) + 1:]
                 if module._modules[n] is not None] + after
        module, prefix = module._modules[part], prefix + part + "."
    return after


def _move(module: nn.Module, placement: Placement) -> None:
    layouts = {n: t.sbp for n, t in [*module.named_parameters(), *module.named_buffers()] if isinstance(t, GlobalTensor)}
    distribute_module(module, placement, layouts, bucket_bytes=0)

    def inputs_here(_, args, kwargs):
        def here(v):
            if isinstance(v, GlobalTensor) and v.placement != placement:
                return v.to_global(placement=placement)
            if type(v) in (tuple, list):
                return type(v)(here(x) for x in v)
            return v
        return here(args), {k: here(v) for k, v in kwargs.items()}
    module.register_forward_pre_hook(inputs_here, with_kwargs=True)


def pipeline_stages(model: nn.Module, placements: Sequence[Placement], plan: PlanLike = None, *,
                    layers: Optional[str] = None, chunks_per_stage: int = 1, v_shape: bool = False,
                    cut: CutLike = "even", bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Dict[int, List[str]]:
    """Lay ``model`` out by ``plan`` and cut its layers into pipeline stages (see the module's
    docstring); in place. Returns, per stage, the names of the modules it holds besides the first
    stage's head (embeddings): ``{stage: [names]}``."""
    placements = list(placements)
    if len(placements) < 1 or not all(isinstance(p, Placement) for p in placements):
        raise TypeError(f"pipeline_stages(placements=): expected a list of placements, got {placements!r}")
    if len({p.ndim for p in placements}) > 1:
        _refuse(f"the stages' placements must have as many axes each (one plan lays every stage out), got "
                f"{[p.ndim for p in placements]} axes")
    if not isinstance(chunks_per_stage, int) or isinstance(chunks_per_stage, bool) or chunks_per_stage < 1:
        _refuse(f"chunks_per_stage: expected an int >= 1, got {chunks_per_stage!r}")
    if v_shape and chunks_per_stage != 2:
        _refuse(f"v_shape=True goes down the stages and back up: it takes chunks_per_stage=2, got {chunks_per_stage}")
    activations = [k for k, _ in _entries(plan) if is_activation_key(k)]
    if activations:
        _refuse(f"the plan's activation entries {activations} are bound to one placement; give the stages' plans "
                f"parameter entries only")
    GradBuckets(bucket_bytes)
    name, container = _layers(model, layers)
    keys = [k for k, m in container._modules.items() if m is not None]
    layer_list = [container._modules[k] for k in keys]
    p, chunks = len(placements), len(placements) * chunks_per_stage
    if len(layer_list) < chunks:
        _refuse(f"{name} holds {len(layer_list)} layers, fewer than the {chunks} chunks of {p} stages x "
                f"{chunks_per_stage} chunks per stage")
    tail = [(n, m) for n, m in _after(model, name) if next(m.parameters(), None) is not None]
    sizes = chunk_sizes(cut, layer_list, [m for _, m in tail], chunks)
    distribute_module(model, placements[0], plan, bucket_bytes=0)
    _check_untied(model, layer_list, [m for _, m in tail])
    stages: Dict[int, List[str]] = {s: [] for s in range(p)}
    stage_of = [min(c, chunks - 1 - c) if v_shape else c % p for c in range(chunks)]
    start = 0
    for c, size in enumerate(sizes):
        end = start + size
        for i in range(start, end):
            _move(layer_list[i], placements[stage_of[c]])
            stages[stage_of[c]].append(f"{name}.{keys[i]}")
        start = end
    for n, m in tail:
        _move(m, placements[stage_of[-1]])
        stages[stage_of[-1]].append(n)
    if bucket_bytes:
        bucket_gradients(model, bucket_bytes)
    return stages


def _check_untied(model: nn.Module, layer_list: List[nn.Module], tail: List[nn.Module]) -> None:
    """A parameter a moved module shares with a module outside it (tied embeddings) would be copied
    apart by the move."""
    owners: Dict[int, set] = {}
    for mod in model.modules():
        for t in mod._parameters.values():
            if isinstance(t, torch.Tensor):
                owners.setdefault(id(t), set()).add(id(mod))
    for part in (*layer_list, *tail):
        inside = {id(m) for m in part.modules()}
        for pname, t in part.named_parameters():
            if owners.get(id(t), set()) - inside:
                _refuse(f"parameter {pname} of {type(part).__name__} is shared with a module outside it (tied "
                        f"weights), which a move to another stage would copy apart; untie it (clone) or keep the "
                        f"modules together")
