"""``plan_at_scale``'s memory model against torchtitan's own Llama 3, storage by storage.

One step of torchtitan's ``Llama3Model`` in bfloat16 (its query, key and value projections apart, as
its Llama 3 runs of 2024 had them) under each of its activation-checkpointing policies is followed
by tests/titan_step_memory.py, which keeps the GPU's norm and attention kernels' saved tensors. The
model's two phases are checked apart, each where it is the peak and where it is not: the loss's
(the vocabulary the larger) and a block's backward (the vocabulary as small as the hidden size).
Storages are counted exactly, so the figures are the same on every CPU.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from globaltensor.nn.auto.scale_model import (RECOMPUTE, ScaleLayout, activations_per_block, block_backward_bytes,
                                              loss_bytes)
from globaltensor.nn.auto.transformer_shape import TransformerShape
from titan_step_memory import step_phase_peaks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
from titan_models import llama3  # noqa: E402

BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, LAYERS = 4, 128, 64, 4, 2, 4


def _leftover_bytes() -> int:
    """What the model leaves out, all float32 numbers a row: flash attention's log-sum-exp (a head's
    row, every block) and each norm's reciprocal root mean square (two a block and the final
    norm's), and the loss's scalars."""
    tokens = BATCH * SEQ
    return LAYERS * (HEADS * tokens * 4 + 2 * tokens * 4) + tokens * 4 + 64


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("vocab", [HIDDEN, 32 * HIDDEN])
def test_each_phase_of_torchtitans_step_holds_what_the_model_predicts(recompute, vocab):
    """Every block's kept activations and, beside them, the loss's backward (float32 logits, the
    head's and the final norm's inputs) or a block's backward (what it recomputes, the gradients of
    its MLP's wide tensors and of its output): each phase's peak is the model's to the per-row
    numbers it leaves out; the forward's peak is below the larger of the two."""
    torch.manual_seed(0)
    model = llama3(dtype=torch.bfloat16, dim=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, layers=LAYERS, vocab=vocab,
                   max_seq_len=SEQ, fuse_qkv=False)
    ffn = model.layers["0"].feed_forward.w1.weight.shape[0]
    shape = TransformerShape(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=ffn, vocab=vocab,
                             seq=SEQ)
    lay = ScaleLayout(dp=1, micro_batch=BATCH, recompute=recompute)
    peaks = step_phase_peaks(model, torch.randint(0, vocab, (BATCH, SEQ + 1)), recompute)
    kept = LAYERS * activations_per_block(shape, lay)
    for phase, predicted in (("loss", kept + loss_bytes(shape, lay)), ("blocks", kept + block_backward_bytes(shape, lay))):
        assert predicted <= peaks[phase] <= predicted + _leftover_bytes(), (phase, peaks[phase], predicted)
    assert peaks["forward"] <= max(peaks["loss"], peaks["blocks"])
    assert (peaks["loss"] > peaks["blocks"]) == (vocab > HIDDEN)
