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

    def kernel_bytes(sources, ins, recorded: bool) -> int:
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
