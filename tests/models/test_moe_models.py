"""HuggingFace Mixtral and Qwen2-MoE (tiny configs, their own code) trained with expert parallelism beside
one device: the experts split over one placement axis, tokens routed to them by all-to-all, with data
parallel on the same axis (4 ranks) or attention tensor-parallel on another (2x2), the experts
themselves broadcast or tensor-parallel there too; 3 AdamW steps.

Float64 (the reference's experts run HF's "eager" implementation: torch's grouped matmul has no
float64 kernel). The runs differ by the order of sums only: a gradient entry sums a few hundred
terms of size <= ~1, so <= ~1e-13 apart; AdamW's update divides by sqrt(v) + eps (eps = 1e-8),
so parameters move by at most lr * 1e-13 / 1e-8 = 1e-8 * lr apart per step: 1e-10 holds. The
routers compute their softmax in float32 (HF's code), which both runs share; the loss is computed
here in float64 (HF's ``labels=`` path casts the logits to float32).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from fallback_guard import no_fallback
from models_helpers import next_token_loss

VOCAB, HIDDEN, BATCH, SEQ, STEPS = 64, 32, 4, 8, 3
TOL = dict(rtol=1e-10, atol=1e-10)
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=4 * SEQ, experts_implementation="eager")


def make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON)).double()
    cfg = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                         num_experts=4, decoder_sparse_step=1, mlp_only_layers=[], **COMMON)
    return Qwen2MoeForCausalLM(cfg).double()


def plans(kind: str, layout: str):
    """(placement ranks, plan, expert axis, batch nd-SBP) of a layout."""
    if layout == "ep_dp":
        return [0, 1, 2, 3], {"*.experts.gate_up_proj": S(0), "*.experts.down_proj": S(0)}, 0, S(0)
    attention = {f"*.self_attn.{n}_proj.weight": (B, S(0)) for n in "qkv"}
    attention.update({f"*.self_attn.{n}_proj.bias": (B, S(0)) for n in "qkv"} if kind == "qwen2_moe" else {})
    attention["*.self_attn.o_proj.weight"] = (B, S(1))
    if layout == "ep_tp":                   # the experts broadcast over the tensor axis
        experts = {"*.experts.gate_up_proj": (S(0), B), "*.experts.down_proj": (S(0), B)}
    else:                                   # "ep_tp_experts": each expert split over it too, Megatron's way
        experts = {"*.experts.gate_up_proj": (S(0), S(1, 2)), "*.experts.down_proj": (S(0), S(2))}
    return [[0, 1], [2, 3]], {**attention, **experts}, 0, (S(0), B)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("layout", ["ep_dp", "ep_tp", "ep_tp_experts"])
def test_expert_parallel_trains_like_one_device(world4, kind, layout):
    model = make(kind)
    reference = copy.deepcopy(model)
    ranks, plan, axis, batch_sbp = plans(kind, layout)
    p = gt.placement("cpu", ranks)
    gt.nn.distribute_module(model, p, plan)
    gt.nn.expert_parallel(model, p, axis=axis)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (model, reference))
    data = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
        with no_fallback(), gt.comm_stats() as stats:
            gids = gt.distribute(ids, p, batch_sbp)
            loss = next_token_loss(model(input_ids=gids).logits, gids)
            loss.backward()
        ref_loss = next_token_loss(reference(input_ids=ids).logits, ids)
        ref_loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, **TOL, msg=lambda m: f"step {step} {name}: {m}")
            if ".experts." in name:
                assert a.grad.sbp == a.sbp, f"{name}'s gradient is {a.grad.sbp}, its parameter {a.sbp}"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert "all_to_all" in stats.ops()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a.full_tensor(), b, **TOL, msg=lambda m: f"{name} after {STEPS} steps: {m}")


def test_mixtral_bytes_are_the_routed_tokens_and_the_dense_gradients(world4):
    """EP x DP on 4 ranks, one step: every collective is the count exchange, a token all-to-all or a
    gradient reduction of a dense (non-expert) parameter; no expert weight moves. A layer's two
    all-to-alls carry exactly the rows that leave their rank, there and back: 2 x rows x hidden x 8
    bytes in all, the same again in the backward. Routed evenly, (W-1)/W of the tokens x top_k rows
    leave; the step's routing is printed beside that estimate."""
    model = make("mixtral")
    p = gt.placement("cpu", [0, 1, 2, 3])
    _, plan, _, _ = plans("mixtral", "ep_dp")
    gt.nn.distribute_module(model, p, plan)
    gt.nn.expert_parallel(model, p)
    routes = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_hook(        # the routing, read off the pieces (no collective)
            lambda m, args, out: routes.append(torch.cat([args[1].to_local(rank=r) for r in range(4)])))
    ids = gt.distribute(torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)), p, S(0))
    with gt.comm_profile(model) as prof:
        next_token_loss(model(input_ids=ids).logits, ids).backward()
    w, tokens, top_k = 4, BATCH * SEQ, 2
    a2a = {phase: [e for e in prof.events if e.collective == "all_to_all" and e.phase == phase]
           for phase in ("forward", "backward")}
    layers = len(routes)
    assert layers == 2 and all(len(v) == 2 * layers for v in a2a.values())   # there and back, per layer
    for layer, index in enumerate(routes):
        home = torch.arange(tokens).div(tokens // w, rounding_mode="floor")[:, None]   # each rank's tokens
        leaving = int((index != home).sum())                                           # one expert per rank
        for phase in ("forward", "backward"):
            at = 2 * (layer if phase == "forward" else layers - 1 - layer)     # the backward runs the layers back
            sent = sum(sum(e.bytes_per_rank.values()) for e in a2a[phase][at:at + 2])
            assert sent == 2 * leaving * HIDDEN * 8, (layer, phase, sent, leaving)
        print(f"layer {layer}: {leaving} of {tokens * top_k} routed rows leave their rank "
              f"(evenly routed: {tokens * top_k * (w - 1) // w})")
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) * 8
    expert_bytes = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 8
    reduced = sum(max(e.bytes_per_rank.values()) for e in prof.events if e.op == "gradient bucket")
    assert reduced <= 2 * dense * (w - 1) // w + 64 * w     # a ring all-reduce of the dense gradients
    others = [e for e in prof.events if e.op not in ("expert dispatch", "gradient bucket")]
    assert sum(max(e.bytes_per_rank.values()) for e in others) < expert_bytes / 100, prof.table()


def test_auto_plan_chooses_expert_parallel_where_the_experts_dominate(world4):
    """The tiny Mixtral's experts are most of its parameters and of its compute: expert parallelism
    gives each rank its experts' share of both (data parallelism runs every expert on every rank,
    Megatron every expert's matmuls halved at two all-reduces a layer), and is the fastest layout the
    model predicts (its routing modelled as even); the plan it gives trains like one device."""
    model = make("mixtral")
    reference = copy.deepcopy(model)
    p = gt.placement("cpu", [0, 1, 2, 3])
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def step(m, idx):
        next_token_loss(m(input_ids=idx).logits, idx).backward()
    model.config._experts_implementation = "grouped_mm"     # HF's "eager" experts call nonzero: no meta kernel
    plan = gt.nn.auto_plan(model, p, (ids,), step=step)
    model.config._experts_implementation = "eager"
    assert plan.chosen.candidate.name == "expert parallel" and plan.expert_axis == 0, plan.explain()
    assert {n for n, nd in plan.items() if nd == (S(0),)} == {
        n for n, _ in model.named_parameters() if ".experts." in n}
    gt.nn.distribute_module(model, p, plan)
    gt.nn.expert_parallel(model, p, axis=plan.expert_axis)
    gids = gt.distribute(ids, p, plan.inputs[0])
    loss = next_token_loss(model(input_ids=gids).logits, gids)
    torch.testing.assert_close(loss.full_tensor(), next_token_loss(reference(input_ids=ids).logits, ids), **TOL)


def test_at_a_realistic_size_the_modelled_all_to_alls_are_the_token_formula(world4):
    """Hidden 1024, intermediate 2816, 16 experts over 4 ranks, top-2, 2 x 4096 tokens, float32, on meta
    (auto_plan's costing, the routing even): a layer's two all-to-alls carry 2 x tokens x top_k x hidden
    x 4 bytes x (W-1)/W over the ranks, forward and again backward; printed beside the step's bytes
    with the experts split but not expert-parallel (every expert's weights gathered)."""
    from globaltensor.nn.auto.calibration import current_calibration
    from globaltensor.nn.auto.cost import evaluate
    cfg = MixtralConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                        num_attention_heads=8, num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2,
                        max_position_embeddings=4096)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    p = gt.placement("cpu", [0, 1, 2, 3])
    params = {n: (S(0),) if ".experts." in n else (B,) for n, _ in model.named_parameters()}
    buffers = {n: (B,) for n, _ in model.named_buffers()}

    def cost(expert_axis):
        with warnings.catch_warnings():             # the gathering layout's grouped matmul has no rule: a fallback
            warnings.simplefilter("ignore")
            return evaluate(model, p, 4, params, buffers, [((2, 4096), torch.int64, (S(0),))],
                            lambda m, idx: m(input_ids=idx).logits.sum().backward(), None, 2,
                            current_calibration(), expert_axis)
    ep, gathering = cost(0), cost(None)
    formula = 2 * (2 * 4096) * 2 * 1024 * 4 * 3 // 4
    for phase in ("forward", "backward"):
        moved = sum(sum(e.bytes_per_rank.values()) for e in ep.events
                    if e.collective == "all_to_all" and e.phase == phase)
        assert abs(moved - formula) <= 0.05 * formula, (phase, moved, formula)
    print(f"\nexpert parallel: {ep.bytes:,} bytes a step (busiest rank), all-to-alls {formula:,} a phase over the "
          f"ranks; experts split and gathered: {gathering.bytes:,}")
    assert ep.bytes < gathering.bytes / 2
