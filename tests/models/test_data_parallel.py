"""Data parallel on 4 simulated ranks (every parameter broadcast, the batch split): a training step
of either HuggingFace model sends each gradient's all-reduce once (bucketed), no more."""
import pytest

from globaltensor.sbp import split as S
from models_helpers import gradient_all_reduce_bytes, train_hf_side_by_side
from test_llama import _sent


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_data_parallel_step_reduces_each_gradient_once(p1, kind):
    run = train_hf_side_by_side(kind, p1, {}, S(0), "sdpa")
    ideal = gradient_all_reduce_bytes(run.model, axis=0)
    assert _sent(run.records) <= 1.01 * ideal
