"""Random ops without a rule (torch tags them ``nondeterministic_seeded``) through the gather fallback
(ops/fallback.py): every replica draws, then every rank takes the draws of the placement's first
rank, so the broadcast result's replicas are equal -- and so is what such an op writes."""
import pytest
import torch
import torch.nn.functional as F
from torch._decomp import decomposition_table

import globaltensor as gt
from globaltensor.ops import fallback
from globaltensor.ops.registry import find_rule
from globaltensor.sbp import broadcast as B, split as S

aten = torch.ops.aten


def _noise(x):
    return torch.zeros(x.shape, dtype=x.dtype).to_global(placement=x.placement, sbp=B)


# name -> (the call on a global input x, the aten op it reaches the fallback as)
DRAWS = {
    "rrelu": (lambda x: F.rrelu(x, training=True), "rrelu_with_noise.default"),
    "rrelu_": (lambda x: F.rrelu(x * 1, training=True, inplace=True), "rrelu_with_noise_.default"),
    "rrelu_functional": (lambda x: aten.rrelu_with_noise_functional(x, _noise(x), 0.1, 0.3, True),
                         "rrelu_with_noise_functional.default"),
    "normal_functional": (lambda x: aten.normal_functional(x, 0.5, 2.0), "normal_functional.default"),
    # decomposed into a draw of a plain tensor, then taken by the fallback (executor/decompose.py)
    "uniform_functional": (lambda x: aten.uniform(x, -1.0, 1.0), "uniform.default"),
    "poisson": (lambda x: torch.poisson(x.abs() * 4), "poisson.default"),
    "binomial": (lambda x: torch.binomial(torch.full(x.shape, 9.0), x.sigmoid()), "binomial.default"),
    "sample_dirichlet": (lambda x: torch._sample_dirichlet(x.abs() + 0.5), "_sample_dirichlet.default"),
    "random": (lambda x: aten.random(x), "random.default"),
    "random_to": (lambda x: getattr(aten.random, "to")(x, 9), "random.to"),
    "random_from": (lambda x: getattr(aten.random, "from")(x, 2, 9), "random.from"),
    "random_": (lambda x: (x * 1).random_(), "random_.default"),
    "random__to": (lambda x: (x * 1).random_(9), "random_.to"),
    "random__from": (lambda x: (x * 1).random_(2, 9), "random_.from"),
    "multinomial": (lambda x: torch.multinomial(x.abs() + 0.1, 3), "multinomial.default"),
    "standard_gamma": (lambda x: torch._standard_gamma(x.abs() + 0.5), "_standard_gamma.default"),
    "rand_like_generator": (lambda x: aten.rand_like.generator(x, generator=torch.Generator().manual_seed(3)),
                            "rand_like.generator"),
    "randn_like_generator": (lambda x: aten.randn_like.generator(x, generator=torch.Generator().manual_seed(3)),
                             "randn_like.generator"),
    "randint_like_generator": (lambda x: aten.randint_like.generator(x, 9, generator=torch.Generator().manual_seed(3)),
                               "randint_like.generator"),
    "randint_like_tensor": (lambda x: aten.randint_like.Tensor(x, torch.tensor(9)), "randint_like.Tensor"),
    "randint_like_tensor_generator": (
        lambda x: aten.randint_like.Tensor_generator(x, torch.tensor(9), generator=torch.Generator().manual_seed(3)),
        "randint_like.Tensor_generator"),
    "randint_like_low_generator": (
        lambda x: aten.randint_like.low_generator_dtype(x, 2, 9, generator=torch.Generator().manual_seed(3)),
        "randint_like.low_generator_dtype"),
}

# seeded aten ops the fallback never meets drawing on a CPU placement: other devices' kernels and nested
# tensors, a backend choice that returns a number; and out= forms (taken by the same code as their
# functional form, which DRAWS covers)
NOT_ON_CPU = ("cudnn", "miopen", "flash_attention", "efficient_attention", "_for_mps", "_mps", "triton",
              "fused_attention_overrideable", "mem_eff", "nested_tensor", "_fused_sdp_choice")


def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet, None), overload, None)


def _available() -> list:
    return [n for n, (_, op) in DRAWS.items() if _op(op) is not None]


@pytest.mark.filterwarnings("ignore:globaltensor")
@pytest.mark.parametrize("sbp", [B, S(0)], ids=["B", "S0"])
@pytest.mark.parametrize("name", _available())
def test_replicas_of_a_random_fallback_result_are_equal(name, sbp):
    fn, op = DRAWS[name]
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        x = gt.distribute(torch.randn(8, 6), p, sbp)
        before = fallback.taken[_op(op)]
        with torch.no_grad():
            y = fn(x)
        assert fallback.taken[_op(op)] > before, f"{name} did not reach the fallback as {op}"
        in_place = _op(op).overloadpacket.__name__.endswith("_")
        for t in (y if isinstance(y, tuple) else (y,)):
            assert t.sbp == ((sbp,) if in_place else (B,)), "an in-place op keeps its tensor's layout"
            if t.sbp != (B,):
                continue
            pieces = t.local_tensors()
            for r, piece in pieces.items():
                assert torch.equal(piece, pieces[0]), f"{name} on {sbp}: rank {r}'s replica differs from rank 0's"


@pytest.mark.filterwarnings("ignore:globaltensor")
def test_what_a_random_fallback_op_writes_is_equal_on_every_rank():
    """``rrelu_with_noise`` writes its ``noise``: every rank keeps the first rank's."""
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        x = gt.distribute(torch.randn(8, 6), p, B)
        noise = _noise(x)
        with torch.no_grad():
            y = aten.rrelu_with_noise(x, noise, 0.1, 0.3, True)
        for t in (y, noise):
            pieces = t.local_tensors()
            assert all(torch.equal(pieces[r], pieces[0]) for r in pieces)
        negative = x.full_tensor() < 0
        torch.testing.assert_close(y.full_tensor()[negative], (x.full_tensor() * noise.full_tensor())[negative])


def test_a_random_fallback_draws_in_a_process_world(launch):
    job = launch("""
import torch, warnings, torch.nn.functional as F
import globaltensor as gt
warnings.simplefilter("ignore")
p = gt.placement("cpu", [0, 1])
torch.manual_seed(gt.rank())                   # each process's generator draws its own numbers
x = gt.distribute(torch.randn(8, 6), p, gt.sbp.broadcast)
y = F.rrelu(x, training=True)
mine = y.to_local()
both = mine.to_global(placement=p, sbp=gt.sbp.split(0)).full_tensor()
assert torch.equal(both[:8], both[8:]), "the ranks' replicas differ"
print("ok", gt.rank())
""", 2, timeout=120)
    assert job.stdout.count("ok") == 2, job.describe()


def test_every_seeded_op_the_fallback_meets_is_checked():
    """Every ``nondeterministic_seeded`` aten op that takes a tensor and has no rule, no decomposition
    and no composite kernel -- so the fallback is its path -- is in DRAWS (its out= form aside)."""
    checked = {DRAWS[n][1] for n in _available()}
    missing = []
    for full in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, rest = full.partition("::")
        name, _, overload = rest.partition(".")
        overload = overload or "default"
        op = getattr(getattr(aten, name, None), overload, None) if namespace == "aten" else None
        if op is None or torch.Tag.nondeterministic_seeded not in op.tags or find_rule(op) is not None \
                or op in decomposition_table or overload.endswith("out") \
                or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd") \
                or any(k in name for k in NOT_ON_CPU):
            continue
        arguments = op._schema.arguments
        if arguments and str(arguments[0].type) == "Tensor" and f"{name}.{overload}" not in checked:
            missing.append(f"{name}.{overload}")
    assert not missing, f"seeded ops the fallback can meet, unchecked: {missing}"

