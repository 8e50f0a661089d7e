"""A training step's time and memory at scale, from a transformer's shape and a layout of degrees.

Where ``auto_plan`` runs the step once per candidate on a simulated world of the placement's size,
this model costs a layout of thousands of GPUs on one representative rank per role -- a rank of
each pipeline stage (the first holds the most micro-batches' activations, the last also computes
the head) -- with the world's size a parameter. Megatron-LM's layout is assumed:
tensor parallelism within a node with sequence parallelism (the activations between blocks split
over the tensor ranks), context parallelism as ring attention, experts over ``ep`` of the data
ranks, 1F1B pipelining (interleaved over ``virtual`` chunks a stage) or this library's zero-bubble
schedules (``schedule="zero_bubble"``: ZB-H1; ``"zbv"``: ZB-V), mixed precision (bf16
weights, activations and gradient reductions; float32 gradients, master weights and Adam's
moments), the optimizer state split over the data and context ranks (``zero=1``: Megatron's
distributed optimizer) or, with ``zero=3``, the weights and gradients too (FSDP).

Per micro-batch and block, on a rank (``tok = micro_batch · seq / cp`` tokens):

- matmuls: the block's projections over ``tok`` tokens, divided by ``tp``; attention over the whole
  sequence (causal: half its blocks done); an MoE block's router and ``top_k`` experts a token
  (routing even); the backward twice the forward, full recomputation one forward more;
- memory-bound kernels: norms, residuals, rotary and the MLP's activation read and write the hidden
  state about 8 times and the MLP's width 3 times a token (``MEMORY_PASSES``), divided by ``tp``;
- tensor parallelism: 2 all-gathers and 2 reduce-scatters of the hidden state forward and again
  backward, within the node, hidden under the block's matmuls where the device overlaps;
- context parallelism: the ring's key/value blocks, hidden under attention;
- expert parallelism: 2 all-to-alls of the routed tokens forward and 2 backward;
- FSDP: each block's weights gathered forward and backward and its gradients reduce-scattered,
  every micro-batch, hidden under the block's compute.

A micro-batch's time is its slowest stage's: its blocks' sum and, on the stage with the head (the
last; under zbv the first, which runs the last chunk), the head's (:func:`stage_layers`); the step
is ``m`` of them plus the bubble -- 1F1B's ``(pp - 1) / virtual``; a zero-bubble schedule's as
globaltensor/schedules.py's simulation of its order gives it at unit durations (forward, input
gradient and weight gradient alike: ZB-H1 ``(pp - 1) / 3``, zbv less) -- the sends between
stages, the data-parallel reduce-scatter of the gradients and all-gather of the weights -- hidden
under the last micro-batch's backward and the first one's forward where the device overlaps -- and
the optimizer's update of the rank's shard.

Memory, on the first rank of each stage: the weights, gradients and optimizer state (the embedding's
on the first stage, the head's on the head's), FSDP's gathered block and head, the blocks' kept
activations for the micro-batches the schedule holds there (:func:`activations_per_block`,
:func:`held_micro_batches`), and the larger of two peaks that never meet -- a
block's backward (:func:`block_backward_bytes`) and, on the stage with the head, the loss's
(:func:`loss_bytes`, with the allocator's block of the bf16 logits: :func:`cached_logits_bytes`),
and what the software running the step holds beyond the layout's tensors (:class:`~.runners.Runner`:
DTensor's loss, torch.distributed.pipelining's buffers and its own cut for torchtitan's runs:
:data:`~.runners.TORCHTITAN`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ... import schedules
from ..pipeline_cut import CUTS, balanced, even
from .devices import Device
from .predict import Prediction
from .runners import LOSS_LOGITS_COPIES, Runner
from .transformer_shape import TransformerShape

MEMORY_PASSES = (8, 3)           # reads and writes of (the hidden state, the MLP's width) a token and block
GRAD_BYTES = 4                   # float32 gradients kept
REDUCE_BYTES = 2                 # reduced in bf16 (Megatron-core's default: grad_reduce_in_fp32 off)
MASTER_BYTES = 12                # float32 master weights and Adam's two moments, per parameter
RECOMPUTE = ("none", "selective", "full")
#: the pipeline schedules a layout may take: 1F1B (interleaved with ``virtual`` > 1) and the zero-bubble ones
SCHEDULES = ("1f1b", "zero_bubble", "zbv")


@dataclass(frozen=True)
class ScaleLayout:
    """Degrees of a layout: ``dp`` x ``tp`` x ``pp`` x ``cp`` ranks (``ep`` of the data ranks share
    the experts), ``micro_batch`` sequences a micro-batch, ``virtual`` chunks a pipeline stage,
    ``recompute`` ("none"; "selective": torchtitan's op-level policy, every other matmul's output and
    attention's kept, the rest recomputed; "full": every block's activations recomputed in its
    backward),
    ``zero`` (1: the optimizer state split over the data and context ranks; 3: weights and
    gradients too), the pipeline's ``schedule`` (:data:`SCHEDULES`; the zero-bubble ones with
    ``virtual`` 1 -- zbv's two halves a stage are its own) and its ``cut`` (:func:`stage_layers`:
    ``"even"``, or ``"params"``, as ``gt.nn.pipeline_stages(..., cut="params")`` cuts, with
    ``virtual`` 1 and not zbv)."""
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    virtual: int = 1
    recompute: str = "none"
    zero: int = 1
    schedule: str = "1f1b"
    cut: str = "even"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def gathers_per_use(self) -> bool:
        """Whether the weights stay sharded between uses, gathered for each block's forward and
        backward: FSDP outside a pipeline. Within one (torchtitan's reshard_after_forward=False) a
        stage's weights are gathered once a step and kept, and its gradients whole to the last
        micro-batch, as with ZeRO-1."""
        return self.zero == 3 and self.pp == 1

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def problem(self, shape: TransformerShape, gpus: int, global_batch: int, per_node: int) -> Optional[str]:
        """Why the layout cannot run ``shape`` on ``gpus`` at ``global_batch`` sequences a step, or None."""
        if self.gpus != gpus:
            return f"dp x tp x pp x cp = {self.gpus}, not {gpus}"
        if self.tp > per_node or shape.heads % self.tp:
            return f"tp={self.tp} is not within a node of {per_node} or does not divide {shape.heads} heads"
        if self.pp * self.virtual > shape.layers or self.virtual > 1 and self.pp == 1:
            return f"pp={self.pp} x virtual={self.virtual} chunks for {shape.layers} layers"
        if self.schedule not in SCHEDULES or self.schedule != "1f1b" and (self.pp == 1 or self.virtual > 1):
            return (f"schedule={self.schedule!r} (expected one of {SCHEDULES}; the zero-bubble ones over 2 or more "
                    f"stages, virtual=1) with pp={self.pp}, virtual={self.virtual}")
        if self.cut not in CUTS or self.cut != "even" and (self.pp == 1 or self.virtual > 1 or self.schedule == "zbv"):
            return (f"cut={self.cut!r} (expected one of {CUTS}; 'params' over 2 or more stages, virtual=1, not zbv) "
                    f"with pp={self.pp}, virtual={self.virtual}, schedule={self.schedule!r}")
        if self.schedule == "zbv" and 2 * self.pp > shape.layers:
            return f"zbv cuts {shape.layers} layers into 2 x pp={self.pp} halves"
        if self.cp > 1 and shape.seq % (2 * self.cp):
            return f"cp={self.cp} does not split {shape.seq} positions into balanced halves"
        if self.ep > 1 and (not shape.experts or shape.experts % self.ep or (self.dp * self.cp) % self.ep):
            return f"ep={self.ep} does not divide the experts and the data ranks"
        if global_batch % (self.dp * self.micro_batch):
            return f"{global_batch} sequences do not split into micro-batches of {self.micro_batch} over dp={self.dp}"
        if self.pp > 1 and self.micro_batches(global_batch) < self.pp:
            return f"{self.micro_batches(global_batch)} micro-batches cannot fill {self.pp} stages"
        if self.recompute not in RECOMPUTE or self.zero not in (1, 3):
            return f"recompute={self.recompute!r} (expected one of {RECOMPUTE}), zero={self.zero} (expected 1 or 3)"
        return None

    def text(self) -> str:
        return (f"dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp}" + (f" (ep {self.ep})" if self.ep > 1 else "")
                + f", micro-batch {self.micro_batch}" + (f", {self.virtual} chunks a stage" if self.virtual > 1 else "")
                + (f", {self.recompute} recompute" if self.recompute != "none" else "") + (", FSDP" if self.zero == 3 else "")
                + (f", {self.schedule}" if self.schedule != "1f1b" else "")
                + (f", {self.cut} cut" if self.cut != "even" else ""))


class _Costs:
    """Seconds by kind on a rank, on ``device``."""

    def __init__(self, device: Device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.by_kind: Dict[str, float] = {}

    def add(self, kind: str, seconds: float) -> float:
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + seconds
        return seconds

    def matmuls(self, flops: float, kernels: int) -> float:
        return self.add("matmul", kernels * self.device.matmul_latency + flops / self.device.matmul_rate(self.dtype))

    def attention(self, flops: float, kernels: int) -> float:
        d = self.device
        rate = d.matmul_rate(self.dtype) * d.attention_fraction
        return self.add("attention", kernels * d.matmul_latency + flops / rate)

    def memory(self, nbytes: float, kernels: int) -> float:
        return self.add("memory", kernels * self.device.op_latency + nbytes / self.device.memory_bandwidth)

    def collective(self, whole: float, ranks: int, inside_node: bool, count: int = 1) -> float:
        """``count`` ring collectives over ``ranks`` of a ``whole``-byte tensor: each rank sends
        ``(ranks - 1) / ranks`` of it."""
        if ranks <= 1 or count == 0:
            return 0.0
        link = self.device.intra_node if inside_node else self.device.inter_node
        return count * (link.latency + whole * (ranks - 1) / ranks / link.bandwidth)

    def busy(self) -> float:
        """Compute and the communication that shows."""
        return sum(v for k, v in self.by_kind.items() if k != "hidden communication")


def _block(shape: TransformerShape, lay: ScaleLayout, device: Device, moe: bool) -> _Costs:
    """One block's forward and backward for one micro-batch on one rank."""
    c = _Costs(device, shape.dtype)
    h, t, item = shape.hidden, lay.tp, shape.dtype.itemsize
    tok = _tokens(shape, lay)
    kv = shape.kv_heads * shape.head_dim
    matrices = 3 if shape.gated else 2
    projections = 2 * tok * (h * (h + 2 * kv) + h * h) / t
    if moe:
        width = (shape.top_k + shape.shared_experts) * shape.expert_ffn
        mlp = 2 * tok * matrices * h * width / t + 2 * tok * h * shape.experts
        gemms = 4 + 1 + matrices * (1 + shape.shared_experts)
    else:
        width = shape.ffn
        mlp = 2 * tok * matrices * h * width / t
        gemms = 4 + matrices
    full = 1 if lay.recompute == "full" else 0
    recomputed = projections + mlp if full else 0.0
    if lay.recompute == "selective":
        recomputed = sum(2 * tok * out * inp / t for i, (out, inp) in enumerate(_matmuls(shape, width)) if i % 2)
    # forward, backward (two forwards' worth), and what the backward recomputes
    matmul = c.matmuls(3 * (projections + mlp) + recomputed, (3 + full) * gemms)
    attention = c.attention((3 + full) * 4 * tok * shape.seq * h / t / 2, (3 + full) * lay.cp)
    hidden_passes, width_passes = MEMORY_PASSES
    passes = 3 + (lay.recompute != "none")
    memory = c.memory(passes * tok * (hidden_passes * h + width_passes * width) * 2 * item / t, passes * 12)
    tp = c.collective(tok * h * item, t, True, 8)
    ring = c.collective(2 * tok * kv * item / t * lay.cp, lay.cp, t * lay.cp <= device.per_node, 3)
    experts = 0.0
    if moe and lay.ep > 1:
        experts = c.collective(tok * shape.top_k * h * item, lay.ep, t * lay.cp * lay.ep <= device.per_node, 4)
    fsdp = 0.0
    if lay.gathers_per_use:
        data = lay.dp * lay.cp
        fsdp = c.collective(shape.layer_params(moe) / t * item, data, t * data <= device.per_node, 3)
    compute = matmul + attention + memory
    shown = experts + (max(0.0, tp - matmul) + max(0.0, ring - attention) + max(0.0, fsdp - compute)
                       if device.overlaps else tp + ring + fsdp)
    c.add("communication", shown)
    c.add("hidden communication", tp + ring + fsdp + experts - shown)
    return c


def _matmuls(shape: TransformerShape, width: int) -> list:
    """A block's projections in the order its forward runs them, as (output, input) features: the
    query, key, value and output projections, then the MLP's (gated: gate and up, then down)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    mlp = [(width, h)] * (3 if shape.gated else 2)
    mlp[-1] = (h, width)
    return [(h, h), (kv, h), (kv, h), (h, h), *mlp]


def _head(shape: TransformerShape, lay: ScaleLayout, device: Device) -> _Costs:
    """The head's matmul (vocabulary-parallel over the tensor ranks) and the loss, forward and backward."""
    c = _Costs(device, shape.dtype)
    tok = _tokens(shape, lay)
    c.matmuls(3 * 2 * tok * shape.hidden * shape.vocab / lay.tp, 3)
    c.memory(3 * tok * shape.vocab / lay.tp * 4 * 2, 6)
    return c


def _rank_params(shape: TransformerShape, lay: ScaleLayout, stage_layers: int, moe_fraction: float,
                 vocabularies: int = 1) -> float:
    """The weights a rank of a stage holds (before ZeRO-3's split): its blocks over the tensor ranks
    (the experts over the expert ranks too), and ``vocabularies`` of the embedding and the head."""
    dense = shape.layer_params(False) * stage_layers * (1 - moe_fraction)
    moe = 0.0
    if moe_fraction:
        expert_weights = shape.experts * shape.mlp_params(shape.expert_ffn)
        moe = (shape.layer_params(True) - expert_weights + expert_weights / lay.ep) * stage_layers * moe_fraction
    return (dense + moe) / lay.tp + vocabularies * shape.vocab * shape.hidden / lay.tp


#: a zero-bubble schedule's order repeats every ``2 pp`` micro-batches from ``4 pp`` on (its steady state,
#: between the warm-up and the drain), so its bubble is simulated over ``4 pp + (m - 4 pp) mod 2 pp`` of
#: them: the whole run's bubble, at a cost that does not grow with ``m`` (checked against the whole run
#: at 2-16 stages up to 12 pp micro-batches; tests/nn/test_plan_at_scale.py)
STEADY_FROM, PERIOD = 4, 2


def bubble_steps(lay: ScaleLayout, m: int) -> float:
    """The pipeline's bubble in micro-batches of a stage's work: 1F1B's ``(pp - 1) / virtual``, a
    zero-bubble schedule's from the simulation of its order at unit durations (schedules.py)."""
    if lay.pp == 1:
        return 0.0
    if lay.schedule == "1f1b":
        return (lay.pp - 1) / lay.virtual
    steady = STEADY_FROM * lay.pp
    return _simulated_bubble_steps(lay.schedule, lay.pp, m if m <= steady else steady + (m - steady) % (PERIOD * lay.pp))


@functools.lru_cache(maxsize=None)
def _simulated_bubble_steps(schedule: str, p: int, m: int) -> float:
    idle = schedules.bubble(schedule, p, m)
    return idle / (1.0 - idle) * m


def _kept_per_token(shape: TransformerShape, recompute: str) -> int:
    """Elements a block keeps for its backward per token, before the tensor ranks' split. Kept all
    ("none"), as torch's eager autograd keeps them for torchtitan's block (tests/nn/test_scale_memory.py
    follows every storage of its step): the input and output of each norm (a fused norm keeps its
    input and a number a row), the query, key and value, attention's output (flash attention keeps
    no score matrix), the residual between attention and MLP, and the MLP's wide tensors -- a gated
    MLP's gate and up projections, the gate's activation and their product (4), a plain MLP's first
    projection and its activation (2). torchtitan's selective policy keeps the input, the outputs of
    the first, third, ... matmul (the query, the value, the MLP's gate, its down projection) and
    attention's output; full recomputation the input alone."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    width = _mlp_width(shape)
    if recompute == "full":
        return h
    if recompute == "selective":
        return 2 * h + sum(out for i, (out, _) in enumerate(_matmuls(shape, width)) if i % 2 == 0)
    return 6 * h + 2 * kv + (4 if shape.gated else 2) * width


def _mlp_width(shape: TransformerShape) -> int:
    """The MLP's width a token runs through: an MoE block's ``top_k`` routed and its shared experts'."""
    return shape.ffn if not shape.experts else (shape.top_k + shape.shared_experts) * shape.expert_ffn


def _tokens(shape: TransformerShape, lay: ScaleLayout) -> int:
    """A micro-batch's tokens on a rank: its sequences, split over the context ranks."""
    return lay.micro_batch * shape.seq // lay.cp


def activations_per_block(shape: TransformerShape, lay: ScaleLayout) -> float:
    """Bytes one block keeps for its backward per micro-batch on a rank (:func:`_kept_per_token`),
    split over the tensor ranks (sequence parallelism, as Megatron-LM keeps them: a matmul's input
    gathered over the tensor ranks is kept as its shard and gathered again for the backward) and
    the context ranks."""
    return _tokens(shape, lay) * _kept_per_token(shape, lay.recompute) * shape.dtype.itemsize / lay.tp


def block_backward_bytes(shape: TransformerShape, lay: ScaleLayout) -> float:
    """Bytes a block's backward holds beyond what the blocks keep, at its peak (the MLP's backward):
    what it recomputes of its forward (all it did not keep), the gradients of two of the MLP's wide
    tensors and of the block's output, and with tensor parallelism the MLP's input gathered whole."""
    h = shape.hidden
    sharded = (_kept_per_token(shape, "none") - _kept_per_token(shape, lay.recompute)
               + 2 * _mlp_width(shape) + h)
    return _tokens(shape, lay) * shape.dtype.itemsize * (sharded / lay.tp + (h if lay.tp > 1 else 0))


def loss_bytes(shape: TransformerShape, lay: ScaleLayout, copies: int = LOSS_LOGITS_COPIES) -> float:
    """Bytes the loss's backward holds at its peak, beyond what the blocks keep: ``copies`` float32
    logits (the vocabulary split over the tensor ranks), the head's input -- gathered whole over the
    tensor ranks, as DTensor and this library keep it -- and the final norm's (its shard)."""
    logits = shape.vocab / lay.tp * 4 * copies
    return _tokens(shape, lay) * (logits + shape.dtype.itemsize * shape.hidden * (1 + 1 / lay.tp))


def cached_logits_bytes(shape: TransformerShape, lay: ScaleLayout) -> float:
    """Bytes the device's caching allocator holds at the loss's peak beyond the tensors alive: the
    block of the bf16 logits, freed before the backward (torchtitan's ``del pred``; the float32 cast
    holds no reference) and too small for any of the float32 logits that follow, stays reserved --
    a large tensor's block is a segment of its own, merged with no other. Published peaks are the
    allocator's reserved memory (torchtitan logs ``max_reserved_gib``)."""
    return _tokens(shape, lay) * shape.vocab / lay.tp * shape.dtype.itemsize


def held_micro_batches(lay: ScaleLayout, m: int, stage: int) -> float:
    """Micro-batches' worth of its blocks' activations ``stage`` holds at once, at most ``m``. 1F1B:
    its warm-up's, ``pp - stage``; interleaved, Megatron's warm-up of ``2 (pp - stage - 1) +
    (virtual - 1) pp`` chunks and one, over the stage's ``virtual`` chunks. The zero-bubble schedules:
    ``pp`` on every stage (ZB-H1's later stages hold some only for their weight gradients, which read
    the linears' inputs and output gradients: counted whole)."""
    if lay.schedule != "1f1b":
        return min(m, lay.pp)
    if lay.virtual == 1:
        return min(m, lay.pp - stage)
    return min(m, (2 * (lay.pp - stage - 1) + (lay.virtual - 1) * lay.pp + 1) / lay.virtual)


def stage_chunks(lay: ScaleLayout, stage: int) -> Tuple[Tuple[int, ...], int]:
    """The chunks of the model ``stage`` runs, by their place in the model, and the count of chunks:
    ``stage + k pp`` for each of its ``virtual`` chunks (1F1B, interleaved, ZB-H1), or ``stage`` and
    ``2 pp - 1 - stage`` (zbv)."""
    if lay.schedule == "zbv":
        return (stage, 2 * lay.pp - 1 - stage), 2 * lay.pp
    return tuple(stage + k * lay.pp for k in range(lay.virtual)), lay.pp * lay.virtual


def pipeline_buffer_bytes(lay: ScaleLayout, stage: int, m: int, held: float, boundary: float,
                          output: float) -> float:
    """What torch.distributed.pipelining holds on ``stage`` beyond the model's tensors, for ``m``
    micro-batches of which each chunk holds ``held`` at once, ``boundary`` bytes a message and
    ``output`` bytes a micro-batch's model output (the logits). On each chunk:

    - but on the model's last: a gradient buffer for every micro-batch, made ahead and kept from step
      to step, and the outputs until their backward -- one more than ``held``, the one last sent,
      which the send keeps until the next exchange;
    - on the model's last: every micro-batch's output, kept for the step to return;
    - but on the model's first: an activation buffer for every micro-batch, less the ``held`` ones
      that are the chunk's first block's inputs, which the activations count.

    tests/multiprocess/test_pipelining_buffers.py reads them from the CPU allocator."""
    chunks, n = stage_chunks(lay, stage)
    total = 0.0
    for c in chunks:
        total += (m + min(m, held + 1)) * boundary if c < n - 1 else m * output
        if c > 0:
            total += (m - held) * boundary
    return total


def stage_layers(shape: TransformerShape, lay: ScaleLayout, runner: Runner = Runner()) -> Tuple[int, ...]:
    """The layers of each pipeline stage, its chunks' together, as ``gt.nn.pipeline_stages`` cuts the
    model (nn/pipeline_cut.py): ``"even"``, as many each as the count allows, the extra ones on the
    first chunks; ``"params"``, a layer's cost its weights, the final norm's and the head's added to
    the last chunk -- or as the runner cuts it, where it has a cut of its own. A stage holds chunks
    ``s, s + pp, ...`` (interleaved), or ``s`` and ``2 pp - 1 - s`` (zbv)."""
    if lay.cut == "params" and runner.cut is None:
        return _params_cut(shape, lay.pp)
    chunks = stage_chunks(lay, 0)[1]
    sizes = (runner.cut or even)(shape.layers, chunks)
    return tuple(sum(sizes[c] for c in stage_chunks(lay, s)[0]) for s in range(lay.pp))


@functools.lru_cache(maxsize=None)
def _params_cut(shape: TransformerShape, pp: int) -> Tuple[int, ...]:
    moe = [bool(shape.experts) and i >= shape.dense_layers for i in range(shape.layers)]
    head = shape.vocab * shape.hidden + shape.hidden
    return tuple(balanced([shape.layer_params(m) for m in moe], head, pp))


def predict_scale(shape: TransformerShape, lay: ScaleLayout, device: Device, global_batch: int,
                  runner: Runner = Runner()) -> Prediction:
    """The step of ``shape`` laid out as ``lay`` on ``lay.gpus`` of ``device`` at ``global_batch``
    sequences, as a :class:`~.predict.Prediction`: ``memory`` holds each stage's first rank;
    ``memory_parts`` the parts of the stage with the most: the state, FSDP's gathered weights, the
    kept activations, the two peaks of which a stage holds the larger (not their sum) -- a block's
    backward and the loss's backward (0 on a stage without the head) -- and with
    ``runner.pipeline_buffers`` the "pipeline buffers"; ``by_kind`` the step's seconds by kind on the
    slowest stage. ``runner``: the software (:class:`~.runners.Runner`: this library's;
    :data:`~.runners.TORCHTITAN`)."""
    m = lay.micro_batches(global_batch)
    zbv = lay.schedule == "zbv"
    counts = stage_layers(shape, lay, runner)
    moe_fraction = shape.moe_layers / shape.layers
    head = _head(shape, lay, device)
    dense, routed = _block(shape, lay, device, False), _block(shape, lay, device, True) if moe_fraction else None

    def parts_of(layers: int, with_head: bool) -> list:
        parts = [(dense, layers * (1 - moe_fraction))] + ([(head, 1)] if with_head else [])
        return parts + ([(routed, layers * moe_fraction)] if moe_fraction else [])
    def busy(parts: list) -> float:
        return sum(costs.busy() * count for costs, count in parts)
    head_stage = 0 if zbv else lay.pp - 1     # zbv's first stage runs the last chunk: the head and the loss
    # a micro-batch's time is its slowest stage's
    parts = max((parts_of(n, s == head_stage) for s, n in enumerate(counts)), key=busy)
    stage: Dict[str, float] = {}
    for costs, count in parts:
        for k, v in costs.by_kind.items():
            stage[k] = stage.get(k, 0.0) + v * count
    micro = busy(parts)
    steps = m + bubble_steps(lay, m)
    by_kind = {k: v * m for k, v in stage.items()}
    by_kind["pipeline bubble"] = (steps - m) * micro
    c = _Costs(device, shape.dtype)
    item = shape.dtype.itemsize
    boundary = _tokens(shape, lay) * shape.hidden * item / lay.tp
    chunks = len(stage_chunks(lay, 0)[0])
    by_kind["pipeline sends"] = 2 * m * chunks * c.collective(2 * boundary, 2, False) if lay.pp > 1 else 0.0
    # each stage's weights: its blocks', the embedding's on the first, the head's on the head's stage
    weights = [_rank_params(shape, lay, n, moe_fraction, (s == 0) + (s == head_stage)) for s, n in enumerate(counts)]
    params = max(weights)
    shards = lay.dp * lay.cp
    inside = lay.gpus <= device.per_node
    data = 0.0
    if not lay.gathers_per_use:               # one reduce-scatter and one all-gather a step
        grads = c.collective(params * REDUCE_BYTES, shards, inside)
        gather = c.collective(params * item, shards, inside)
        data = (max(0.0, grads - 2 * micro / 3) + max(0.0, gather - micro / 3) if device.overlaps
                else grads + gather)
        by_kind["hidden communication"] = by_kind.get("hidden communication", 0.0) + grads + gather - data
    by_kind["data-parallel communication"] = data
    by_kind["optimizer"] = c.memory(params / shards * (GRAD_BYTES + 2 * MASTER_BYTES + item), 8)
    seconds = steps * micro + by_kind["pipeline sends"] + data + by_kind["optimizer"]
    def state_of(stage_weights: float) -> float:
        held = stage_weights / shards if lay.gathers_per_use else stage_weights
        return held * (item + GRAD_BYTES) + stage_weights / shards * MASTER_BYTES
    # Gathered per use, the weights of a block and the head are gathered at once (the backward's
    # start: the head's, the last block's prefetched), and their gradients whole until their
    # reduce-scatter.
    gathered = _rank_params(shape, lay, 1, moe_fraction) * (item + GRAD_BYTES) if lay.gathers_per_use else 0.0
    per_block = activations_per_block(shape, lay)
    copies = runner.split_loss_logits if lay.tp > 1 else LOSS_LOGITS_COPIES
    logits, piped = cached_logits_bytes(shape, lay), runner.pipeline_buffers and lay.pp > 1
    # kept by torch.distributed.pipelining, every micro-batch's logits are among its buffers: none is
    # a freed block the allocator keeps
    backward, loss = block_backward_bytes(shape, lay), loss_bytes(shape, lay, copies) + (0.0 if piped else logits)
    stages = []
    for s, n in enumerate(counts):
        held = held_micro_batches(lay, m, s)
        # a stage's peak: its kept activations and the larger of a block's backward and -- on the
        # stage with the head -- the loss's (the loss's backward ends before the blocks' begin)
        parts = {"weights, gradients and optimizer state": state_of(weights[s]), "gathered weights": gathered,
                 "activations": n * per_block * held, "block backward": backward,
                 "loss backward": loss if s == head_stage else 0.0}
        if piped:
            parts["pipeline buffers"] = pipeline_buffer_bytes(lay, s, m, held, boundary, logits)
        stages.append(parts)
    peaks = [sum(parts.values()) - min(parts["block backward"], parts["loss backward"]) for parts in stages]
    memory = {s * lay.gpus // lay.pp: int(peak) for s, peak in enumerate(peaks)}
    top = stages[peaks.index(max(peaks))]
    tokens = global_batch * shape.seq
    mfu = shape.forward_flops(tokens) * 3 / (seconds * lay.gpus * device.peak_rate(shape.dtype))
    shown = by_kind.get("communication", 0.0) + by_kind["pipeline sends"] + data
    compute = sum(by_kind.get(k, 0.0) for k in ("matmul", "attention", "memory", "optimizer"))
    head_s = steps * head.busy()
    return Prediction(device.name, seconds, 0, compute, shown, by_kind.get("hidden communication", 0.0), 0.0, memory,
                      {k: int(v) for k, v in top.items()},
                      tokens / seconds, mfu, {k: v for k, v in by_kind.items() if v > 0},
                      {"blocks": steps * micro - head_s, "head": head_s, "optimizer": by_kind["optimizer"]})
