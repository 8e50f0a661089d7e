"""Expert parallelism (nn/moe): the routed all-to-all on its own, then experts modules whose tokens move
to their experts' ranks, against the same module on one device (float64: the same sums in the same
order, so equal to the last bits), forward and backward, in every composition with other axes."""
import copy
import itertools

import numpy as np

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.nn.moe.token_exchange import exchange_rows
from globaltensor.sbp import B, P, S
from moe_models import MoE, Experts, ListedExperts

pytestmark = pytest.mark.usefixtures("float64")
EXACT = dict(rtol=0, atol=1e-12)
PLAN = {"*gate_up_proj": S(0), "*up_proj": S(0), "*down_proj": S(0), "*_bias": S(0)}


@settings(max_examples=30, deadline=None)
@given(w=st.integers(2, 4), data=st.data())
def test_rows_reach_their_ranks_in_the_sizes_given_and_gradients_come_back(w, data):
    sizes = [[data.draw(st.integers(0, 3)) for _ in range(w)] for _ in range(w)]
    with gt.simulate(w):
        group = tuple(range(w))
        sends = {i: torch.randn(sum(sizes[i]), 2, requires_grad=True) for i in group}
        got = exchange_rows(group, sizes, sends)
        for j in group:
            want = torch.cat([sends[i].split(sizes[i])[j] for i in group])
            torch.testing.assert_close(got[j], want, rtol=0, atol=0)
        probes = {j: torch.randn_like(got[j]) for j in group}
        sum((got[j] * probes[j]).sum() for j in group).backward()
        for i in group:
            starts = [sum(sizes[s][j] for s in range(i)) for j in group]
            want = torch.cat([probes[j][starts[j]:starts[j] + sizes[i][j]] for j in group])
            torch.testing.assert_close(sends[i].grad, want, rtol=0, atol=0)


def _routing(tokens, num_experts, top_k, *, ties=False, idle=()):
    """Top-k expert ids and normalised weights; ``ties``: equal scores, picked in index order;
    ``idle``: experts no token picks."""
    g = torch.Generator().manual_seed(tokens * 31 + num_experts)
    scores = torch.zeros(tokens, num_experts) if ties else torch.rand(tokens, num_experts, generator=g)
    scores[:, list(idle)] = -1.0
    weights, index = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


LAYOUTS = {   # placement, the expert axis, the tokens' nd-SBP
    "1d": ([0, 1, 2, 3], 0, S(0)),
    "data_x_expert": ([[0, 1], [2, 3]], 1, (S(0), S(0))),
    "expert_x_tensor": ([[0, 1], [2, 3]], 0, (S(0), B)),
}
OPTIONS = {"gated": {}, "bias": {"bias": True}, "transposed": {"transposed": True, "bias": True},
           "no_gate": {"gate": False}}


def _equal_one_device(experts, one, p, tokens_sbp, x, index, weights):
    """The expert-parallel ``experts`` against ``one`` on one device, forward and backward (a random
    probe of the output): the output and the gradients of x, of the routing weights and of every
    parameter, exactly (float64). Returns the forward's comm stats."""
    gx = gt.distribute(x, p, tokens_sbp).requires_grad_()
    gw = gt.distribute(weights, p, tokens_sbp).requires_grad_()
    with gt.comm_stats() as stats:
        y = experts(gx, gt.distribute(index, p, tokens_sbp), gw)
    xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
    want = one(xr, index, wr)
    probe = torch.randn_like(want)
    (y * gt.distribute(probe, p, (B,) * p.ndim)).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(y.full_tensor(), want, **EXACT)
    for got, ref in [(gx.grad, xr.grad), (gw.grad, wr.grad)] + [
            (a.grad, b.grad) for a, b in zip(experts.parameters(), one.parameters())]:
        torch.testing.assert_close(got.full_tensor(), ref, **EXACT)
    return stats


@pytest.mark.parametrize("layout, options", list(itertools.product(LAYOUTS, OPTIONS)))
def test_experts_equal_one_device(layout, options):
    ranks, axis, tokens_sbp = LAYOUTS[layout]
    torch.manual_seed(0)
    one = Experts(num_experts=5, **OPTIONS[options])          # 5 experts over 2 or 4 ranks: uneven
    experts = copy.deepcopy(one)
    x, (index, weights) = torch.randn(13, 6), _routing(13, 5, 2)
    with gt.simulate(4):
        p = gt.placement("cpu", ranks)
        plan = {k: tuple(v if a == axis else B for a in range(p.ndim)) for k, v in PLAN.items()}
        gt.nn.distribute_module(experts, p, plan, strict=False)
        gt.nn.expert_parallel(experts, p, axis=axis)
        _equal_one_device(experts, one, p, tokens_sbp, x, index, weights)


@pytest.mark.parametrize("options", ["gated", "no_gate", "transposed"])
def test_tensor_parallel_experts_on_a_second_axis_give_a_partial_sum(options):
    """Experts split over axis 0 and each expert split Megatron's way over axis 1 (the up projection's
    output features, gate and up alike; the down projection's input features): the tokens are
    broadcast over axis 1, each rank computes its share of its experts' features, and the result is
    partial over axis 1 -- summed where the program next needs it."""
    torch.manual_seed(5)
    one = Experts(num_experts=4, **{"gated": {}, "no_gate": {"gate": False}, "transposed": {"transposed": True}}[options])
    experts = copy.deepcopy(one)
    up = "up_proj" if options == "no_gate" else "gate_up_proj"
    dims = (2, 1) if options == "transposed" else (1, 2)
    plan = {f"*{up}": (S(0), S(dims[0], 1 if options == "no_gate" else 2)), "*down_proj": (S(0), S(dims[1]))}
    x, (index, weights) = torch.randn(13, 6), _routing(13, 4, 2)
    with gt.simulate(4):
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        gt.nn.distribute_module(experts, p, plan)
        gt.nn.expert_parallel(experts, p, axis=0)
        gx = gt.distribute(x, p, (S(0), B)).requires_grad_()
        y = experts(gx, *(gt.distribute(t, p, (S(0), B)) for t in (index, weights)))
        assert y.sbp == (S(0), P)
        xr = x.clone().requires_grad_()
        want = one(xr, index, weights)
        probe = torch.randn_like(want)
        (y * gt.distribute(probe, p, (B, B))).sum().backward()
        (want * probe).sum().backward()
        torch.testing.assert_close(y.full_tensor(), want, **EXACT)
        torch.testing.assert_close(gx.grad.full_tensor(), xr.grad, **EXACT)
        for a, b in zip(experts.parameters(), one.parameters()):
            assert a.grad.sbp == a.sbp
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, **EXACT)


@pytest.mark.parametrize("case", ["ties", "idle_experts", "fewer_tokens_than_ranks"])
def test_routing_corner_cases_drop_no_token(case):
    """Tied scores (every token picks experts 0 and 1: the other ranks' experts get nothing),
    experts that no token picks, and ranks that hold no token at all."""
    tokens = 3 if case == "fewer_tokens_than_ranks" else 12
    index, weights = _routing(tokens, 4, 2, ties=case == "ties", idle=(1, 2) if case == "idle_experts" else ())
    torch.manual_seed(1)
    one = Experts(num_experts=4)
    experts = copy.deepcopy(one)
    x = torch.randn(tokens, 6)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        gt.nn.distribute_module(experts, p, PLAN, strict=False)
        gt.nn.expert_parallel(experts, p)
        y = experts(*(gt.distribute(t, p, S(0)) for t in (x, index, weights)))
        torch.testing.assert_close(y.full_tensor(), one(x, index, weights), **EXACT)
        assert (y.full_tensor().abs().sum(-1) > 0).all()


def test_only_tokens_move_and_the_all_to_all_carries_the_routed_rows():
    """Per layer: the count exchange (experts x 8 bytes per rank), then each rank sends the rows its
    tokens route to other ranks' experts, and gets their results back: no weight moves."""
    torch.manual_seed(2)
    block = MoE(num_experts=4, hidden=6, inter=5)
    x = torch.randn(4, 8, 6)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        gt.nn.distribute_module(block, p, PLAN, strict=False)
        gt.nn.expert_parallel(block, p)
        gx = gt.distribute(x, p, S(0))
        with torch.no_grad():
            flat = gx.reshape(-1, 6)
            index = torch.topk(torch.softmax(block.router(flat), -1), 2, dim=-1)[1].full_tensor()
        with gt.comm_stats() as stats:
            block(gx)
        assert stats.ops() == ["all_gather", "all_to_all", "all_to_all"]
        gathered, there, back = stats.records
        assert gathered.bytes_per_rank == {r: 3 * 4 * 8 for r in range(4)}    # ring all-gather of 4 counts
        rows_off_rank = {r: int((index[8 * r:8 * (r + 1)] != r).sum()) for r in range(4)}   # one expert a rank
        assert there.bytes_per_rank == {r: rows_off_rank[r] * 6 * 8 for r in range(4)}
        assert sum(back.bytes_per_rank.values()) == sum(there.bytes_per_rank.values())


def test_the_profile_names_the_experts_module_for_its_all_to_alls():
    torch.manual_seed(3)
    block = MoE(num_experts=4)
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        gt.nn.distribute_module(block, p, PLAN, strict=False)
        gt.nn.expert_parallel(block, p)
        with gt.comm_profile(block) as prof:
            block(gt.distribute(torch.randn(2, 4, 6), p, S(0))).sum().backward()
        causes = {(e.op, e.module, e.phase) for e in prof.events if e.collective == "all_to_all"}
        assert causes == {("expert dispatch", "MoE.experts", "forward"),
                          ("expert dispatch", "MoE.experts", "backward")}, prof.table()


def test_errors_name_the_module_and_what_it_needs():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        with pytest.raises(ValueError, match="no MoE experts module in Linear"):
            gt.nn.expert_parallel(torch.nn.Linear(2, 2), p)
        looping = torch.nn.Sequential(torch.nn.Linear(2, 2))
        looping.experts = torch.nn.ModuleList([torch.nn.Linear(2, 2)])    # forward(input): routes itself
        with pytest.raises(ValueError, match=r"no MoE experts module in Sequential.*; experts is an nn.ModuleList of "
                                             r"experts, but its owner's forward does not take \(hidden_states, "):
            gt.nn.expert_parallel(looping, p)
        block = MoE(num_experts=4)
        with pytest.raises(ValueError, match=r"experts.gate_up_proj is not a global tensor; lay the model out first"):
            gt.nn.expert_parallel(block, p)
        gt.nn.distribute_module(block, p, {"*down_proj": S(0)})
        with pytest.raises(ValueError, match=r"experts.gate_up_proj is \(B,\) on .*needs it \(S\(0\),\): experts split"):
            gt.nn.expert_parallel(block, p)
        with pytest.raises(ValueError, match=r"expert_parallel\(axis\): expected a placement axis in 0..0, got 1"):
            gt.nn.expert_parallel(block, p, axis=1)


def test_plain_inputs_and_gt_compile_are_refused_with_the_reason():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        block = MoE(num_experts=4)
        gt.nn.distribute_module(block, p, PLAN, strict=False)
        gt.nn.expert_parallel(block, p)
        index, weights = _routing(4, 4, 2)
        with pytest.raises(TypeError, match="experts got plain tensors"):
            block.experts(torch.randn(4, 6), index, weights)
        step = gt.compile(lambda x: block(x).sum())
        x = gt.distribute(torch.randn(2, 2, 6), p, S(0))
        with pytest.raises(RuntimeError, match="its all-to-all's sizes follow the routing, which a captured graph "
                                               "cannot; give gt.nn.expert_parallel\\(..., capacity_factor=\\)"):
            for _ in range(2):
                step(x)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_experts_in_a_module_list_move_to_their_owners_and_equal_one_device(layout):
    """A plain nn.ModuleList of expert modules (biased MLPs with a buffer): expert_parallel moves each
    expert whole to the ranks of its owner on the axis (5 experts: 2-1-1-1 or 3-2), the tokens go
    to it, and values and every gradient equal one device's."""
    ranks, axis, tokens_sbp = LAYOUTS[layout]
    torch.manual_seed(6)
    one = ListedExperts(num_experts=5)
    experts = copy.deepcopy(one)
    x, (index, weights) = torch.randn(13, 6), _routing(13, 5, 2)
    with gt.simulate(4):
        p = gt.placement("cpu", ranks)
        gt.nn.distribute_module(experts, p)
        gt.nn.expert_parallel(experts, p, axis=axis)
        owners = [0, 0, 1, 2, 3] if p.ndim == 1 else [0, 0, 0, 1, 1]
        for e, expert in enumerate(experts.experts):
            for t in list(expert.parameters()) + list(expert.buffers()):
                member = np.take(np.array(ranks), owners[e], axis=axis)
                assert sorted(t.placement.rank_list()) == sorted(np.atleast_1d(member).tolist())
                assert all(v.is_broadcast for v in t.sbp)
        forward = _equal_one_device(experts, one, p, tokens_sbp, x, index, weights)
        groups = p.size // p.hierarchy[axis]                                 # one exchange per group on the axis
        assert forward.ops() == ["all_gather", "all_to_all", "all_to_all"] * groups  # counts, rows there, back


def test_module_list_experts_train_with_adamw_and_compile_with_a_capacity():
    """Data x expert parallel on 2 x 2 with listed experts: three AdamW steps eagerly equal one device,
    and a compiled step (capacity_factor pads the sizes) goes on to equal it."""
    torch.manual_seed(7)
    one = MoE(num_experts=4, listed=True)
    block = copy.deepcopy(one)
    with gt.simulate(4):
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        gt.nn.distribute_module(block, p)
        gt.nn.expert_parallel(block, p, axis=1, capacity_factor=4.0)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (block, one))

        def step(x):
            loss = block(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        compiled = gt.compile(step)
        for i in range(5):                                                # eager x3, capture, a graph run
            x = torch.randn(4, 4, 6)
            loss = (compiled if i >= 2 else step)(gt.distribute(x, p, (S(0), S(0))))
            want = one(x).square().mean()
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.full_tensor(), want, **EXACT)
        for a, b in zip(block.parameters(), one.parameters()):
            torch.testing.assert_close(a.full_tensor(), b, **EXACT)


def _ep_block(capacity_factor, seed=4):
    torch.manual_seed(seed)
    block = MoE(num_experts=4)
    one = copy.deepcopy(block)
    p = gt.placement("cpu", [0, 1, 2, 3])
    gt.nn.distribute_module(block, p, PLAN, strict=False)
    gt.nn.expert_parallel(block, p, capacity_factor=capacity_factor)
    return block, one, p


def test_a_capacity_pads_each_experts_rows_to_a_fixed_size():
    """capacity_factor 2: 16 rows a rank over 4 experts, so each rank sends each expert 8 rows, padded;
    the result is the unpadded one's (float64; the experts run on more rows, so only up to the last
    bits of the matmul's blocking)."""
    with gt.simulate(4):
        block, one, p = _ep_block(2.0)
        x = torch.randn(4, 8, 6)
        with gt.comm_stats() as stats:
            y = block(gt.distribute(x, p, S(0)))
        torch.testing.assert_close(y.full_tensor(), one(x), **EXACT)
        a2a = [rec for rec in stats.records if rec.op == "all_to_all"]
        assert stats.ops().count("all_gather") == 0 and len(a2a) == 2          # no count exchange: fixed sizes
        assert all(rec.bytes_per_rank == {r: 3 * 8 * 6 * 8 for r in range(4)} for rec in a2a)


def test_a_compiled_step_with_a_capacity_trains_like_one_device():
    with gt.simulate(4):
        block, one, p = _ep_block(4.0)                                        # 4.0: no routing overflows
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (block, one))

        def step(x):
            loss = block(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        compiled = gt.compile(step)
        for _ in range(4):                                                    # eager, capture, two graph runs
            x = torch.randn(4, 8, 6)
            loss = compiled(gt.distribute(x, p, S(0)))
            want = one(x).square().mean()
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.full_tensor(), want, **EXACT)
        for a, b in zip(block.parameters(), one.parameters()):
            torch.testing.assert_close(a.full_tensor(), b, **EXACT)


def test_routing_over_the_capacity_raises_naming_the_expert_eagerly_and_compiled():
    """Tied scores send every token to the same two experts (which two, torch.topk leaves open): 8 rows
    each from every rank, over the capacity of 6 that capacity_factor 1.5 gives (16 rows a rank over 4
    experts)."""
    with gt.simulate(4):
        block, _, p = _ep_block(1.5)
        with torch.no_grad():
            block.router.weight.zero_()
        x = gt.distribute(torch.randn(4, 8, 6), p, S(0))
        with pytest.raises(RuntimeError, match=r"rank 0 routes 8 rows to expert \d, over its capacity of 6 \(every "
                                               r"expert's rows: \[[08], [08], [08], [08]\]\); raise capacity_factor"):
            block(x)
        compiled = gt.compile(lambda x, index, weights: block.experts(x, index, weights).sum())
        tokens = torch.arange(32)
        even = torch.stack([tokens % 4, (tokens + 1) % 4], dim=1)          # 4 rows a rank for every expert
        flat, weights = (gt.distribute(t, p, S(0)) for t in (torch.randn(32, 6), torch.full((32, 2), 0.5)))
        for _ in range(2):                                                  # eager, then the capture
            compiled(flat, gt.distribute(even, p, S(0)), weights)
        with pytest.raises(gt.GraphError, match=r"rank 0 routes more rows to expert 0 than its capacity of 6"):
            compiled(flat, gt.distribute(torch.zeros_like(even).index_fill_(1, torch.tensor([1]), 1), p, S(0)),
                     weights)
