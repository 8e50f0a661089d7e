"""SBP: split / broadcast / partial_sum, nd-SBP and the balanced-split shape algebra."""
from .values import Broadcast, PartialSum, SbpValue, Split, broadcast, partial_sum, split
from .nd import as_nd_sbp, normalize_split, split_axes
from .shape import balanced_range, balanced_sizes, numel, piece_offset, piece_ranges, piece_shape

S, B, P = split, broadcast, partial_sum

__all__ = [
    "SbpValue", "Split", "Broadcast", "PartialSum", "split", "broadcast", "partial_sum", "S", "B", "P",
    "as_nd_sbp", "normalize_split", "split_axes",
    "balanced_sizes", "balanced_range", "piece_ranges", "piece_shape", "piece_offset", "numel",
]
