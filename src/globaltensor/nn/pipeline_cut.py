"""How many of a model's layers each pipeline chunk takes (``pipeline_stages(..., cut=)``).

A pipeline runs at the pace of its slowest chunk: every schedule's order assumes chunks of equal
work, and a chunk heavier than the others stretches each of its micro-batches while the others
wait. The layers of a transformer are alike, but the last chunk also runs the final norm and the
head, whose matmul over a large vocabulary costs more than a layer (Llama 3 8B's head: 525 M
weights against a layer's 218 M), and the first holds the embeddings, a lookup that costs little.

- ``"even"``: as many layers per chunk as the count allows, the extra ones on the first chunks
  (away from the head).
- ``"params"``: the chunks' costs balanced, a module's cost its weights that multiply -- its
  parameters but those of embeddings (``nn.Embedding`` / ``nn.EmbeddingBag``), which are looked up --
  and the modules after the layers counted with the last chunk. For a dense model each weight is one
  multiply-add per token forward, so this is its matmul flops' share. Cuts minimise the costliest
  chunk, then the sum of the chunks' squared costs, then put fewer layers on later chunks (layers
  without weights are cut as ``"even"`` cuts them). Not for layers of unequal activity: a
  mixture-of-experts layer's weights count every expert where a token runs a few (DeepSeek-V3's
  dense first layers would come out twenty times cheaper than its routed ones, for about the same
  flops), nor for what the weights do not show (attention's own flops, the loss): give such a
  model its sizes.
- a list of ints: the layers of each chunk, in order (as Megatron-LM's first- and last-stage layer
  counts, or torchtitan's module lists per stage, say it).
"""
from __future__ import annotations

from typing import List, Sequence, Union

from torch import nn

CutLike = Union[str, Sequence[int]]
CUTS = ("even", "params")


def matmul_weights(module: nn.Module) -> int:
    """The elements of ``module``'s parameters but those of its embeddings."""
    looked_up = {id(p) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                 for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in looked_up)


def chunk_sizes(cut: CutLike, layers: List[nn.Module], tail: List[nn.Module], chunks: int) -> List[int]:
    """The layers of each of ``chunks`` chunks, as ``cut`` says (module docstring); ``tail``: the modules
    that go with the last chunk."""
    if cut == "params":
        costs = [matmul_weights(m) for m in layers]
        if any(costs):
            return balanced(costs, sum(map(matmul_weights, tail)), chunks)
    if cut in CUTS:                     # "even", or layers without weights
        return even(len(layers), chunks)
    sizes = list(cut) if isinstance(cut, (list, tuple)) else None
    if sizes is None or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ValueError(f"pipeline_stages(cut=): expected one of {CUTS} or a list of layers per chunk (ints >= 1), "
                         f"got {cut!r}")
    if len(sizes) != chunks or sum(sizes) != len(layers):
        raise ValueError(f"pipeline_stages(cut=): expected {chunks} chunks' layer counts summing to the "
                         f"{len(layers)} layers, got {sizes} ({len(sizes)} chunks, {sum(sizes)} layers)")
    return sizes


def even(layers: int, chunks: int) -> List[int]:
    """``layers`` over ``chunks`` chunks, as many each as the count allows, the extra ones on the first."""
    size, extra = divmod(layers, chunks)
    return [size + (c < extra) for c in range(chunks)]


def balanced(costs: Sequence[int], tail: int, chunks: int) -> List[int]:
    """Contiguous chunks of ``costs`` (``tail`` added to the last), ``chunks`` of them, none empty: the
    costliest chunk as cheap as can be, then the sum of squared chunk costs least, then fewer layers on
    later chunks. Two passes, as the sum of squares only decides among cuts of the least costliest
    chunk: ``worst[k][j]``, the least costliest chunk of a cut of the first ``j`` layers into ``k``;
    then ``best[k][j]``, ``(sum of squares, start of its last chunk)`` of the best such cut whose chunks
    all stay within the whole cut's least costliest -- a later start is a shorter last chunk."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (tail if j == n else 0)

    def ends(k: int) -> range:
        return range(k, n - (chunks - k) + 1)
    worst = [{0: 0}]
    for k in range(1, chunks + 1):
        worst.append({j: min(max(worst[k - 1][i], cost(i, j)) for i in range(k - 1, j) if i in worst[k - 1])
                      for j in ends(k)})
    bound = worst[chunks][n]
    best = [{0: (0, 0)}]
    for k in range(1, chunks + 1):
        row = {}
        for j in ends(k):
            options = [(best[k - 1][i][0] + cost(i, j) ** 2, -i) for i in range(k - 1, j)
                       if i in best[k - 1] and cost(i, j) <= bound]
            if options:
                squares, start = min(options)
                row[j] = (squares, -start)
        best.append(row)
    sizes, j = [], n
    for k in range(chunks, 0, -1):
        start = best[k][j][1]
        sizes.append(j - start)
        j = start
    return sizes[::-1]
