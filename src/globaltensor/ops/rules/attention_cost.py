"""What attention's signatures cost beyond their boxing, and which the dispatcher may take: shared by
the CPU rule (attention.py) and the CUDA kernels' (attention_cuda.py). ``q_index``: the query's
position among the op's tensor arguments (0 in a forward, 1 in a backward, after ``grad_out``); the
key and value follow it."""
from __future__ import annotations

from .common import is_zero
from .ring_attention import ring_bytes, seq_axes

#: every attention rule's ``keyed=``: with dropout the candidates differ (none on CPU's kernel; an
#: error on CUDA's, whose mask is drawn per rank), so a zero and a non-zero ``dropout_p`` key apart
DROPOUT = {"dropout_p": is_zero}


def attention_kernel_bytes(q_index: int):
    """``kernel_bytes`` of an attention op. Ring attention (k split on the sequence): its rotations --
    a forward's one of k and v, and where autograd records the op, its backward's too; a backward's
    rotation and the key/value gradient shares sent home. Where autograd records a forward, a
    signature that gathers sequence-split k and v makes every rank hold them whole until the
    backward -- the memory a sequence split exists to save, layer after layer: those bytes count
    too, so that ring attention, which never holds them whole, is not passed over for its extra
    backward rotation."""
    key, value = q_index + 1, q_index + 2

    def kernel_bytes(sources, ins, outs, recorded: bool) -> int:
        if seq_axes(ins[key]):
            if q_index:
                return ring_bytes(ins[key], ins[value], backward=True)
            return ring_bytes(ins[key], ins[value], backward=False) + (
                ring_bytes(ins[key], ins[value], backward=True) if recorded else 0)
        if q_index or not recorded or not seq_axes(sources[key]):
            return 0
        return max(sum(max(t.piece_bytes(r) - s.piece_bytes(r), 0)
                       for s, t in zip(sources[key:value + 1], ins[key:value + 1]))
                   for r in ins[key].placement.rank_list())
    return kernel_bytes


def keeps_the_work_divided(q_index: int):
    """Admit a signature only if attention's query work stays divided as it came: every placement axis
    that splits the queries still splits them (gathering q would make each rank redo the others'
    attention), and every rank that holds query rows keeps some (a head split with fewer heads than
    ranks -- Ulysses' limit -- or a batch split of a smaller batch would hand whole sequences to some
    ranks and leave the others idle). Ring attention always qualifies."""
    def admit(sources, targets) -> bool:
        source, target = sources[q_index], targets[q_index]
        if any(u.is_split and not v.is_split for u, v in zip(source.nd_sbp, target.nd_sbp)):
            return False
        return all(not all(source.piece_shape(r)) or all(target.piece_shape(r)) for r in source.placement.rank_list())
    return admit


def kv_heads_read(q_layout, k_layout, rank: int):
    """Under grouped-query attention (``H = G * Hk`` query heads; query head ``h`` reads kv head
    ``h // G``) with a kv piece that holds every kv head (no split of dim 1) and a query piece that
    does not hold every query head: for each of the rank's query heads, the kv head it reads. None
    where the rank's kv piece is its query heads' as it comes (no GQA, or both split alike)."""
    heads, kv_heads = q_layout.shape[1], k_layout.shape[1]
    if heads == kv_heads or not kv_heads or any(v.is_split and v.dim == 1 for v in k_layout.nd_sbp):
        return None
    ranges = q_layout.segments(rank, 1)
    if len(ranges) == 1 and ranges[0][2] == heads:
        return None
    group = heads // kv_heads
    return [h // group for start, _, n in ranges for h in range(start, start + n)]


def heads_line_up(q_index: int):
    """Admit a split of the heads only where each rank's query heads read the kv heads its kv piece
    holds: with GQA's ``G`` query heads per kv head, a rank's query-head ranges must be its kv-head
    ranges times ``G`` (balanced splits of H and Hk line up so only for some numbers of ranks); a kv
    piece holding every kv head serves any query heads (the rule's local rewrite takes those they read:
    :func:`kv_heads_read`)."""
    key = q_index + 1

    def admit(targets) -> bool:
        q, k = targets[q_index], targets[key]
        if not k.shape[1] or not any(v.is_split and v.dim == 1 for v in q.nd_sbp) or \
                not any(v.is_split and v.dim == 1 for v in k.nd_sbp):
            return True
        group = q.shape[1] // k.shape[1]
        for r in q.placement.rank_list():
            kept = [(s * group, o * group, n * group) for s, o, n in k.segments(r, 1) if n]
            if [seg for seg in q.segments(r, 1) if seg[2]] != kept:
                return False
        return True
    return admit


def admit_attention(q_index: int):
    """An attention rule's ``admit``: :func:`keeps_the_work_divided` and :func:`heads_line_up`."""
    divided, lined_up = keeps_the_work_divided(q_index), heads_line_up(q_index)
    return lambda sources, targets: divided(sources, targets) and lined_up(targets)
