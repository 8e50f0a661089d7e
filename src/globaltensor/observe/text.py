"""Short text for layouts, SBPs, placements, signatures and conversions, as the profiler and the
logs print them: ``S(0) -> B``, ``cpu[0,1,2,3]``, ``8x5 float32``."""
from __future__ import annotations

from ..sbp.text import sbp_text


def op_name(func) -> str:
    """``aten.mm`` for ``aten.mm.default``: the op without its overload."""
    return str(getattr(func, "overloadpacket", func))


def signature_text(nd_signature) -> str:
    """``(S(0), B) -> S(0)``: the inputs' nd-SBPs, then the outputs'."""
    ins = ", ".join(map(sbp_text, nd_signature.inputs))
    outs = ", ".join(map(sbp_text, nd_signature.outputs))
    return f"({ins}) -> {outs}"


def placement_text(placement) -> str:
    """``cpu[0,1,2,3]``, ``cpu[[0,1],[2,3]]``."""
    return f"{placement.type}{placement.ranks.tolist()}".replace(" ", "")


def group_text(group) -> str:
    """``[0,1,2,3]``."""
    return str(list(group)).replace(" ", "")


def conversion_text(src_placement, src_sbp, dst_placement, dst_sbp) -> str:
    """``S(0) -> B``; with the placements when they differ."""
    if src_placement == dst_placement:
        return f"{sbp_text(src_sbp)} -> {sbp_text(dst_sbp)}"
    return (f"{sbp_text(src_sbp)} on {placement_text(src_placement)} -> "
            f"{sbp_text(dst_sbp)} on {placement_text(dst_placement)}")


def tensor_text(shape: tuple, dtype) -> str:
    """``8x5 float32`` (``scalar float32`` for a 0-dim tensor)."""
    return ("x".join(map(str, shape)) or "scalar") + " " + str(dtype).replace("torch.", "")
