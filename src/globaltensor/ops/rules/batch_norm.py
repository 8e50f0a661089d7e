"""Batch normalisation: ``native_batch_norm``, the ``_native_batch_norm_legit*`` family and
``native_batch_norm_backward``, in training and in eval.

Per placement axis, the input ``[N, C, *spatial]`` may be

- split along the batch or a spatial dim (``S(d)``, ``d != 1``): each rank holds every channel
  of some positions. Training statistics are per-channel sums over all positions, so each rank
  sums its own and the per-channel sums are all-reduced -- SyncBatchNorm's communication, a
  few floats per channel, never the activations: the mean (``C`` floats), then the sum of
  squared deviations from it (``C`` floats; two passes, as stable as one device's). The
  output keeps the input's split; the saved mean and inverse std, the weight, bias and
  running statistics are broadcast (the running statistics are updated from the reduced
  statistics, so they equal one device's). The backward all-reduces ``sum(grad)`` and
  ``sum(grad * x_hat)`` per channel (``2C`` floats, one collective) and gives the weight and
  bias gradients broadcast. In eval the running statistics normalise each piece with no
  communication; the weight and bias gradients are then partial sums.
- split along the channel dim (``S(1)``): the channels are independent; the per-channel
  tensors are ``S(0)`` and nothing is communicated.
- broadcast: everything broadcast.

The ops run through a ``kernel``: each rank's pieces are normalised with statistics reduced
over the placement (``kernel`` is called once per call, so the reductions are collectives
every rank issues in the same order).
"""
from __future__ import annotations

import torch

from ...boxing import Layout
from ...sbp import broadcast, partial_sum
from ...tensor import GlobalTensor, box
from ..registry import aten, register_rule
from .common import B, P, S, bind, sig

_TENSORS = ("input", "weight", "bias", "running_mean", "running_var")
_FORWARD = [aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
            aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
            aten._native_batch_norm_legit_functional.default]
_BACKWARD_TENSORS = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_invstd")


def _training(op, a: dict) -> bool:
    return a.get("training", a.get("train", False)) if op is not aten._native_batch_norm_legit_no_training.default \
        else False


def _forward_candidates(op):
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x = a["input"]
        present = [n for n in _TENSORS if isinstance(a.get(n), torch.Tensor)]
        n_out = 5 if op is aten._native_batch_norm_legit_functional.default else 3
        out = []
        for d in [0] + list(range(2, x.dim())):
            out.append(sig([S(d)] + [B] * (len(present) - 1), [S(d)] + [B] * (n_out - 1)))
        if x.dim() >= 2:
            out.append(sig([S(1)] + [S(0)] * (len(present) - 1), [S(1)] + [S(0)] * (n_out - 1)))
        return out
    return rule


def _backward_candidates(*args, **kwargs):
    a = bind(aten.native_batch_norm_backward.default, args, kwargs)
    x = a["input"]
    present = [n for n in _BACKWARD_TENSORS if isinstance(a.get(n), torch.Tensor)]
    mask = list(a["output_mask"])
    n_params = sum(mask[1:])
    out = []
    for d in [0] + list(range(2, x.dim())):
        params = B if a["train"] else P         # eval: each rank's positions give a partial sum
        out.append(sig([S(d), S(d)] + [B] * (len(present) - 2), [S(d)] * mask[0] + [params] * n_params))
    if x.dim() >= 2:
        out.append(sig([S(1), S(1)] + [S(0)] * (len(present) - 2), [S(1)] * mask[0] + [S(0)] * n_params))
    return out


def _stats_layout(x_layout: Layout, shape: tuple, dtype) -> tuple:
    """The layout of per-channel sums ``[k, C]`` of the local pieces -- partial where positions are
    split, ``S(1)`` where channels are, broadcast elsewhere -- and that with the partial sums reduced."""
    partial = tuple((S(1) if v.dim == 1 else partial_sum) if v.is_split else broadcast for v in x_layout.nd_sbp)
    reduced = tuple(broadcast if v.is_partial else v for v in partial)
    lay = Layout(shape, dtype, x_layout.placement, partial)
    return lay, lay.with_sbp(reduced)


def _all_reduce(pieces: dict, x_layout: Layout, shape: tuple) -> dict:
    """Per-channel local sums (``{rank: [k, C_r]}``) summed over the ranks splitting the positions."""
    dtype = next(iter(pieces.values())).dtype if pieces else x_layout.dtype
    src, dst = _stats_layout(x_layout, shape, dtype)
    if src == dst:
        return pieces
    return box(GlobalTensor(src, pieces), dst)._pieces


def _channel_shape(x: torch.Tensor) -> list:
    return [1, -1] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list:
    return [0] + list(range(2, x.dim()))


def _forward_kernel(func, args, kwargs, ins, outs, calls):
    ga = bind(func, args, kwargs)
    x_layout = ins[0]
    if not _training(func, ga):
        return {r: _eval_pieces(func, bind(func, ra, rkw)) for r, (ra, rkw) in calls.items()}
    channels, eps, momentum = x_layout.shape[1], ga["eps"], ga["momentum"]
    count = _numel(x_layout.shape) // max(channels, 1)
    local = {r: bind(func, ra, rkw) for r, (ra, rkw) in calls.items()}
    acc = {r: torch.float64 if a["input"].dtype == torch.float64 else torch.float32 for r, a in local.items()}
    sums = _all_reduce({r: a["input"].to(acc[r]).sum(_reduce_dims(a["input"]))[None] for r, a in local.items()},
                       x_layout, (1, channels))
    means = {r: sums[r][0] / count for r in local}
    squares = _all_reduce({r: ((a["input"].to(acc[r]) - means[r].reshape(_channel_shape(a["input"]))) ** 2)
                           .sum(_reduce_dims(a["input"]))[None] for r, a in local.items()}, x_layout, (1, channels))
    results = {}
    for r, a in local.items():
        x = a["input"]
        var = squares[r][0] / count
        invstd = torch.rsqrt(var + eps)
        shape = _channel_shape(x)
        y = (x.to(acc[r]) - means[r].reshape(shape)) * invstd.reshape(shape)
        if a.get("weight") is not None:
            y = y * a["weight"].reshape(shape)
        if a.get("bias") is not None:
            y = y + a["bias"].reshape(shape)
        new_stats = _running_update(a, means[r], var, count, momentum,
                                    in_place=func is not aten._native_batch_norm_legit_functional.default)
        mean_out, invstd_out = means[r].to(x.dtype), invstd.to(x.dtype)
        result = (y.to(x.dtype), mean_out, invstd_out)
        if func is aten._native_batch_norm_legit_functional.default:
            result = result + new_stats
        results[r] = result
    return results


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _running_update(a: dict, mean, var, count: int, momentum: float, in_place: bool) -> tuple:
    """New running statistics (the unbiased variance, as torch keeps), written ``in_place`` (the
    functional op returns them instead)."""
    rm, rv = a.get("running_mean"), a.get("running_var")
    if rm is None or rv is None:
        return ()
    unbiased = var * (count / max(count - 1, 1))
    new_mean = (1 - momentum) * rm + momentum * mean.to(rm.dtype)
    new_var = (1 - momentum) * rv + momentum * unbiased.to(rv.dtype)
    if in_place:
        with torch.no_grad():
            rm.copy_(new_mean)
            rv.copy_(new_var)
    return new_mean, new_var


def _eval_pieces(func, a: dict) -> tuple:
    """Eval: the running statistics normalise each piece; the saved mean / inverse std are them."""
    x, rm, rv, eps = a["input"], a["running_mean"], a["running_var"], a["eps"]
    shape = _channel_shape(x)
    invstd = torch.rsqrt(rv + eps)
    y = (x - rm.reshape(shape)) * invstd.reshape(shape)
    if a.get("weight") is not None:
        y = y * a["weight"].reshape(shape)
    if a.get("bias") is not None:
        y = y + a["bias"].reshape(shape)
    out = (y.to(x.dtype), rm.clone(), invstd)
    if func is aten._native_batch_norm_legit_functional.default:
        out = out + (rm.clone(), rv.clone())
    return out


def _backward_kernel(func, args, kwargs, ins, outs, calls):
    ga = bind(func, args, kwargs)
    x_layout = ins[1]
    channels = x_layout.shape[1]
    count = _numel(x_layout.shape) // max(channels, 1)
    mask = list(ga["output_mask"])
    local = {r: bind(func, ra, rkw) for r, (ra, rkw) in calls.items()}
    if ga["train"]:
        mean = {r: a["save_mean"] for r, a in local.items()}
        invstd = {r: a["save_invstd"] for r, a in local.items()}
    else:
        mean = {r: a["running_mean"] for r, a in local.items()}
        invstd = {r: torch.rsqrt(a["running_var"] + ga["eps"]) for r, a in local.items()}
    xhat = {r: (a["input"] - mean[r].reshape(_channel_shape(a["input"]))) * invstd[r].reshape(
        _channel_shape(a["input"])) for r, a in local.items()}
    sums = {r: torch.stack([a["grad_out"].sum(_reduce_dims(a["grad_out"])),
                            (a["grad_out"] * xhat[r]).sum(_reduce_dims(a["grad_out"]))]) for r, a in local.items()}
    if ga["train"]:
        sums = _all_reduce(sums, x_layout, (2, channels))
    results = {}
    for r, a in local.items():
        g, shape = a["grad_out"], _channel_shape(a["grad_out"])
        w = a["weight"].reshape(shape) if a.get("weight") is not None else 1
        sum_g, sum_gx = sums[r][0].reshape(shape), sums[r][1].reshape(shape)
        if ga["train"]:
            grad_in = w * invstd[r].reshape(shape) * (g - sum_g / count - xhat[r] * sum_gx / count)
        else:
            grad_in = g * w * invstd[r].reshape(shape)
        results[r] = (grad_in if mask[0] else None, sums[r][1] if mask[1] else None,
                      sums[r][0] if mask[2] else None)
    return results


for _op in _FORWARD:
    register_rule(_op, _forward_candidates(_op), kernel=_forward_kernel)
register_rule(aten.native_batch_norm_backward.default, _backward_candidates, kernel=_backward_kernel)
