"""What torch.distributed.pipelining holds beyond a model's tensors (``plan_at_scale``'s
``Runner.pipeline_buffers``, for torchtitan's pipelined runs), read from each rank's CPU allocator
(torch.profiler's memory records) on 2 gloo processes: a chain of Linear chunks, one micro-batch
message ``ROWS x D`` float32, under GPipe, 1F1B and interleaved 1F1B (2 chunks a stage)."""
from __future__ import annotations

from pathlib import Path

import pytest

from globaltensor.nn.auto.scale_model import ScaleLayout, pipeline_buffer_bytes, stage_chunks

M = 4
PROGRAM = Path(__file__).with_name("_pipelining_buffers_program.py")


@pytest.fixture(scope="module")
def records(launch):
    return {rec["rank"]: rec for rec in launch(PROGRAM, 2).one_record_each((0, 1))}


@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_keeps_a_buffer_for_every_micro_batch_it_receives(records, name, virtual, rank):
    """From one step to the next a stage keeps, for each of its chunks, a buffer per micro-batch for
    each message the chunk receives (an activation but on the model's first chunk, a gradient but on
    its last) and, on the model's last, every micro-batch's output. Besides only the weights'
    gradients stay (64 x 64 float32 a chunk: 1/64 of a message) -- hence 0.1."""
    chunks, n = stage_chunks(ScaleLayout(dp=1, pp=2, virtual=virtual), rank)
    buffers = M * sum((c > 0) + 1 for c in chunks)
    assert buffers <= records[rank][name]["kept"] < buffers + 0.1, records[rank]


@pytest.mark.parametrize("name,held", [("gpipe", M), ("1f1b", 2)])
def test_the_first_stages_peak_is_its_buffers_and_the_outputs_it_holds(records, name, held):
    """The first stage, whose input needs no gradient: its peak is pipeline_buffer_bytes' -- the
    gradient buffers and the outputs held until their backward (GPipe: all ``M``; 1F1B: ``pp``,
    torch's warm-up), and the one last sent -- to the weights' gradients (0.1 as above)."""
    predicted = pipeline_buffer_bytes(ScaleLayout(dp=1, pp=2), 0, M, held, 1.0, 1.0)
    assert predicted <= records[0][name]["peak"] < predicted + 0.1, records[0]
