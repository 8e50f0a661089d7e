"""Convolutions: ``convolution`` (what conv1d/2d/3d and conv_transpose reach) and
``convolution_backward``.

``convolution(x [N, Cin, *sp], w, bias [Cout]?, stride, padding, dilation, transposed,
output_padding, groups) -> [N, Cout, *sp']``; ``w`` is ``[Cout, Cin/groups, *k]``, or
``[Cin, Cout/groups, *k]`` when ``transposed``. Candidates, one axis:

- batch split: ``S(0), B, [B] -> S(0)`` (any groups).
- output channels split (groups == 1): ``B, S(o), [S(0)] -> S(1)``, ``o`` the weight's
  output-channel dim (0, or 1 when transposed).
- input channels split (groups == 1): ``S(1), S(i), [P] -> P``: each rank convolves its own
  channels; the bias is added once over the ranks (``B -> P`` keeps it on one rank).
- linear in the input or in the weight: ``P, B, [P] -> P`` and ``B, P, [P] -> P``.

A spatial split would need halo exchange between neighbours, which no single local op gives,
so there is none: such an input is boxed to one of the above.

``convolution_backward(grad_out, x, w, bias_sizes, ..., output_mask) -> (grad_x, grad_w,
grad_bias)``, where ``output_mask`` drops outputs (they come back as None, and take no slot in
the signature):

- batch split: ``S(0), S(0), B -> S(0), P, P`` (weight and bias gradients sum over the batch).
- output channels split: ``S(1), B, S(o) -> P, S(o), S(0)`` (each rank's channels add their
  part to grad_x); ``bias_sizes`` becomes the rank's own channel count (``local``).
- input channels split: ``B, S(1), S(i) -> S(1), S(i), B`` (every rank sums the whole grad_out
  for the bias gradient).
- linear in grad_out: ``P, B, B -> P, P, P``.

A rank whose pieces hold no channels or no samples does not call the op (the CPU kernels
reject a weight with zero channels); it makes its pieces itself: empty ones, zeros for a
gradient it has no part in, the bias and the bias gradient where they still have values.
"""
from __future__ import annotations

import math

import torch

from ..registry import aten, register_rule
from .common import B, P, S, bind, sig

_FWD = aten.convolution.default
_BWD = aten.convolution_backward.default




def _weight_dims(transposed: bool) -> tuple:
    """(output-channel dim, input-channel dim) of the weight."""
    return (1, 0) if transposed else (0, 1)


def _conv_candidates(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    b = bias is not None
    cands = [sig([S(0), B] + [B] * b, [S(0)])]
    if groups == 1:
        w_out, w_in = _weight_dims(transposed)
        cands.append(sig([B, S(w_out)] + [S(0)] * b, [S(1)]))
        cands.append(sig([S(1), S(w_in)] + [P] * b, [P]))
    cands.append(sig([P, B] + [P] * b, [P]))
    cands.append(sig([B, P] + [P] * b, [P]))
    return cands


def _conv_kernel(func, args, kwargs, ins, outs, calls):
    results = {}
    for r, (a, kw) in calls.items():
        n = bind(func, a, kw)
        x, w, bias = n["input"], n["weight"], n["bias"]
        shape = outs[0].piece_shape(r)
        if math.prod(shape) == 0:
            results[r] = torch.empty(shape, dtype=outs[0].dtype, device=x.device)
        elif x.numel() == 0 or w.numel() == 0:
            # no input channels here: the convolution is zero, plus the bias
            out = torch.zeros(shape, dtype=outs[0].dtype, device=x.device)
            results[r] = out if bias is None else out + bias.view([1, -1] + [1] * (len(shape) - 2))
        else:
            results[r] = func(*a, **kw)
    return results


def _backward_candidates(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def pick(three):
        return [v for v, wanted in zip(three, output_mask) if wanted]
    cands = [sig([S(0), S(0), B], pick([S(0), P, P]))]
    if groups == 1:
        w_out, w_in = _weight_dims(transposed)
        cands.append(sig([S(1), B, S(w_out)], pick([P, S(w_out), S(0)])))
        cands.append(sig([B, S(1), S(w_in)], pick([S(1), S(w_in), B])))
    cands.append(sig([P, B, B], pick([P, P, P])))
    return cands


def _backward_local(rank, ins, outs, *args, **kwargs):
    """``bias_sizes`` is the rank's own number of output channels."""
    n = bind(_BWD, args, kwargs)
    sizes = n["bias_sizes"]
    channels = n["grad_output"].shape[1]
    if sizes is None or list(sizes) == [channels]:
        return args, kwargs
    args = list(args)
    if len(args) > 3:
        args[3] = [channels]
    else:
        kwargs = dict(kwargs, bias_sizes=[channels])
    return tuple(args), kwargs


def _backward_kernel(func, args, kwargs, ins, outs, calls):
    results = {}
    for r, (a, kw) in calls.items():
        n = bind(func, a, kw)
        g, x, w = n["grad_output"], n["input"], n["weight"]
        if g.numel() and x.numel() and w.numel():
            results[r] = func(*a, **kw)
            continue
        grads = (torch.zeros_like(x), torch.zeros_like(w), g.sum([d for d in range(g.dim()) if d != 1]))
        results[r] = tuple(t if wanted else None for t, wanted in zip(grads, n["output_mask"]))
    return results


register_rule(_FWD, _conv_candidates, kernel=_conv_kernel)
register_rule(_BWD, _backward_candidates, local=_backward_local, kernel=_backward_kernel)
