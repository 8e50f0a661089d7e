"""gt.nn.distribute_module: plan matching, parameters and buffers, state_dict, optimizers, errors."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from nn_models import MEGATRON_1D, MEGATRON_2D, TOL, net, train_net_side_by_side

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum



# -- plan helpers ------------------------------------------------------------------------------
def test_megatron_helpers_are_data():
    assert gnn.column_parallel("*.qkv") == {"*.qkv.weight": S(0), "*.qkv.bias": S(0)}
    assert gnn.row_parallel("*.proj") == {"*.proj.weight": S(1), "*.proj.bias": B}
    assert gnn.column_parallel("*.qkv", axis=1, ndim=2) == {"*.qkv.weight": (B, S(0)), "*.qkv.bias": (B, S(0))}
    assert gnn.row_parallel("*.proj", axis=0, ndim=2) == {"*.proj.weight": (S(1), B), "*.proj.bias": (B, B)}
    assert gnn.on_axis(S(1), 2, 3) == (B, B, S(1))
    assert gnn.layer_plan("emb", {"weight": S(1)}, axis=0, ndim=2) == {"emb.weight": (S(1), B)}
    plan = gnn.megatron_plan(["a", "b"], ["c"], axis=1, ndim=2, extra={"a.weight": (S(0), B)})
    assert list(plan) == ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]
    assert plan["a.weight"] == (S(0), B), "extra entries take precedence"
    assert plan["c.weight"] == (B, S(1)) and plan["c.bias"] == (B, B)
    with pytest.raises(ValueError, match="axis"):
        gnn.column_parallel("x", axis=2, ndim=2)


def test_parameter_of_a_global_tensor(p2):
    g = gt.randn(6, 4, placement=p2, sbp=(B, S(1)))
    prm = nn.Parameter(g)
    assert isinstance(prm, nn.Parameter) and isinstance(prm, GlobalTensor) and prm.requires_grad
    assert prm.sbp == (B, S(1)) and prm.placement == p2
    torch.testing.assert_close(prm.full_tensor(), g.full_tensor(), rtol=0, atol=0)
    m = nn.Module()
    m.w = prm
    assert dict(m.named_parameters())["w"] is prm
    (m.w * 2.0).sum().backward()
    assert m.w.grad.sbp == (B, S(1))
    torch.testing.assert_close(m.w.grad.full_tensor(), torch.full((6, 4), 2.0))


# -- plan matching -------------------------------------------------------------------------------
def test_match_plan_globs_first_match_and_default_broadcast(p2):
    plan = {"blocks.0.up.weight": (S(1), B), **MEGATRON_2D, "*.norm.*": (B, B), "head.weight": (S(0), S(1))}
    got = gnn.match_plan(net(), p2, plan)
    assert got["blocks.0.up.weight"] == (S(1), B), "the first matching pattern decides"
    assert got["blocks.1.up.weight"] == (B, S(0))
    assert got["blocks.0.up.bias"] == got["blocks.1.up.bias"] == (B, S(0))
    assert got["blocks.1.down.weight"] == (B, S(1)) and got["blocks.1.down.bias"] == (B, B)
    assert got["head.weight"] == (S(0), S(1))
    assert got["blocks.0.norm.weight"] == (B, B)
    assert got["blocks.0.scale"] == (B, B), "buffers are covered, broadcast by default"
    assert set(got) == {n for n, _ in net().named_parameters()} | {n for n, _ in net().named_buffers()}


def test_plan_may_be_pairs_and_bare_sbp_on_1d(p1):
    got = gnn.match_plan(net(), p1, [("*.up.weight", S(0)), ("*.norm.*", B), ("*.weight", S(1)), ("*", B)])
    assert got["blocks.0.up.weight"] == (S(0),)
    assert got["blocks.0.down.weight"] == (S(1),) and got["head.weight"] == (S(1),)
    assert got["blocks.0.down.bias"] == (B,) and got["blocks.1.norm.weight"] == (B,)


def test_negative_split_dims_are_normalised(p1):
    assert gnn.match_plan(net(), p1, {"head.weight": S(-1)})["head.weight"] == (S(1),)


# -- distributing --------------------------------------------------------------------------------
def test_distribute_module_in_place_pieces_and_parameters(p2):
    m = net()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    frozen = m.blocks[1].norm.bias
    frozen.requires_grad_(False)
    out = gnn.distribute_module(m, p2, MEGATRON_2D)
    assert out is m
    params = dict(m.named_parameters())
    assert len(params) == len(want) - 2  # two buffers
    for name, prm in params.items():
        assert isinstance(prm, nn.Parameter) and isinstance(prm, GlobalTensor), name
        assert prm.placement == p2
        torch.testing.assert_close(prm.full_tensor(), want[name], rtol=0, atol=0)
    assert m.blocks[1].norm.bias.requires_grad is False and m.blocks[0].norm.bias.requires_grad is True
    w = m.blocks[0].up.weight                                     # [10, 6], (B, S(0)): 5 rows each
    assert w.sbp == (B, S(0))
    assert {r: tuple(t.shape) for r, t in w.local_tensors().items()} == {0: (5, 6), 1: (5, 6), 2: (5, 6), 3: (5, 6)}
    torch.testing.assert_close(w.to_local(rank=1), want["blocks.0.up.weight"][5:])
    torch.testing.assert_close(w.to_local(rank=2), want["blocks.0.up.weight"][:5])
    assert m.blocks[0].down.weight.sbp == (B, S(1)) and m.blocks[0].down.bias.sbp == (B, B)
    scale = m.blocks[0].scale
    assert isinstance(scale, GlobalTensor) and scale.sbp == (B, B) and not isinstance(scale, nn.Parameter)
    torch.testing.assert_close(scale.full_tensor(), want["blocks.0.scale"])


def test_pieces_own_their_storage(p1):
    """In-place updates must change each rank's piece once: no piece may share memory with another
    rank's piece (a simulated world's replicas) or with the module's former tensor."""
    m = net()
    old = m.head.weight
    gnn.distribute_module(m, p1, {})
    pieces = list(m.head.weight.local_tensors().values())
    for a, b in itertools.combinations(pieces, 2):
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    before = old.detach().clone()
    with torch.no_grad():
        m.head.weight.add_(1.0)
    torch.testing.assert_close(m.head.weight.full_tensor(), before + 1.0)
    torch.testing.assert_close(old.detach(), before)


def test_tied_parameters_stay_tied(p1):
    m = net()
    m.blocks[1].up.weight = m.blocks[0].up.weight
    gnn.distribute_module(m, p1, {"*.up.weight": S(0)})
    assert m.blocks[1].up.weight is m.blocks[0].up.weight
    assert len(list(m.parameters())) == len(list(net().parameters())) - 1
    with pytest.raises(ValueError, match="same tensor"):
        m2 = net()
        m2.blocks[1].up.weight = m2.blocks[0].up.weight
        gnn.distribute_module(m2, p1, {"blocks.0.up.weight": S(0)})


def test_forward_and_backward_match_single_device(p2):
    ref, m = net().double(), net().double()
    gnn.distribute_module(m, p2, MEGATRON_2D)
    x = torch.randn(8, 6, dtype=torch.float64)
    ref(x).square().sum().backward()
    out = m(gt.distribute(x, p2, (S(0), B)))
    torch.testing.assert_close(out.full_tensor(), ref(x), **TOL)
    out.square().sum().backward()
    for (name, prm), want in zip(m.named_parameters(), ref.parameters()):
        assert prm.grad.sbp == prm.sbp, name
        torch.testing.assert_close(prm.grad.full_tensor(), want.grad, **TOL, msg=name)


def test_redistributing_a_global_module(p1, p2):
    m = net()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    gnn.distribute_module(m, p1, MEGATRON_1D)
    gnn.distribute_module(m, p2, MEGATRON_2D)
    assert m.blocks[0].up.weight.sbp == (B, S(0)) and m.blocks[0].up.weight.placement == p2
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), want[k])


# -- state_dict ----------------------------------------------------------------------------------
def test_state_dict_holds_global_tensors_and_round_trips(p2):
    m = net()
    gnn.distribute_module(m, p2, MEGATRON_2D)
    sd = m.state_dict()
    params = dict(m.named_parameters())
    for k, v in sd.items():
        assert isinstance(v, GlobalTensor), k
        if k in params:
            assert v.sbp == params[k].sbp, k
    saved = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for prm in m.parameters():
            prm.mul_(0.0)
    assert m.blocks[0].up.weight.full_tensor().abs().sum() == 0
    result = m.load_state_dict(saved)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), saved[k].full_tensor(), rtol=0, atol=0)
    assert m.blocks[0].up.weight.sbp == (B, S(0)), "loading keeps the parameter's own layout"


def test_load_state_dict_across_layouts_and_from_and_to_plain(p1, p2):
    plain = net(seed=1)
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    tp = net(seed=2)
    gnn.distribute_module(tp, p1, MEGATRON_1D)
    tp.load_state_dict(plain.state_dict())                    # plain -> global: taken as broadcast
    hybrid = net(seed=3)
    gnn.distribute_module(hybrid, p2, MEGATRON_2D)
    hybrid.load_state_dict(gnn.full_state_dict(tp))          # gathered, then re-laid out
    assert hybrid.blocks[0].up.weight.sbp == (B, S(0))
    other = net(seed=4)
    gnn.distribute_module(other, p2, {})
    other.load_state_dict(hybrid.state_dict())                # global (B, S(0)) -> global (B, B)
    back = net(seed=5)
    back.load_state_dict(gnn.full_state_dict(other))          # global -> a single-device module
    for k, v in back.state_dict().items():
        assert not isinstance(v, GlobalTensor)
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)


# -- optimizers ----------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01, eps=1e-6)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, eps=1e-6, weight_decay=0.1)),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["1d-megatron", "2x2-megatron"])
def test_optimizers_work_unchanged(world4, name, foreach, layout):
    placement = gt.placement("cpu", [0, 1, 2, 3] if layout == "1d-megatron" else [[0, 1], [2, 3]])
    plan = MEGATRON_1D if layout == "1d-megatron" else MEGATRON_2D
    batch = B if layout == "1d-megatron" else (S(0), B)
    cls, kw = OPTIMIZERS[name]
    ref, m = net().double(), net().double()
    gnn.distribute_module(m, placement, plan)
    opt_ref = cls(ref.parameters(), foreach=foreach, **kw)
    opt = cls(m.parameters(), foreach=foreach, **kw)
    train_net_side_by_side(ref, m, opt_ref, opt, placement, batch, steps=3)
    for (pname, prm), want in zip(m.named_parameters(), ref.parameters()):
        assert prm.grad is None
        torch.testing.assert_close(prm.full_tensor(), want, **TOL, msg=pname)
        for key, value in opt.state[prm].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert isinstance(value, GlobalTensor) and value.sbp == prm.sbp, (pname, key)
    w = m.blocks[0].up.weight                                    # [10, 6], rows split on the tensor axis
    rows = [3, 3, 2, 2] if layout == "1d-megatron" else [5, 5, 5, 5]
    assert [tuple(t.shape) for t in w.local_tensors().values()] == [(n, 6) for n in rows]
    states = [v for v in opt.state[w].values() if isinstance(v, GlobalTensor)]
    assert states, "the optimizer keeps a global state for the parameter"
    for v in states:                                             # and it is sharded like the parameter
        assert [tuple(t.shape) for t in v.local_tensors().values()] == [(n, 6) for n in rows]


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["S(0)", 0, None, {"weight": S(0)}, (S(0), "B"), (), nn.Linear])
def test_unknown_plan_entry_types_raise_type_error_naming_the_pattern(p2, entry):
    with pytest.raises(TypeError, match=r"plan\['\*\.up\.weight'\]"):
        gnn.distribute_module(net(), p2, {"*.down.weight": (B, S(1)), "*.up.weight": entry})


def test_errors(p1, p2):
    with pytest.raises(TypeError, match="pattern must be a str"):
        gnn.distribute_module(net(), p1, {0: S(0)})
    with pytest.raises(TypeError, match="mapping"):
        gnn.distribute_module(net(), p1, "*.weight")
    with pytest.raises(TypeError, match="pairs"):
        gnn.distribute_module(net(), p1, [("*.weight", S(0), "extra")])
    with pytest.raises(TypeError, match="placement"):
        gnn.distribute_module(net(), [0, 1, 2, 3], {})
    with pytest.raises(TypeError, match="nn.Module"):
        gnn.distribute_module(torch.zeros(3), p1, {})
    with pytest.raises(ValueError, match=r"plan\['\*\.up\.weight'\].*2 SBP value"):
        gnn.distribute_module(net(), p2, {"*.up.weight": S(0)})          # a bare SBP on a 2-D placement
    with pytest.raises(ValueError, match=r"plan\['\*\.bias'\].*blocks\.0\.up\.bias.*out of range"):
        gnn.distribute_module(net(), p1, {"*.bias": S(1)})              # biases are 1-D
    with pytest.raises(ValueError, match=r"plan\['\*\.up\.weight'\].*partial_sum"):
        gnn.distribute_module(net(), p1, {"*.up.weight": P})
    with pytest.raises(ValueError, match=r"\['\*\.qkv\.weight'\] match no parameter"):
        gnn.distribute_module(net(), p1, {"*.up.weight": S(0), "*.qkv.weight": S(0)})
    m = net()
    gnn.distribute_module(m, p1, {"*.qkv.weight": S(0)}, strict=False)
    assert m.blocks[0].up.weight.sbp == (B,)


def test_a_failed_plan_leaves_the_module_untouched(p1):
    m = net()
    with pytest.raises(ValueError):
        gnn.distribute_module(m, p1, {"head.weight": S(0), "*.bias": S(3)})
    assert not any(isinstance(t, GlobalTensor) for t in m.state_dict().values())
