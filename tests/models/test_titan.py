"""torchtitan's own Llama 3 and DeepSeek-V3 (the ``torchtitan`` package's ``Llama3Model`` and
``DeepSeekV3Model``, built small by examples/titan_models.py) trained on 4 simulated ranks beside
one device, in float64. Llama 3: data, tensor (fused and separate q/k/v projections), Megatron-SP,
2x2 hybrid, torchtitan's own plan (vocabulary-parallel embedding, head and loss:
benchmarks/titan_tp.py's ``titan_plan``) and a head-tail sequence split with ring attention.
DeepSeek-V3: its MoE layers' routed experts expert parallel (tokens by all-to-all), in the routing's
sizes and padded to a capacity, and on a 2x2 placement beside tensor-parallel MLPs. Each step's loss, every gradient (in
its parameter's layout) and the parameters after AdamW with clipping equal one device's; nothing
falls back.

Tolerance: float64 sums in another order (split matmuls, reductions), as models_helpers.TOL
argues; torchtitan's rotary embedding computes in float32 (``query.float()``) on both sides at the
same points, from the same float64 inputs, so it adds no gap of its own; so do DeepSeek-V3's
experts, which torchtitan runs in bfloat16 (``torch._grouped_mm``), and its routing weights, applied
in float32: the expert-parallel side runs each expert through the same module's forward and weights
its rows in float32 too, so the roundings are the same ones.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from fallback_guard import no_fallback
from models_helpers import TOL, megatron_collectives
from reference_checks import check_gradients, check_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from titan_models import deepseek_v3, llama3  # noqa: E402
from titan_tp import titan_plan  # noqa: E402

VOCAB, BATCH, SEQ = 128, 8, 16
SIZES = dict(dim=64, heads=4, layers=2, vocab=VOCAB)
HEAD_TAIL = S(1, order="head_tail")


def _train(placement, plan, batch_sbp, steps=2, model=None, experts=None, **sizes):
    """Train torchtitan's model (its Llama 3 of these sizes, unless given) laid out by ``plan`` -- its
    experts then made expert parallel where ``experts`` gives ``expert_parallel``'s keywords -- and
    a one-device copy side by side; the last step's collectives."""
    model = llama3(dtype=torch.float64, **{**SIZES, **sizes}) if model is None else model
    reference = copy.deepcopy(model)
    gt.nn.distribute_module(model, placement, plan)
    if experts is not None:
        gt.nn.expert_parallel(model, placement, **experts)
    layouts = {n: p.sbp for n, p in model.named_parameters()}
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)
        x, y = tokens[:, :-1], tokens[:, 1:]
        gx, gy = (gt.distribute(t, placement, batch_sbp) for t in (x, y))
        with no_fallback(), gt.comm_stats() as stats:
            loss = F.cross_entropy(model(gx).flatten(0, 1), gy.flatten())
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref_loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        check_gradients(step, ((n, grads[n], layouts[n]) for n in layouts), reference.parameters(), TOL)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    check_parameters(list(layouts), model.parameters(), reference.parameters(), TOL, f"after {steps} steps")
    return stats.records


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_llama_plan_reads_torchtitans_names_and_head_counts(fuse_qkv):
    """torchtitan 0.3's names (``attention.qkv_linear.wqkv`` or ``.wq/wk/wv``) and its attention
    modules' ``n_heads`` / ``n_kv_heads``: the fused projection splits only when its kv groups do."""
    projection = "wqkv" if fuse_qkv else "wq"
    for kv_heads, split in ((4, True), (2, not fuse_qkv)):
        model = llama3(kv_heads=kv_heads, fuse_qkv=fuse_qkv, **SIZES)
        plan = gt.nn.llama_plan(model, 4)
        assert (f"*.attention.qkv_linear.{projection}.weight" in plan) == split, sorted(plan)
        assert ("*.attention.wo.weight" in plan) == split
        assert {"*.feed_forward.w1.weight", "*.feed_forward.w3.weight", "*.feed_forward.w2.weight"} <= set(plan)
        assert plan == gt.nn.llama_plan(model, 4, heads=4, kv_heads=kv_heads)


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_tensor_parallel_step_is_megatrons(p1, fuse_qkv):
    """Per layer one all-reduce after attention and one after the feed-forward, forward and
    backward, and clipping's one all-reduce of a few scalars: nothing else moves."""
    records = _train(p1, gt.nn.llama_plan(llama3(kv_heads=4, fuse_qkv=fuse_qkv, **SIZES), 4), B, kv_heads=4,
                     fuse_qkv=fuse_qkv)
    moved = [(r.op, r.bytes) for r in records]
    assert moved[:-1] == megatron_collectives(tp=4)
    assert moved[-1][0] == "all_reduce" and moved[-1][1] <= 1024


def test_grouped_query_attention_with_fewer_kv_heads_than_ranks(p1):
    """2 kv heads on 4 ranks, separate projections: the query heads split, k and v whole."""
    model = llama3(kv_heads=2, fuse_qkv=False, **SIZES)
    _train(p1, gt.nn.llama_plan(model, 4), B, kv_heads=2, fuse_qkv=False)


@pytest.mark.parametrize("kind", ["dp", "sp", "2x2", "titan", "titan-sp"])
def test_trains_like_one_device(world4, kind):
    """Data parallel; Megatron-SP; 2x2 (tensor on axis 1, data on axis 0); torchtitan's own plan with
    and without sequence parallelism (the logits split over the vocabulary into the loss)."""
    p1, p2 = gt.placement("cpu", [0, 1, 2, 3]), gt.placement("cpu", [[0, 1], [2, 3]])
    model = llama3(kv_heads=4, **SIZES)
    placement, plan, batch = {
        "dp": (p1, {}, S(0)),
        "sp": (p1, gt.nn.llama_plan(model, 4, sequence_parallel=True), B),
        "2x2": (p2, gt.nn.llama_plan(model, 2, axis=1, ndim=2), (S(0), B)),
        "titan": (p1, titan_plan(model, 4, False), B),
        "titan-sp": (p1, titan_plan(model, 4, True), B)}[kind]
    records = _train(placement, plan, batch, kv_heads=4)
    if kind == "titan-sp":
        assert {r.op for r in records} <= {"all_gather", "reduce_scatter", "all_reduce"}


def test_head_tail_sequence_split_moves_only_ring_blocks_the_loss_and_gradients(p1):
    """Tokens split on the sequence in head-tail order (each rank a chunk from each end: balanced
    causal work) through torchtitan's complex rotary embedding: attention runs as a ring -- only
    key/value blocks pass between ranks -- and otherwise only the loss and the gradients are
    reduced."""
    records = _train(p1, {}, HEAD_TAIL, kv_heads=2)
    assert {r.op for r in records} <= {"send_recv", "all_reduce"}, sorted({r.op for r in records})
    assert any(r.op == "send_recv" for r in records)


EXPERT_WEIGHTS = {f"*.routed_experts.inner_experts.{w}": (S(0),) for w in ("w1_EFD", "w2_EDF", "w3_EFD")}


@pytest.mark.parametrize("capacity_factor", [None, 4.0])
def test_deepseek_v3_experts_are_expert_parallel(p1, capacity_factor):
    """4 routed experts, one per rank, 2 per token: each rank's tokens go to their experts' ranks by
    all-to-all (in the routing's sizes, or padded to a capacity); the router, the shared expert and
    the latent attention data parallel.

    Padded, an expert's weight gradient sums its rows among 3x as many zero rows, in bfloat16
    (torchtitan's grouped kernels). oneDNN's bfloat16 GEMM blocks the longer sum otherwise than the
    unpadded one, and an element can round to the neighbouring bfloat16 value: seen on a Xeon with
    AMX (w2's gradient, 1 element of 16,384, one bfloat16 step apart), and with oneDNN held to AVX-512
    in 4 of 92,160 products of these sizes. torch's own CPU kernel gives the padded sums as the
    unpadded ones (0 of those 92,160, under default, AVX2 and AVX-512), so the padded case runs with
    oneDNN off and its roundings are the reference's."""
    with torch.backends.mkldnn.flags(enabled=capacity_factor is None):
        records = _train(p1, EXPERT_WEIGHTS, S(0), model=deepseek_v3(dtype=torch.float64),
                         experts={"capacity_factor": capacity_factor})
    assert "all_to_all" in {r.op for r in records}


def test_deepseek_v3_experts_beside_tensor_parallel_mlps(p2):
    """2x2: the routed experts split over axis 0 (2 per member) and broadcast over axis 1, where the
    dense layer's feed-forward and the shared expert are Megatron's column / row parallel; the batch
    split over axis 0. (A batch split over axis 1 too would sum the experts' weight gradients from
    partial gradients that torchtitan's grouped kernels round to bfloat16: within bfloat16's
    rounding of one device, not equal to it.)"""
    mlps = [f"*.{m}" for m in ("feed_forward", "shared_experts")]
    plan = {**{k: (S(0), B) for k in EXPERT_WEIGHTS},
            **gt.nn.megatron_plan([f"{m}.w1" for m in mlps] + [f"{m}.w3" for m in mlps], [f"{m}.w2" for m in mlps],
                                  axis=1, ndim=2, bias=False)}
    records = _train(p2, plan, (S(0), B), model=deepseek_v3(dtype=torch.float64), experts={"axis": 0})
    assert {"all_to_all", "all_reduce"} <= {r.op for r in records}


def test_expert_parallel_finds_torchtitans_routed_experts():
    """The routed experts of each MoE layer (not the dense first layer's feed-forward), and a clear
    error where they are not laid out."""
    model = deepseek_v3()
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        gt.nn.distribute_module(model, p, {})
        with pytest.raises(ValueError, match=r"layers\.1\.moe\.routed_experts\.inner_experts\.w1_EFD is \(B,\).*"
                                             r"needs it \(S\(0\),\)"):
            gt.nn.expert_parallel(model, p)


def test_routed_experts_in_bfloat16_equal_one_device_bit_for_bit(p1):
    """A bfloat16 model, as torchtitan trains: the expert-parallel routed experts give one device's
    output exactly -- each expert through its module's own grouped kernel, the routing weights applied
    in float32 and rounded back to bfloat16 before a token's slots are summed, as torchtitan's
    dispatcher does. (Bit for bit: the same kernels on the same rows, the same roundings.)"""
    model = deepseek_v3(dtype=torch.bfloat16)
    reference = copy.deepcopy(model).layers["1"].moe.routed_experts
    gt.nn.distribute_module(model, p1, EXPERT_WEIGHTS)
    gt.nn.expert_parallel(model, p1)
    data = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, SEQ, SIZES["dim"], generator=data).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=data)[:2] for _ in range(BATCH * SEQ)]).view(BATCH, SEQ, 2)
    scores = torch.rand(BATCH, SEQ, 2, generator=data).softmax(-1)      # float32, as its router gives them
    with no_fallback():
        out = model.layers["1"].moe.routed_experts(*(gt.distribute(t, p1, S(0)) for t in (x, scores, ids)), None)
    assert torch.equal(out.full_tensor(), reference(x, scores, ids, torch.bincount(ids.flatten(), minlength=4)))


def test_auto_plan_makes_torchtitans_experts_expert_parallel(p1):
    """auto_plan sees the routed experts: on 4 ranks it picks the expert role, the stacked weights
    split over the experts, and its plan trains like one device once expert_parallel applies it."""
    model = deepseek_v3(dtype=torch.float64)
    plan = gt.nn.auto_plan(model, p1, (torch.randint(0, VOCAB, (BATCH, SEQ)),))
    assert plan.expert_axis == 0
    assert {plan[f"layers.1.moe.routed_experts.inner_experts.{w}"] for w in ("w1_EFD", "w2_EDF", "w3_EFD")} == {(S(0),)}
    _train(p1, plan, plan.inputs[0], model=model, experts={"axis": plan.expert_axis})
