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

The running statistics may also be partial sums (``P``) or split along the channel dim
(``S(0)``) on an axis where the input is split along the batch or broadcast, each
independently of the other (with a spatial split, the input or the statistics are boxed to
one of these first): the update ``r' = (1 - m) * r + m * s`` of a
running statistic ``r`` from the batch statistic ``s`` (full on every rank, reduced as above)
runs on each rank's piece of ``r``, with ``m * s`` laid out as ``r`` is -- sliced to the rank's
channels where ``r`` is split, kept by the first rank of the axis and zero on the others where
``r`` is partial, so the pieces still sum to the updated statistic. Nothing more is
communicated. Where eval needs them whole, the running statistics are boxed to the
per-channel layout first (an all-reduce of a partial one, an all-gather of a split one:
``C`` floats).

``native_batch_norm`` writes the running statistics in training though its schema does not
say so: the dispatcher may have boxed them into a copy, so the kernel puts the update back
into the caller's tensors (boxed to their layout) whenever the copy is not theirs.

The ops run through a ``kernel``: each rank's pieces are normalised with statistics reduced
over the placement (``kernel`` is called once per call, so the reductions are collectives
every rank issues in the same order).
"""
from __future__ import annotations

import torch

from ...boxing import Layout
from ...sbp import broadcast, numel, partial_sum
from ...tensor import GlobalTensor, box
from ..registry import aten, register_rule
from .common import B, P, S, bind, call_args, sig

_TENSORS = ("input", "weight", "bias", "running_mean", "running_var")
_FORWARD = [aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
            aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
            aten._native_batch_norm_legit_functional.default]
_BACKWARD_TENSORS = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_invstd")


def _training(op, a: dict) -> bool:
    return a.get("training", a.get("train", False)) if op is not aten._native_batch_norm_legit_no_training.default \
        else False


_RUNNING = (B, P, S(0))          # a running statistic's SBP on an axis where the channels are whole


def _per_axis(x_dim: int, running: tuple) -> list:
    """``(x sbp, {running statistic: sbp}, the other per-channel tensors' sbp)`` per axis: the
    input split along a batch or spatial dim with everything per-channel broadcast; the input
    split along the batch or broadcast (data parallelism) with the running statistics each in
    any of ``_RUNNING`` -- not with every spatial split too, which would square the nd
    candidates (36 per axis for 4-D inputs, 1296 on a 2x2 placement, against 20 and 400) for
    layouts a model hardly meets; or the input split along the channels, every per-channel
    tensor ``S(0)``."""
    stats = [(m, v) for m in _RUNNING for v in _RUNNING if (m, v) != (B, B)] if running else []
    out = [(S(d), dict.fromkeys(running, B), B) for d in [0] + list(range(2, x_dim))]
    out += [(xs, dict(zip(running, pair)), B) for xs in (S(0), B) for pair in stats]
    if x_dim >= 2:
        out.append((S(1), {n: S(0) for n in running}, S(0)))
    return out


def _running_names(a: dict) -> tuple:
    return tuple(n for n in ("running_mean", "running_var") if isinstance(a.get(n), torch.Tensor))


def _forward_candidates(op):
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x = a["input"]
        present = [n for n in _TENSORS if isinstance(a.get(n), torch.Tensor)]
        running = _running_names(a)
        functional = op is aten._native_batch_norm_legit_functional.default
        out = []
        for xs, stats, other in _per_axis(x.dim(), running):
            saved = S(0) if xs == S(1) else B
            outs = [xs, saved, saved] + ([stats.get(n, B) for n in ("running_mean", "running_var")]
                                         if functional else [])
            out.append(sig([xs] + [stats.get(n, other) for n in present[1:]], outs))
        return out
    return rule


def _backward_candidates(*args, **kwargs):
    a = bind(aten.native_batch_norm_backward.default, args, kwargs)
    x = a["input"]
    present = [n for n in _BACKWARD_TENSORS if isinstance(a.get(n), torch.Tensor)]
    mask = list(a["output_mask"])
    n_params = sum(mask[1:])
    out = []
    for xs, stats, other in _per_axis(x.dim(), _running_names(a)):
        if xs == S(1):
            params = S(0)
        elif xs == B:
            params = B
        else:
            params = B if a["train"] else P         # eval: each rank's positions give a partial sum
        out.append(sig([xs, xs] + [stats.get(n, other) for n in present[2:]], [xs] * mask[0] + [params] * n_params))
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


def _per_channel(x_layout: Layout, dtype) -> Layout:
    """A per-channel tensor ``[C]`` laid out as the input's channels are: ``S(0)`` where they are
    split, broadcast elsewhere (the layout of the batch statistics once reduced)."""
    nd = tuple(S(0) if v.is_split and v.dim == 1 else broadcast for v in x_layout.nd_sbp)
    return Layout((x_layout.shape[1],), dtype, x_layout.placement, nd)


def _relayout(pieces: dict, src: Layout, dst: Layout) -> dict:
    """``{rank: piece}`` of ``src`` boxed to ``dst``."""
    if src == dst:
        return pieces
    return box(GlobalTensor(src, pieces), dst)._pieces


def _layouts(func, args, kwargs, ins) -> dict:
    """The layout each tensor argument runs in, by name."""
    named = bind(func, args, kwargs)
    return dict(zip([n for n, v in named.items() if isinstance(v, torch.Tensor)], ins))


def _running_whole(local: dict, layouts: dict, x_layout: Layout, name: str) -> dict:
    """Each rank's pieces of running statistic ``name`` in the per-channel layout eval needs."""
    lay = layouts[name]
    return _relayout({r: a[name] for r, a in local.items()}, lay, _per_channel(x_layout, lay.dtype))


def _forward_kernel(func, args, kwargs, ins, outs, calls):
    ga = bind(func, args, kwargs)
    x_layout, layouts = ins[0], _layouts(func, args, kwargs, ins)
    local = {r: bind(func, ra, rkw) for r, (ra, rkw) in calls.items()}
    running = [n for n in ("running_mean", "running_var") if n in layouts]
    if not _training(func, ga):
        whole = {n: _running_whole(local, layouts, x_layout, n) for n in running}
        return {r: _eval_pieces(func, a, *(whole[n][r] for n in running)) for r, a in local.items()}
    channels, eps, momentum = x_layout.shape[1], ga["eps"], ga["momentum"]
    count = numel(x_layout.shape) // max(channels, 1)
    acc = {r: torch.float64 if a["input"].dtype == torch.float64 else torch.float32 for r, a in local.items()}
    sums = _all_reduce({r: a["input"].to(acc[r]).sum(_reduce_dims(a["input"]))[None] for r, a in local.items()},
                       x_layout, (1, channels))
    means = {r: sums[r][0] / count for r in local}
    squares = _all_reduce({r: ((a["input"].to(acc[r]) - means[r].reshape(_channel_shape(a["input"]))) ** 2)
                           .sum(_reduce_dims(a["input"]))[None] for r, a in local.items()}, x_layout, (1, channels))
    variances = {r: squares[r][0] / count for r in local}
    results = {}
    for r, a in local.items():
        x = a["input"]
        invstd = torch.rsqrt(variances[r] + eps)
        shape = _channel_shape(x)
        y = (x.to(acc[r]) - means[r].reshape(shape)) * invstd.reshape(shape)
        if a.get("weight") is not None:
            y = y * a["weight"].reshape(shape)
        if a.get("bias") is not None:
            y = y + a["bias"].reshape(shape)
        results[r] = (y.to(x.dtype), means[r].to(x.dtype), invstd.to(x.dtype))
    if running:
        unbiased = {r: v * (count / max(count - 1, 1)) for r, v in variances.items()}
        functional = func is aten._native_batch_norm_legit_functional.default
        new = [_running_update({r: a[n] for r, a in local.items()}, layouts[n], batch, x_layout, momentum)
               for n, batch in zip(running, (means, unbiased))]
        if functional:
            results = {r: res + tuple(stat[r] for stat in new) for r, res in results.items()}
        else:
            for n, stat in zip(running, new):
                _write_running(ga[n], layouts[n], {r: a[n] for r, a in local.items()}, stat)
    return results


def _running_update(pieces: dict, layout: Layout, batch: dict, x_layout: Layout, momentum: float) -> dict:
    """``(1 - m) * r + m * s`` on each piece of the running statistic ``r`` (laid out as
    ``layout``) from the batch statistic ``s`` (``batch``: per-channel, reduced; the variance
    the unbiased one, as torch keeps): ``m * s`` is boxed into ``r``'s layout first -- sliced
    where ``r`` is split, kept by the first rank of the axis and zero on the others where it is
    partial -- so the new pieces sum to the new statistic."""
    term = _relayout({r: momentum * s.to(layout.dtype) for r, s in batch.items()},
                     _per_channel(x_layout, layout.dtype), layout)
    return {r: (1 - momentum) * t + term[r] for r, t in pieces.items()}


def _write_running(caller, layout: Layout, pieces: dict, new: dict) -> None:
    """Write the updated running statistic into the pieces the kernel was given, and into
    ``caller`` (the tensor the caller passed) when those were a boxed copy of it
    (``native_batch_norm``, whose schema does not say it writes them)."""
    with torch.no_grad():
        for r, t in pieces.items():
            t.copy_(new[r])
        if isinstance(caller, GlobalTensor) and caller._layout != layout:
            back = _relayout(new, layout, caller._layout)
            for r, t in caller._pieces.items():
                t.copy_(back[r])
        elif not isinstance(caller, GlobalTensor) and any(not v.is_broadcast for v in layout.nd_sbp):
            for t in _relayout(new, layout, layout.with_sbp((broadcast,) * len(layout.nd_sbp))).values():
                caller.copy_(t)            # a plain tensor stands for a broadcast one: every rank's value


def _eval_saved_on_cpu(op):
    """In eval the CPU kernel saves no statistics (``save_mean`` / ``save_invstd`` of shape ``[0]``),
    where the meta kernel (and CUDA's) gives ``[C]``: the output meta follows the device."""
    def out_meta(meta_out, device_type: str, *args, **kwargs):
        if device_type != "cpu" or _training(op, bind(op, args, kwargs)):
            return meta_out
        empty = [torch.empty(0, dtype=t.dtype, device="meta") for t in meta_out[1:3]]
        return (meta_out[0], *empty, *meta_out[3:])
    return out_meta


def _eval_pieces(func, a: dict, rm, rv) -> tuple:
    """Eval: the op itself on the piece, with the running statistics (``rm``, ``rv``) per-channel and
    whole for the piece's channels -- each position is normalised on its own, so this is one
    device's computation exactly (and its saved statistics, empty on CPU)."""
    args, kwargs = call_args(func, dict(a, running_mean=rm, running_var=rv))
    return func(*args, **kwargs)


def _backward_kernel(func, args, kwargs, ins, outs, calls):
    ga = bind(func, args, kwargs)
    x_layout = ins[1]
    channels = x_layout.shape[1]
    count = numel(x_layout.shape) // max(channels, 1)
    mask = list(ga["output_mask"])
    local = {r: bind(func, ra, rkw) for r, (ra, rkw) in calls.items()}
    if ga["train"]:
        mean = {r: a["save_mean"] for r, a in local.items()}
        invstd = {r: a["save_invstd"] for r, a in local.items()}
    else:
        layouts = _layouts(func, args, kwargs, ins)
        mean = _running_whole(local, layouts, x_layout, "running_mean")
        invstd = {r: torch.rsqrt(v + ga["eps"])
                  for r, v in _running_whole(local, layouts, x_layout, "running_var").items()}
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
    register_rule(_op, _forward_candidates(_op), kernel=_forward_kernel, out_meta=_eval_saved_on_cpu(_op))
register_rule(aten.native_batch_norm_backward.default, _backward_candidates, kernel=_backward_kernel)
