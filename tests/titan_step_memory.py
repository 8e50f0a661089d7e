"""The bytes torchtitan's Llama 3 holds at the peak of each phase of a training step, on CPU, as a
GPU's eager step would hold them: what ``gt.nn.plan_at_scale``'s memory model predicts.

:func:`step_phase_peaks` trains one step of torchtitan's own ``Llama3Model`` (examples/titan_models.py)
in bfloat16 under torchtitan's own activation checkpointing (``FullAC``, ``SelectiveAC`` or none),
with torchtitan's loss (the logits cast to float, cross entropy, the logits let go, backward), and
follows every storage the step's ops make -- the parameters, their gradients (made beforehand, so
that each new one is a temporary added in place), the buffers and the inputs held apart. It returns
the most bytes alive at once in each of three phases: the *forward* (the model's, to the logits),
the *loss* (the loss, its backward and the head's) and the *blocks* (the blocks' backwards, each
recomputing its forward where checkpointed).

Two kernels differ between a CPU and a GPU, and the step takes the GPU's:

- ``F.rms_norm`` on a CPU is torch's composite (its input cast to float32, its normalised value
  kept in float32 for the weight's gradient), where CUDA's fused kernel keeps the input and one
  float32 number a row: the norms run a stand-in that keeps what the fused kernel keeps, computing
  outside the followed ops as the fused kernel computes inside itself;
- CPU attention is ``_scaled_dot_product_flash_attention_for_cpu``, which torchtitan's selective
  policy does not list (it lists the CUDA kernels): it is saved as the CUDA flash kernel would be.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from globaltensor.nn.auto.cost import LiveBytes
from storage_peaks import FollowedStorages

PHASES = ("forward", "loss", "blocks")


class _Followed(FollowedStorages):
    """Every storage the ops within make (storage_peaks.py's ``FollowedStorages``, into auto_plan's
    ``LiveBytes``), and the peak of each phase (:data:`PHASES`), which the step sets but for
    ``blocks``: that begins at the first norm's backward (the final norm's, after the head's)."""

    def __init__(self, held):
        super().__init__(LiveBytes())
        for t in held:
            self.live.held(0, t, counted=False)
        self.phase = "forward"
        self.peaks = dict.fromkeys(PHASES, 0)

    def local(self, func, args, kwargs):
        out = super().local(func, args, kwargs)
        self._note_peak()
        return out

    def adopt(self, t: torch.Tensor) -> None:
        """``t`` was made outside the followed ops (a stand-in kernel's result): count it."""
        self.live.made(0, t)
        self._note_peak()

    def _note_peak(self) -> None:
        self.peaks[self.phase] = max(self.peaks[self.phase], self.live.now[0])


class _FusedRMSNorm(torch.autograd.Function):
    """RMS norm keeping what CUDA's fused kernel keeps for its backward: the input and the float32
    reciprocal root mean square of each row. Its arithmetic runs outside the followed ops, as a
    fused kernel's runs inside it; its results are counted."""

    @staticmethod
    def forward(ctx, x, weight, eps, followed):
        with _disable_current_modes():
            wide = x.to(_accumulated(x))
            rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
            out = (wide * rstd * weight.to(wide.dtype)).to(x.dtype)
        followed.adopt(rstd)
        followed.adopt(out)
        ctx.save_for_backward(x, weight, rstd)
        ctx.followed = followed
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        ctx.followed.phase = "blocks"
        with _disable_current_modes():
            wide = _accumulated(x)
            normed, g = x.to(wide) * rstd, grad.to(wide)
            gw = g * weight.to(wide)
            grad_x = (rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))).to(x.dtype)
            grad_w = (g * normed).flatten(0, -2).sum(0).to(weight.dtype)
        ctx.followed.adopt(grad_x)
        ctx.followed.adopt(grad_w)
        return grad_x, grad_w, None, None


def _accumulated(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused kernel computes ``x``'s norm in: float32 for bfloat16 and half, else x's."""
    return torch.promote_types(x.dtype, torch.float32)


class _SelectiveOnCPU(SelectiveAC):
    """torchtitan's selective policy, CPU attention saved as its CUDA kernels are."""

    def get_save_ops(self) -> set:
        return super().get_save_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _fused_norms(model: torch.nn.Module, followed: _Followed) -> None:
    """Each of ``model``'s RMS norms runs :class:`_FusedRMSNorm`."""
    def fused(norm):
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        return lambda x: _FusedRMSNorm.apply(x, norm.weight, eps, followed)
    for norm in model.modules():
        if isinstance(norm, torch.nn.RMSNorm):
            norm.forward = fused(norm)


def step_phase_peaks(model: torch.nn.Module, tokens: torch.Tensor, recompute: str) -> dict:
    """The peak bytes of each phase (:data:`PHASES`) of one step of ``model`` (torchtitan's
    ``Llama3Model``, bfloat16) on ``tokens`` (``[batch, seq + 1]``), its blocks checkpointed by
    torchtitan's ``recompute`` policy ("none", "selective" or "full")."""
    if recompute == "full":
        FullAC(FullAC.Config()).apply(model)
    elif recompute == "selective":
        _SelectiveOnCPU(SelectiveAC.Config()).apply(model)
    elif recompute != "none":
        raise ValueError(f"step_phase_peaks: recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    x, y = tokens[:, :-1], tokens[:, 1:]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    followed = _Followed([t for p in model.parameters() for t in (p, p.grad)] + [*model.buffers(), tokens])
    _fused_norms(model, followed)
    with followed:
        pred = model(x)
        followed.phase = "loss"
        loss = F.cross_entropy(pred.flatten(0, 1).float(), y.flatten())
        del pred
        loss.backward()
    return dict(followed.peaks)
