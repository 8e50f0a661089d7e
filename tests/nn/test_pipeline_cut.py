"""pipeline_stages' cut (nn/pipeline_cut.py): the balanced cut is the best of every contiguous cut, by
brute force; the even cut (the default) gives the extra layers to the first chunks; sizes given are
checked; a module's cost is its weights that multiply, its embeddings left out."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from globaltensor.nn.pipeline_cut import balanced, chunk_sizes, matmul_weights


def _every_cut(n: int, chunks: int):
    """Every way to cut n layers into ``chunks`` non-empty contiguous chunks, as sizes."""
    for bounds in itertools.combinations(range(1, n), chunks - 1):
        edges = (0, *bounds, n)
        yield [b - a for a, b in zip(edges, edges[1:])]


def _rank(costs, tail, sizes):
    """The order balanced() promises: costliest chunk, sum of squares, then fewer layers on later chunks."""
    at, chunk_costs = 0, []
    for s in sizes:
        chunk_costs.append(sum(costs[at:at + s]))
        at += s
    chunk_costs[-1] += tail
    return max(chunk_costs), sum(c * c for c in chunk_costs), sizes[::-1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(0, 120), st.data())
def test_the_balanced_cut_is_the_best_of_every_cut(costs, tail, data):
    chunks = data.draw(st.integers(1, len(costs)))
    got = balanced(costs, tail, chunks)
    want = min(_every_cut(len(costs), chunks), key=lambda s: _rank(costs, tail, s))
    assert got == want


@pytest.mark.parametrize("n, chunks, want", [(8, 2, [4, 4]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (4, 4, [1, 1, 1, 1])])
def test_equal_layers_without_a_head_cut_as_evenly_as_the_even_cut(n, chunks, want):
    layers = [nn.Linear(4, 4) for _ in range(n)]
    assert chunk_sizes("even", layers, [], chunks) == want
    assert chunk_sizes("params", layers, [], chunks) == want


def test_layers_without_weights_cut_evenly():
    layers = [nn.GELU() for _ in range(5)]
    assert chunk_sizes("params", layers, [nn.Linear(4, 4)], 2) == [3, 2]


def test_a_heavy_head_takes_layers_from_the_last_chunk():
    layers = [nn.Linear(16, 16, bias=False) for _ in range(8)]          # 256 weights each
    head = nn.Linear(16, 32, bias=False)                                 # 512: two layers' worth
    assert chunk_sizes("even", layers, [head], 4) == [2, 2, 2, 2]       # the last chunk costs 4 layers
    assert chunk_sizes("params", layers, [head], 4) == [3, 2, 2, 1]     # the costliest: 3


def test_llama_3_8b_shaped_head_weighs_more_than_two_layers():
    """On the meta device: Llama 3.1 8B's shapes, 32 layers over 4 stages."""
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    layer, head = matmul_weights(model.model.layers[0]), matmul_weights(model.lm_head)
    assert layer == 218_112_000 and head == 525_336_576
    assert matmul_weights(model.model) == 32 * layer + 4096             # the embedding left out, the norm counted
    sizes = chunk_sizes("params", list(model.model.layers), [model.model.norm, model.lm_head], 4)
    assert sizes == [9, 9, 8, 6] and sum(sizes) == 32


def test_sizes_given_are_taken_or_refused():
    layers = [nn.Linear(2, 2) for _ in range(5)]
    assert chunk_sizes([1, 4], layers, [], 2) == [1, 4]
    assert chunk_sizes((2, 3), layers, [], 2) == [2, 3]
    with pytest.raises(ValueError, match=r"expected 2 chunks' layer counts summing to the 5 layers, got \[1, 3\]"):
        chunk_sizes([1, 3], layers, [], 2)
    with pytest.raises(ValueError, match=r"expected 2 chunks' layer counts .* got \[1, 1, 3\] \(3 chunks"):
        chunk_sizes([1, 1, 3], layers, [], 2)
    with pytest.raises(ValueError, match=r"ints >= 1\), got \[0, 5\]"):
        chunk_sizes([0, 5], layers, [], 2)
    with pytest.raises(ValueError, match=r"expected one of \('even', 'params'\) or a list of layers per chunk "
                                         r"\(ints >= 1\), got 'flops'"):
        chunk_sizes("flops", layers, [], 2)
    with pytest.raises(ValueError, match="got 2"):
        chunk_sizes(2, layers, [], 2)
