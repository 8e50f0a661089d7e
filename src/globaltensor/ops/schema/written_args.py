"""The ops that write an argument they do not return, and the path that keeps each write.

An op's result is wrapped as a global tensor whatever path it takes, but an argument it writes
without returning it (``Tensor(b!)[] grads`` of a fused optimizer, ``found_inf`` of GradScaler's
unscale, batch norm's running statistics) is kept only if that path writes it back into the
caller's tensor. Every such op of every supported torch is listed here with the path it takes:

- ``list``: decide/lists.py and executor/lists.py, one call per group of elements; written
  elements boxed back;
- ``rule``: a rule whose candidates keep the written layouts, or whose kernel writes them back;
- ``decomposition``: torch's decomposition, whose in-place ops dispatch again (and keep their
  writes themselves);
- ``fallback``: fallback.py, which writes every written argument back from the gathered copy;
- ``autograd``: handled above ``__torch_dispatch__`` (``retain_grad``, ``set_data``).

An aten op that writes an argument it does not return and is listed nowhere -- a torch newer
than this list -- raises: such ops are optimizer and mixed-precision steps, whose writes the
fallback would keep only by gathering every parameter onto every rank (tests/ops/
test_written_args.py walks every schema of the installed torch, so the suite fails until the
new op is listed). ``_foreach_*`` ops are one family: every one of them runs through
the list ops. A user's own op (another namespace) takes its rule, or the fallback, which keeps
every write.
"""
from __future__ import annotations

from .op_record import record

FAMILIES = {"aten._foreach_": "list"}

HANDLED = {
    "aten._fused_adam_.default": "list",
    "aten._fused_adam_.tensor_lr": "list",
    "aten._fused_adamw_.default": "list",
    "aten._fused_adamw_.tensor_lr": "list",
    "aten._fused_sgd_.default": "list",
    "aten._fused_sgd_.tensor_lr": "list",
    "aten._fused_adagrad_.default": "list",
    "aten._fused_adagrad_.tensor_lr": "list",
    "aten._amp_foreach_non_finite_check_and_unscale_.default": "list",
    "aten._native_batch_norm_legit.default": "rule",
    "aten.record_stream.default": "rule",
    "aten._batch_norm_with_update.default": "decomposition",
    "aten.split_with_sizes_copy.out": "decomposition",
    "aten.unbind_copy.int_out": "decomposition",
    "aten.fbgemm_linear_fp16_weight.out": "decomposition",
    "aten.fbgemm_linear_fp16_weight_fp32_activation.out": "decomposition",
    "aten.fused_moving_avg_obs_fake_quant.default": "decomposition",
    "aten.retain_grad.default": "autograd",
    "aten.set_data.default": "autograd",
    "aten._amp_foreach_non_finite_check_and_unscale.out": "fallback",
    "aten._amp_update_scale.out": "fallback",
    "aten._amp_update_scale_.default": "fallback",
    "aten._batch_norm_with_update.out": "fallback",
    "aten._cudnn_attention_forward_no_dropout_inplace.default": "fallback",
    "aten._cudnn_rnn_backward.out": "fallback",
    "aten._cummax_helper.default": "fallback",
    "aten._cummin_helper.default": "fallback",
    "aten._flash_attention_forward_no_dropout_inplace.default": "fallback",
    "aten._fused_adagrad.out": "fallback",
    "aten._fused_adagrad.tensor_lr_out": "fallback",
    "aten._fused_adam.out": "fallback",
    "aten._fused_adam.tensor_lr_out": "fallback",
    "aten._fused_adamw.out": "fallback",
    "aten._fused_adamw.tensor_lr_out": "fallback",
    "aten._fused_moving_avg_obs_fq_helper.default": "fallback",
    "aten._fused_moving_avg_obs_fq_helper.out": "fallback",
    "aten._fused_sgd.out": "fallback",
    "aten._fused_sgd.tensor_lr_out": "fallback",
    "aten._histogramdd_bin_edges.out": "fallback",
    "aten._native_batch_norm_legit.out": "fallback",
    "aten.dequantize.tensors_out": "fallback",
    "aten.lstm_mps_backward.out": "fallback",
    "aten.miopen_rnn_backward.out": "fallback",
    "aten.quantize_per_tensor.tensors_out": "fallback",
    "aten.rrelu_with_noise.default": "fallback",
    "aten.rrelu_with_noise.out": "fallback",
    "aten.rrelu_with_noise_.default": "fallback",
    "aten.split_copy.Tensor_out": "fallback",
    "aten.unsafe_split.Tensor_out": "fallback",
    "aten.unsafe_split_with_sizes.out": "fallback",
}


def handling(func, handled: dict = HANDLED) -> str:
    """The path that keeps ``func``'s unreturned writes; "" when it has none to keep; None when
    it has some and is not listed."""
    if not record(func).unreturned:
        return ""
    name = str(func)
    path = handled.get(name)
    if path is None:
        path = next((p for prefix, p in FAMILIES.items() if name.startswith(prefix)), None)
    return path


def check_writes_kept(func) -> None:
    """Raise for an aten op that writes arguments it does not return and is not listed above."""
    if func.namespace == "aten" and handling(func) is None:
        names = ", ".join(a.name for a in record(func).unreturned)
        raise NotImplementedError(f"globaltensor: {func} writes arguments it does not return ({names}), and this "
                                  f"version of globaltensor does not know how to keep those writes on global "
                                  f"tensors (it is newer than the list in globaltensor/ops/schema/written_args.py); run it "
                                  f"on local tensors (x.to_local()) or update globaltensor")
