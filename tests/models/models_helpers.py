"""HuggingFace Llama / GPT-2 (tiny configs, their own code) trained on global tensors beside one device.

``train_hf_side_by_side(kind, placement, plan, batch_sbp, attn)`` builds the model, lays its
parameters out by ``plan``, and runs training steps of the distributed model and of a
single-device copy from the same init and data, in float64: every step the losses agree,
every gradient equals the reference's and has its parameter's SBP, and the fallback never runs
(its warning is an error). The collectives of the last step come back for comparison with
Megatron's (:func:`megatron_collectives`).

Float64 tolerance: the runs differ by the order of sums only (split matmuls, all-reduces). A
gradient entry sums n <= ~1,000 terms of size <= ~1, so it differs by <= n * u = 1e-13
(u = 1.1e-16); SGD moves parameters by lr times that. Llama's RMSNorm rounds to float32 and
back on both sides, at the same points, so it does not widen the gap; the loss is computed
here in float64 (HF's ``labels=`` path casts the logits to float32).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import globaltensor as gt
from globaltensor.tensor import GlobalTensor
from fallback_guard import no_fallback  # noqa: F401  (re-exported for the model tests)
from reference_checks import check_gradients, check_parameters

VOCAB, HIDDEN, LAYERS, HEADS, BATCH, SEQ = 128, 64, 2, 4, 8, 16
TOL = dict(rtol=1e-10, atol=1e-10)


def make_model(kind: str, attn: str, kv_heads: int = HEADS) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                          max_position_embeddings=4 * SEQ, attn_implementation=attn)
        return LlamaForCausalLM(cfg).double()
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=4 * SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation=attn)
    return GPT2LMHeadModel(cfg).double()


@dataclass
class Run:
    model: torch.nn.Module
    reference: torch.nn.Module
    records: List = field(default_factory=list)   # the collectives of the last step
    losses: List[float] = field(default_factory=list)


def train_hf_side_by_side(kind, placement, plan, batch_sbp, attn="sdpa", steps=2, kv_heads=HEADS, shape=(BATCH, SEQ),
                       shifted=False) -> Run:
    """``shifted``: the labels are made shifted from the whole batch and laid out as the tokens, so
    the loss needs no token from another rank (what a sequence split wants); else the loss shifts
    the logits and tokens it is given."""
    model = make_model(kind, attn, kv_heads)
    reference = copy.deepcopy(model)
    gt.nn.distribute_module(model, placement, plan)
    layouts = {n: p.sbp for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    run = Run(model, reference)
    for step in range(steps):
        ids = torch.randint(0, VOCAB, shape, generator=data)
        gids = gt.distribute(ids, placement, batch_sbp)
        glabels = gt.distribute(shifted_labels(ids), placement, batch_sbp) if shifted else None
        with no_fallback(), gt.comm_stats() as stats:
            logits = model(input_ids=gids).logits
            loss = labelled_loss(logits, glabels) if shifted else next_token_loss(logits, gids)
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
        ref_logits = reference(input_ids=ids).logits
        ref_loss = labelled_loss(ref_logits, shifted_labels(ids)) if shifted else next_token_loss(ref_logits, ids)
        ref_loss.backward()
        assert isinstance(loss, GlobalTensor)
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        check_gradients(step, ((n, grads[n], layouts[n]) for n in layouts), reference.parameters(), TOL)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        run.records = list(stats.records)
        run.losses.append(ref_loss.item())
    check_parameters(list(layouts), model.parameters(), reference.parameters(), TOL, f"after {steps} steps")
    return run


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss in the logits' own dtype (``labels=`` computes it in float32, which would
    round the float64 comparison to 1e-7)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def shifted_labels(ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token, the last position ignored (-100)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def labelled_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss against labels shifted beforehand: no shift of the logits."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def megatron_collectives(tp: int, dp: int = 1, itemsize: int = 8) -> list:
    """Megatron's tensor-parallel step: per layer one all-reduce of the activations after attention
    and one after the MLP in the forward, the same in the backward -- ``(op, bytes)`` per group of
    ``tp`` ranks, with each data-parallel group's ``BATCH / dp`` rows."""
    activation = BATCH // dp * SEQ * HIDDEN * itemsize
    return [("all_reduce", 2 * (tp - 1) * activation // tp)] * (4 * LAYERS) * dp


def gradient_all_reduce_bytes(model: torch.nn.Module, axis: int) -> int:
    """Bytes a rank sends all-reducing each parameter's gradient (its piece) over placement axis ``axis``."""
    total = 0
    for p in model.parameters():
        k = p.placement.hierarchy[axis]
        rank = p.placement.rank_list()[0]
        total += 2 * (k - 1) * p.layout_meta.piece_bytes(rank) // k
    return total
