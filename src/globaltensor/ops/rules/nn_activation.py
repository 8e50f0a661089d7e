"""Layer norm, group norm, activations and dropout (softmax is in softmax.py).

native_layer_norm normalises over the trailing ``normalized_shape`` dims: a split of a
leading dim passes through to the output and to mean / rstd (which keep the leading dims),
with weight and bias broadcast. In native_layer_norm_backward the input gradient keeps that
split, while the weight and bias gradients sum over the leading dims, so over a split leading
dim they are partial sums: ``S(d), S(d), S(d), S(d), B, B -> S(d), P, P``. Every output is
linear in the incoming gradient: ``P, B, B, B, B, B -> P, P, P``. The outputs are (grad_input,
grad_weight, grad_bias), each None (no tensor, no slot) where ``output_mask`` leaves it out
or the weight / bias is absent; the rule asks the op on the meta arguments which are there.

native_group_norm normalises each sample over its group of channels and all of its other
dims, so only a split of the batch dim passes through: ``S(0), B, B -> S(0), S(0), S(0)``
(mean and rstd are ``[N, group]``). The op takes the batch size ``N`` as an argument, which
``local`` replaces by the rank's piece's. native_group_norm_backward is as the layer norm's:
``S(0), S(0), S(0), S(0), B -> S(0), P, P`` and linear in the incoming gradient.

Activations need nothing here: gelu / relu / silu / tanh / sigmoid carry the ``pointwise``
tag, and their backward ops (threshold_backward, gelu_backward, silu_backward,
tanh_backward, sigmoid_backward) are registered in pointwise.py.

Dropout draws its mask from the sharding-invariant generator (ops/rng.py): element ``i``
(row-major in the logical tensor) is kept when ``uniform(seed, offset + i) < 1 - p``, so the
logical mask is the same for every placement, SBP and number of ranks, and each rank hashes
only the positions of its own piece (its box, or a head-tail piece's chunks). On CUDA ``F.dropout``
reaches ``native_dropout``; on CPU it reaches ``empty_like(x).bernoulli_(1 - p)``, ``div_`` and ``mul`` -- both paths
draw the same mask for the same seed. A rule's candidates cannot draw random numbers (the
aten op on a piece would use torch's generator, different on every rank and blind to the
piece's place), so these ops run through a ``kernel``: it is called once per call, reserves
the call's counters with ``rng.next_offset(numel)`` -- once, in every process, whether or not
it holds a rank of the placement, so all processes keep the same counter -- and makes each
held rank's piece from its box. A ``generator=`` argument is ignored: the random stream is
the one ``gt.manual_seed`` seeds. native_dropout_backward (``grad * mask * scale``) is
pointwise and linear in the gradient.
"""
from __future__ import annotations

import torch

from ...sbp import numel
from .. import rng
from ..registry import aten, register_rule
from ..schema.op_record import record
from .common import B, P, S, bind, sig, with_arg
from .pointwise import pointwise_candidates


# -- layer norm ------------------------------------------------------------------------------

@register_rule(aten.native_layer_norm.default)
def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    affine = [B for t in (weight, bias) if t is not None]
    return [sig([S(d)] + affine, [S(d)] * 3) for d in range(x.dim() - len(normalized_shape))]


@register_rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    present = [t is not None for t in aten.native_layer_norm_backward.default(
        grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask)]
    affine = [B for t in (weight, bias) if t is not None]
    cands = []
    for d in range(x.dim() - len(normalized_shape)):
        outs = [S(d), P, P]
        cands.append(sig([S(d)] * 4 + affine, [v for v, there in zip(outs, present) if there]))
    cands.append(sig([P, B, B, B] + affine, [P] * sum(present)))
    return cands


# -- group norm ------------------------------------------------------------------------------

def _local_batch(op, x_index: int):
    """Give ``op`` the batch size ``N`` of this rank's piece of its tensor input ``x_index``."""
    def local(rank, ins, outs, *args, **kwargs):
        return with_arg(op, args, kwargs, "N", ins[x_index].piece_shape(rank)[0])
    return local


def _group_norm(x, weight, bias, *args, **kwargs):
    return [sig([S(0)] + [B for t in (weight, bias) if t is not None], [S(0)] * 3)]


def _group_norm_backward(grad_out, x, mean, rstd, weight, *args, **kwargs):
    present = [t is not None for t in aten.native_group_norm_backward.default(
        grad_out, x, mean, rstd, weight, *args, **kwargs)]
    affine = [B] if weight is not None else []
    split = [v for v, there in zip([S(0), P, P], present) if there]
    return [sig([S(0)] * 4 + affine, split), sig([P, B, B, B] + affine, [P] * sum(present))]


register_rule(aten.native_group_norm.default, _group_norm, local=_local_batch(aten.native_group_norm.default, 0))
register_rule(aten.native_group_norm_backward.default, _group_norm_backward,
              local=_local_batch(aten.native_group_norm_backward.default, 1))


# -- dropout ---------------------------------------------------------------------------------

def _uniform(layout, rank, offset, device) -> torch.Tensor:
    """U[0, 1) (float32, 24 bits) for the elements of ``rank``'s piece of ``layout``."""
    return rng.uniform(rng.piece_positions(layout, rank, device), offset, torch.float32)


def _native_dropout_candidates(input, p, train):
    return [sig([S(d)], [S(d), S(d)]) for d in range(input.dim())] + [sig([P], [P, B])]


def _native_dropout_kernel(func, args, kwargs, ins, outs, calls):
    a = bind(func, args, kwargs)
    p, train = a["p"], a["train"]
    out_layout, mask_layout = outs
    if train is False or numel(mask_layout.shape) == 0:
        return {r: func(*ra, **rkw) for r, (ra, rkw) in calls.items()}
    offset = rng.next_offset(numel(mask_layout.shape))
    keep_p = 1.0 - p
    scale = 0.0 if keep_p == 0 else 1.0 / keep_p
    results = {}
    for r, (ra, rkw) in calls.items():
        x = bind(func, ra, rkw)["input"]
        mask = _uniform(mask_layout, r, offset, x.device) < keep_p
        results[r] = (x.mul(mask).mul_(scale), mask)
    return results


register_rule(aten.native_dropout.default, _native_dropout_candidates, kernel=_native_dropout_kernel, any_order=True)


@register_rule(aten.native_dropout_backward.default)
def _native_dropout_backward(grad_output, mask, scale):
    return pointwise_candidates([grad_output, mask], grad_output.dim(), tuple(grad_output.shape)) + [
        sig([P, B], [P])]


def _bernoulli_kernel(func, args, kwargs, ins, outs, calls):
    """``bernoulli(self, p)``: 1 where ``uniform < p`` (``p`` a float, a tensor, or ``self``'s values)."""
    layout = outs[0]
    offset = rng.next_offset(numel(layout.shape))
    in_place = record(func).in_place
    results = {}
    for r, (ra, rkw) in calls.items():
        a = bind(func, ra, rkw)
        x = a["self"]
        prob = a.get("p", x)
        drawn = (_uniform(layout, r, offset, x.device) < prob).to(x.dtype)
        results[r] = x.copy_(drawn) if in_place else drawn
    return results


def _values_unused(self, *args, **kwargs):
    """``self`` gives only the shape: a split passes through; a partial ``self`` gives B."""
    return [sig([S(d)], [S(d)]) for d in range(self.dim())] + [sig([P], [B])]


def _values_kept(self, *args, **kwargs):
    """``self`` holds the probabilities: a split passes through."""
    return [sig([S(d)], [S(d)]) for d in range(self.dim())]


def _probability_tensor(self, p, *args, **kwargs):
    """A tensor ``p`` broadcast against ``self``: the pointwise rule, output shaped as ``self``."""
    return pointwise_candidates([self, p], self.dim(), tuple(self.shape))


register_rule([aten.bernoulli.p, aten.bernoulli_.float], _values_unused, kernel=_bernoulli_kernel, any_order=True)
register_rule(aten.bernoulli.default, _values_kept, kernel=_bernoulli_kernel, any_order=True)
register_rule([aten.bernoulli.Tensor, aten.bernoulli_.Tensor], _probability_tensor, kernel=_bernoulli_kernel,
              any_order=True)
