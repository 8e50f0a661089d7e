"""FFTs (``_fft_c2c``, ``_fft_r2c``, ``_fft_c2r``: every ``torch.fft`` function comes apart into them).

A transform mixes the elements along the dims it transforms and nothing else, so a split of
any other dim stays (the output has the input's size there). It is linear over the reals --
the real-to-complex and complex-to-real transforms included -- so partial sums stay partial.
An empty piece (an uneven split) gets an empty result of its shape: the FFT backends reject
empty inputs.
"""
from __future__ import annotations

import torch

from ..registry import aten, register_rule
from .common import each_dim_kept, norm_dim


def _fft(x, dim, *rest, **kwargs):
    return each_dim_kept(x, linear=True, skip={norm_dim(d, x.dim()) for d in dim})


def _skip_empty(func, args, kwargs, in_layouts, out_layouts, calls) -> dict:
    out = out_layouts[0]
    results = {}
    for r, (a, kw) in calls.items():
        piece = a[0]
        results[r] = func(*a, **kw) if piece.numel() else \
            torch.empty(out.piece_shape(r), dtype=out.dtype, device=piece.device)
    return results


register_rule([aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default], _fft, kernel=_skip_empty)
