"""Candidates from an einsum spec (ops/rules/contraction.py): mm's and bmm's are Megatron's, and for
products of every shape of spec -- outer, transposed, a dot product, a sum over two indices -- each
candidate, forced on its own (plain, blocked 2 ways, head-tail), gives one device's values."""
import pytest
import torch

import globaltensor as gt
from globaltensor.ops.registry import RULES
from globaltensor.ops.rules.contraction import contraction, plus_term
from globaltensor.sbp import as_signature
from harness import check_candidates


@torch.library.custom_op("gt_contraction_test::product", mutates_args=())
def product(a: torch.Tensor, b: torch.Tensor, spec: str) -> torch.Tensor:
    return torch.einsum(spec, a, b).clone()


product.register_fake(lambda a, b, spec: torch.einsum(spec, a, b))
OP = torch.ops.gt_contraction_test.product.default


def _sigs(texts):
    return [as_signature(t) for t in texts]


def test_mm_and_bmm_are_megatrons_column_row_and_linear_signatures():
    assert contraction("mk,kn->mn") == _sigs(["S(0), B -> S(0)", "B, S(1) -> S(1)", "S(1), S(0) -> P",
                                               "P, B -> P", "B, P -> P"])
    assert contraction("bmk,bkn->bmn") == _sigs(["S(0), S(0) -> S(0)", "S(1), B -> S(1)", "B, S(2) -> S(2)",
                                                  "S(2), S(1) -> P", "P, B -> P", "B, P -> P"])


def test_an_added_term_splits_with_the_output_where_it_has_the_dim_and_joins_a_partial_sum():
    bias_row, bias_col = torch.empty(5, device="meta"), torch.empty(3, 1, device="meta")
    mm = contraction("mk,kn->mn")
    assert [str(c.inputs[0]) for c in plus_term(bias_row, (3, 5), mm)] == ["B", "S(0)", "P", "P", "P"]
    assert [str(c.inputs[0]) for c in plus_term(bias_col, (3, 5), mm)] == ["S(0)", "B", "P", "P", "P"]


SPECS = {
    "mk,kn->mn": ((6, 8), (8, 4)),
    "bmk,bkn->bmn": ((4, 6, 8), (4, 8, 4)),
    "ik,jk->ij": ((6, 8), (4, 8)),
    "i,j->ij": ((8,), (4,)),
    "i,i->": ((8,), (8,)),
    "abc,cb->a": ((4, 8, 6), (6, 8)),
}


@pytest.fixture(scope="module")
def product_rule():
    gt.register_rule(OP, lambda a, b, spec: contraction(spec))
    yield
    RULES.pop(OP, None)


@pytest.mark.parametrize("spec", SPECS)
def test_every_candidate_of_a_spec_gives_one_devices_product_in_every_split_kind(product_rule, spec):
    shapes = SPECS[spec]
    a, b = (torch.randn(*s, dtype=torch.float64) for s in shapes)
    tol = dict(rtol=1e-12, atol=1e-12)          # float64, the same sums in another order
    assert check_candidates(OP, a, b, spec, **tol) > 0
    assert check_candidates(OP, a, b, spec, blocks=2, **tol) > 0
    check_candidates(OP, a, b, spec, head_tail=True, **tol)     # shapes whose chunks are uneven admit none
