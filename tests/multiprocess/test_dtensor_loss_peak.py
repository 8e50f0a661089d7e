"""torchtitan's loss (bfloat16 logits cast to float, cross entropy, the logits let go, backward) on
2 gloo processes, each rank's peak read from the CPU allocator (torch.profiler's memory events): torch
over the whole vocabulary and this library's vocabulary-split loss hold ``LOSS_LOGITS_COPIES`` float32
logits a rank, DTensor's ``loss_parallel()`` ``DTENSOR_LOSS_LOGITS_COPIES`` -- the counts
``plan_at_scale``'s memory model takes for a loss (benchmarks/published_runs.py: DTensor's for
torchtitan's tensor-parallel runs)."""
from __future__ import annotations

from pathlib import Path

from globaltensor.nn.auto.runners import DTENSOR_LOSS_LOGITS_COPIES, LOSS_LOGITS_COPIES

PROGRAM = Path(__file__).with_name("_loss_peak_program.py")


def test_dtensor_loss_parallel_holds_one_more_float32_logits_than_torch_and_this_library(launch):
    """Beside the logits-sized tensors only per-row ones are alive (row maxima and sums, targets,
    masks: a few bytes a row against a rank's 2,048 bytes of a row's float32 logits), hence 0.25."""
    for rec in launch(PROGRAM, 2).one_record_each((0, 1)):
        for name, copies in (("torch", LOSS_LOGITS_COPIES), ("globaltensor", LOSS_LOGITS_COPIES),
                             ("dtensor", DTENSOR_LOSS_LOGITS_COPIES)):
            assert copies <= rec[name] < copies + 0.25, (name, rec)
