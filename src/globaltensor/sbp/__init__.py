"""SBP: split / broadcast / partial_sum, nd-SBP and the balanced-split shape algebra."""
from .values import Broadcast, PartialSum, SbpValue, Split, broadcast, partial_sum, split
from .nd import as_nd_sbp, check_blocks, normalize_split, split_axes
from .signature import NdSignature, Signature, all_broadcast, as_signature, choose, nd_candidates, parse
from .shape import (balanced_range, balanced_sizes, blocks_problem, broadcast_shape, contiguous_strides, numel,
                    piece_offset, piece_ranges, piece_shape)
from .text import nd_from_list, nd_to_list, sbp_text

S, B, P = split, broadcast, partial_sum

__all__ = [
    "SbpValue", "Split", "Broadcast", "PartialSum", "split", "broadcast", "partial_sum", "S", "B", "P",
    "as_nd_sbp", "check_blocks", "normalize_split", "split_axes",
    "Signature", "NdSignature", "parse", "as_signature", "all_broadcast", "nd_candidates", "choose",
    "balanced_sizes", "balanced_range", "blocks_problem", "broadcast_shape", "piece_ranges", "piece_shape",
    "piece_offset", "numel", "contiguous_strides", "sbp_text", "nd_to_list", "nd_from_list",
]
