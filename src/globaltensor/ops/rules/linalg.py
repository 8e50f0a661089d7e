"""Batched linear algebra: factorisations, solves, inverses, eigen- and singular values.

These ops treat their tensors as batches of matrices (or vectors, or scalars): every
tensor's last few "core" dims are the operand, the leading dims a batch that broadcasts.
Batch entries are independent, so a split of a batch dim stays: each rank solves its own
matrices. ``CORES`` gives, per op, the core dims of each tensor input (in order; a tensor
past the list has 0: ``atol`` / ``rtol``) and of each output. The batch shape is read off
the first output; where an output does not have it (``lu_unpack(unpack_data=False)`` returns
empty tensors) the op takes no split. A batch dim an input broadcasts (size 1, or missing)
leaves that input broadcast. None of these ops is linear: partial inputs are reduced first.
The table names ops of every supported torch; one this torch lacks registers nothing.
"""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import B, S, sig, tensors_of

# op -> (core dims of the tensor inputs, core dims of the outputs)
CORES = {
    aten.linalg_solve_triangular.default: ((2, 2), (2,)),
    aten._linalg_check_errors.default: ((0,), ()),
    aten._linalg_svd.default: ((2,), (2, 1, 2)),
    aten.linalg_lu_solve.default: ((2, 1, 2), (2,)),
    aten.lu_unpack.default: ((2, 1), (2, 2, 2)),
    aten.linalg_qr.default: ((2,), (2, 2)),
    aten.linalg_inv_ex.default: ((2,), (2, 0)),
    aten.linalg_lu_factor_ex.default: ((2,), (2, 1, 0)),
    aten.linalg_lu.default: ((2,), (2, 2, 2)),
    aten._linalg_eigh.default: ((2,), (1, 2)),
    aten._linalg_slogdet.default: ((2,), (0, 0, 2, 1)),
    aten._linalg_det.default: ((2,), (0, 2, 1)),
    aten.linalg_cholesky_ex.default: ((2,), (2, 0)),
    aten.linalg_eig.default: ((2,), (1, 2)),
    aten._linalg_eigvals.default: ((2,), (1,)),
    aten.linalg_eigvals.default: ((2,), (1,)),
    aten.linalg_ldl_factor_ex.default: ((2,), (2, 1, 0)),
    aten.cholesky.default: ((2,), (2,)),
    aten.cholesky_inverse.default: ((2,), (2,)),
    aten.cholesky_solve.default: ((2, 2), (2,)),
    aten.triangular_solve.default: ((2, 2), (2, 2)),
    aten.linalg_matrix_exp.default: ((2,), (2,)),
    aten.ormqr.default: ((2, 1, 2), (2,)),
    aten.linalg_householder_product.default: ((2, 1), (2,)),
    aten.linalg_pinv.atol_rtol_tensor: ((2,), (2,)),
    aten.linalg_pinv.rcond_tensor: ((2,), (2,)),
    aten.linalg_matrix_sqrth.default: ((2,), (2,)),          # torch 2.14 and later
    aten.linalg_polar.default: ((2,), (2, 2)),               # torch 2.14 and later
}


def _solve_cores(A, B, *rest, **kwargs) -> tuple:
    """``linalg.solve``'s B is a batch of vectors where torch says so, else of matrices."""
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and tuple(B.shape) == tuple(A.shape[:-1]))
    return (2, 1 if vector else 2), (1 if vector else 2, 2, 1, 0)


def _batched(op, in_cores, out_cores=None):
    """The rule of ``op`` whose tensors have these core dims (``in_cores`` may be a function of the
    op's arguments giving both)."""
    def rule(*args, **kwargs):
        ins, outs_cores = in_cores(*args, **kwargs) if callable(in_cores) else (in_cores, out_cores)
        return _batch_candidates(op, ins, outs_cores, args, kwargs)
    return rule


def _batch_candidates(op, in_cores: tuple, out_cores: tuple, args, kwargs) -> list:
    """``S(q)`` of every batch dim q, each input split where it has that batch dim, else B."""
    ts = tensors_of(*args, **kwargs)
    result = op(*args, **kwargs)
    outs = [result] if out_cores and not isinstance(result, (tuple, list)) else list(result or ())
    if not outs:                                  # no output (a check): the batch of the inputs
        batch = tuple(ts[0].shape[:ts[0].dim() - in_cores[0]])
    else:
        batch = tuple(outs[0].shape[:outs[0].dim() - out_cores[0]])
    b = len(batch)
    if len(outs) != len(out_cores) or any(o.dim() != b + c or tuple(o.shape[:b]) != batch
                                          for o, c in zip(outs, out_cores)):
        return []
    cores = list(in_cores[:len(ts)]) + [0] * (len(ts) - len(in_cores))
    cands = []
    for q in range(b):
        ins = []
        for t, c in zip(ts, cores):
            k = q - (b - (t.dim() - c))
            ins.append(S(k) if k >= 0 and (t.shape[k] == batch[q]) else B)
        cands.append(sig(ins, [S(q)] * len(outs)))
    return cands


for _op, (_ins, _outs) in CORES.items():
    register_rule(_op, _batched(_op, _ins, _outs))
register_rule(aten._linalg_solve_ex.default, _batched(aten._linalg_solve_ex.default, _solve_cores))
