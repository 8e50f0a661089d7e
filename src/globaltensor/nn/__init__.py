"""Module helpers: lay a module's parameters out as global tensors by a plan, and shard its optimizer.

    gt.nn.distribute_module(model, placement, plan)     # plan: {"*.attn.qkv.weight": (B, S(0)), ...}
    opt = gt.nn.ZeroOptimizer(model.parameters(), torch.optim.AdamW, axis=0, lr=1e-3)
    with gt.nn.no_sync(model): loss.backward()          # accumulate; the next backward reduces
"""
from .distribute import distribute_module, full_state_dict, match_plan
from .auto.plan import AutoPlan, auto_plan
from .auto.devices import DEVICES, Device, Link
from .auto.predict import Prediction
from .auto.predict_step import predict_step
from .auto.scale_model import ScaleLayout
from .auto.scale_search import ScalePlan, plan_at_scale
from .auto.transformer_shape import TransformerShape
from .grad_buckets import GradBuckets, bucket_gradients, no_sync
from .plans import (COLUMN_PARALLEL, CONV1D_COLUMN_PARALLEL, CONV1D_FUSED_QKV_COLUMN_PARALLEL, CONV1D_ROW_PARALLEL,
                    REPLICATED, ROW_PARALLEL, column_parallel, gpt2_plan, layer_plan, llama_plan, megatron_plan, on_axis, row_parallel)
from .zero import ZeroOptimizer, shard_sbp
from .optim_state import init_optimizer_state
from .dtensor_modules import from_dtensor_module, to_dtensor_module
from .moe import expert_parallel
from .parallel_styles import from_parallel_styles, hf_tp_plan
from .pipeline_stages import pipeline_stages

__all__ = ["distribute_module", "match_plan", "full_state_dict", "COLUMN_PARALLEL", "ROW_PARALLEL", "REPLICATED",
           "CONV1D_COLUMN_PARALLEL", "CONV1D_FUSED_QKV_COLUMN_PARALLEL", "CONV1D_ROW_PARALLEL", "column_parallel",
           "row_parallel", "layer_plan",
           "megatron_plan", "llama_plan", "gpt2_plan", "on_axis", "ZeroOptimizer", "shard_sbp",
           "init_optimizer_state", "from_dtensor_module", "to_dtensor_module",
           "GradBuckets", "bucket_gradients", "no_sync", "auto_plan", "AutoPlan", "Prediction", "Device", "Link",
           "DEVICES", "predict_step", "plan_at_scale", "ScalePlan", "ScaleLayout", "TransformerShape", "expert_parallel",
           "from_parallel_styles", "hf_tp_plan", "pipeline_stages"]
