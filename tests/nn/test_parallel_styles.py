"""DTensor's parallel styles and HF's style names as plans (nn/parallel_styles.py): the translation
table, module by module; a model distributed by styles trains like one device; activation entries
at an argument or result position; the errors name the pattern."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel)

import globaltensor as gt
import globaltensor.nn as gnn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from titan_llama import Transformer  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast


class Block(nn.Module):
    """torchtitan's shape of a block: a norm, an MLP of two linears, an attention-like module taking
    ``(x, scale)`` and returning ``(y, x)``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.mix = Mix()

    def forward(self, x):
        h = self.norm(x)
        y, _ = self.mix(h, torch.ones(()))
        return x + self.down(torch.relu(self.up(y)))


class Mix(nn.Module):
    def forward(self, x, scale):
        return x * scale, x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_the_translation_table():
    m = Model()
    plan = gnn.from_parallel_styles(m, {
        "blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel(output_layouts=Shard(1)),
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "blocks.*.norm": SequenceParallel(),
        "blocks.*.mix": PrepareModuleInputOutput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                                 output_layouts=(Replicate(), Replicate()),
                                                 desired_output_layouts=(Shard(1), Shard(1)))})
    assert plan["blocks.0.up.weight"] == S(0) and plan["blocks.0.up.bias"] == S(0)
    assert plan["blocks.0.up:input"] == (B,) and "blocks.0.up:output" not in plan      # Shard(-1): its own
    assert plan["blocks.1.down.weight"] == S(1) and "blocks.1.down.bias" not in plan     # no bias
    assert plan["blocks.1.down:input"] == (S(-1),) and plan["blocks.1.down:output"] == (S(1),)
    assert plan["emb.weight"] == S(0) and plan["emb:input"] == (B,) and plan["emb:output"] == (S(1),)
    assert plan["head.weight"] == S(0) and plan["head:output"] == (B,)
    assert plan["blocks.0.norm:input"] == (S(1),) and "blocks.0.norm.weight" not in plan
    assert plan["blocks.0.mix:input[0]"] == (B,) and "blocks.0.mix:input[1]" not in plan
    assert plan["blocks.0.mix:output[0]"] == (S(1),) and plan["blocks.0.mix:output[1]"] == (S(1),)
    on_2d = gnn.from_parallel_styles(m, {"blocks.*.up": ColwiseParallel()}, axis=1, ndim=2)
    assert on_2d["blocks.0.up.weight"] == (B, S(0)) and on_2d["blocks.0.up:input"] == (None, B)


def test_hf_style_names():
    m = Model()
    plan = gnn.from_parallel_styles(m, {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "emb": "embedding_rowwise",
                                        "head": "colwise_gather_output", "blocks.*.norm": "sequence_parallel",
                                        "blocks.*.mix": "replicated_with_grad_allreduce"})
    assert plan["blocks.0.up.weight"] == S(0) and plan["blocks.0.down.weight"] == S(1)
    assert plan["blocks.0.down:output"] == (B,) and plan["emb.weight"] == S(0) and plan["emb:output"] == (B,)
    assert plan["head:output"] == (B,) and plan["blocks.1.norm:input"] == (S(1),)
    assert not any(k.startswith("blocks.0.mix") for k in plan)                            # nothing to do
    packed = gnn.from_parallel_styles(m, {"blocks.*.up": "packed_colwise"})
    assert packed["blocks.0.up.weight"] == S(0, blocks=2) and packed["blocks.0.up.bias"] == S(0, blocks=2)
    experts = nn.Module()
    experts.gate_up = nn.Parameter(torch.zeros(4, 6, 3))
    experts.down = nn.Parameter(torch.zeros(4, 3, 3))
    holder = nn.Module()
    holder.experts = experts
    assert gnn.from_parallel_styles(holder, {"experts.gate_up": "packed_colwise", "experts.down": "rowwise"}) == \
        {"experts.gate_up": S(1, blocks=2), "experts.down": S(2)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_model_distributed_by_styles_trains_like_one_device(p1, sequence_parallel):
    """Megatron TP (and with sequence parallelism, torchtitan's way of asking for it) through the
    styles, passed straight to distribute_module on a 1-D placement: equal to one device in float64
    (the same ops; a reduction's pieces summed in another order: rtol 1e-12)."""
    out = Shard(1) if sequence_parallel else Replicate()
    styles = {"blocks.*.up": ColwiseParallel(input_layouts=out), "blocks.*.down": RowwiseParallel(output_layouts=out)}
    if sequence_parallel:
        styles.update({"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                       "blocks.*.norm": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1),
                                                                                  output_layouts=Replicate())})
    m, ref = Model().double(), Model().double()
    gnn.distribute_module(m, p1, styles)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    with gt.comm_stats() as st:
        loss = m(gt.distribute(ids, p1, B)).square().mean()
        loss.backward()
    want = ref(ids).square().mean()
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-12, atol=0)
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=1e-12, atol=1e-15, msg=name)
    ops = set(st.ops())
    assert ops == ({"all_gather", "reduce_scatter", "all_reduce"} if sequence_parallel else {"all_reduce"}), ops


def test_entries_at_argument_and_result_positions(p1):
    """``:input[1]``, ``:input[name]``, ``:output[1]``: the named argument or result is boxed, the
    others kept; a position the call does not have is left alone."""
    seen = {}

    class Two(nn.Module):
        def forward(self, a, b, *, c=None):
            seen.update(a=a.sbp, b=b.sbp, c=None if c is None else c.sbp)
            return a, b

    holder = nn.Module()
    holder.two = Two()
    gnn.distribute_module(holder, p1, {"two:input[1]": B, "two:input[c]": S(0), "two:output[1]": S(1)})
    x = gt.distribute(torch.randn(4, 4), p1, S(1))
    a, b = holder.two(x, x, c=gt.distribute(torch.randn(4, 4), p1, B))
    assert seen == {"a": (S(1),), "b": (B,), "c": (S(0),)} and a.sbp == (S(1),) and b.sbp == (S(1),)
    holder.two(x, x)
    assert seen["c"] is None


def test_errors_name_the_pattern(p1, p2):
    m = Model()
    with pytest.raises(TypeError, match=r"plan\['blocks.\*.up'\]: expected an SBP .* got 'colwize'"):
        gnn.distribute_module(m, p1, {"blocks.*.up": "colwize"})
    with pytest.raises(TypeError, match=r"plan\['blocks.\*.up'\]: a parallel style .* 2 axes"):
        gnn.distribute_module(Model(), p2, {"blocks.*.up": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"pattern 'nowhere' matches no module"):
        gnn.from_parallel_styles(m, {"nowhere": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"\['blocks.0.norm'\]: column / row parallel fit nn.Linear"):
        gnn.from_parallel_styles(m, {"blocks.0.norm": ColwiseParallel()})
    with pytest.raises(ValueError, match="Shard or Replicate, got Partial"):
        gnn.from_parallel_styles(m, {"blocks.*.mix": PrepareModuleOutput(output_layouts=Partial(),
                                                                         desired_output_layouts=Partial())})
    with pytest.raises(ValueError, match="local pieces; use gt.nn.expert_parallel"):
        gnn.from_parallel_styles(m, {"blocks.*.up": "local_colwise"})
    with pytest.raises(TypeError, match="expected a DTensor ParallelStyle"):
        gnn.from_parallel_styles(m, {"blocks.*.up": 3})
    assert gnn.from_parallel_styles(m, {"blocks.*.mix": PrepareModuleInput(input_kwarg_layouts={"scale": Shard(0)},
                                                                           desired_input_kwarg_layouts={"scale": Replicate()})}) \
        == {"blocks.0.mix:input[scale]": (B,), "blocks.1.mix:input[scale]": (B,)}


def _titan() -> nn.Module:
    """examples/titan_llama.py's Llama (torchtitan's module names), float64, one initialisation."""
    torch.manual_seed(0)
    return Transformer().double()


def test_torchtitans_styles_dict_trains_a_torchtitan_shaped_model_like_one_device(p1):
    """docs/howto.md, "Coming from torchtitan": torchtitan's Llama TP plan with sequence parallelism
    (PrepareModuleInput on attention and the feed-forward, SequenceParallel norms) given to
    distribute_module: equal to one device in float64, Megatron-SP's collectives only, no fallback;
    llama_plan with torchtitan's names and head counts gives the same step."""
    block = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
             "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
             "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
             "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
              "norm": SequenceParallel(), "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
              **{f"layers.*.{name}": style for name, style in block.items()}}
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = _titan()
    want = ref(ids).square().mean()
    want.backward()
    for plan in (styles, gnn.llama_plan(_titan(), 4, heads=4, kv_heads=4, sequence_parallel=True)):
        m = _titan()
        gnn.distribute_module(m, p1, plan)
        gt.fallback_calls_clear()
        with gt.comm_stats() as st:
            loss = m(gt.distribute(ids, p1, B)).square().mean()
            loss.backward()
        assert gt.fallback_calls() == {}
        torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-12, atol=0)
        for (name, a), b in zip(m.named_parameters(), ref.parameters()):
            # float64, the same sums in another order; a norm weight's gradient sums 32 products of
            # terms that cancel, so its relative error is looser than the loss's
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=1e-10, atol=1e-14, msg=name)
        assert set(st.ops()) <= {"all_gather", "reduce_scatter", "all_reduce"}, st.ops()
