"""What the software that runs a training step holds and decides beyond the layout's degrees, for
``plan_at_scale``'s model (scale_model.py): this library's, and the peers' whose published runs
the model predicts (benchmarks/published_runs.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

# float32 logits-sized tensors torch's eager cross entropy holds at its peak, the logits cast to float
# (torchtitan's loss): log_softmax's output, saved for the backward, the gradient nll_loss's backward
# makes of it, and log_softmax's backward's result (tests/nn/test_plan_at_scale.py measures it); per
# rank the same for this library's vocabulary-split loss (tests/ops/test_loss.py)
LOSS_LOGITS_COPIES = 3
# what DTensor's ``loss_parallel()`` holds per rank (torchtitan's loss wherever it runs tensor
# parallel): its backward of nll_loss and log_softmax in one holds the saved log-probabilities, the
# zeros it scatters -1 into, their exponentials and the sum of the two, before it multiplies
# (tests/multiprocess/test_dtensor_loss_peak.py measures it)
DTENSOR_LOSS_LOGITS_COPIES = 4


@dataclass(frozen=True)
class Runner:
    """The software running a step, as the model needs it. The default: this library's loss, and a
    pipeline as Megatron-LM runs it (a sent output's storage freed, messages received into tensors
    made as they come), cut as the layout says. :data:`TORCHTITAN`: torchtitan's runs.

    ``split_loss_logits``: the float32 logits a rank's loss holds at its peak where the vocabulary is
    split over the tensor ranks (without tensor parallelism the loss is torch's, LOSS_LOGITS_COPIES).
    ``pipeline_buffers``: torch.distributed.pipelining's (scale_model.pipeline_buffer_bytes) -- a
    stage keeps each micro-batch's output until its backward, and receives into buffers made ahead
    for every micro-batch and kept from step to step. ``cut``: ``(layers, chunks) -> layers a chunk``,
    the runner's own cut of the model into pipeline chunks in place of the layout's; None: the
    layout's."""
    name: str = "globaltensor"
    split_loss_logits: int = LOSS_LOGITS_COPIES
    pipeline_buffers: bool = False
    cut: Optional[Callable[[int, int], List[int]]] = None


def titan_cut(layers: int, chunks: int) -> List[int]:
    """torchtitan's split of ``layers`` into ``chunks`` of 2024-12 (``generate_split_points``, its
    default where no split points are given): the first chunk ``layers // chunks``, as it holds the
    embedding; the chunks after it one more each while the remainder lasts; the last what is left."""
    if chunks == 1:
        return [layers]
    base, extra = divmod(layers, chunks)
    sizes = [base] + [base + 1 if i < extra else base for i in range(chunks - 2)]
    return sizes + [layers - sum(sizes)]


#: torchtitan's runs: DTensor's loss_parallel(), torch.distributed.pipelining, its split points
TORCHTITAN = Runner("torchtitan", DTENSOR_LOSS_LOGITS_COPIES, pipeline_buffers=True, cut=titan_cut)
