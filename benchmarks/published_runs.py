"""Published training runs, predicted on paper: ``gt.nn.plan_at_scale``'s model against the numbers
their authors measured.

    .venv/bin/python benchmarks/published_runs.py

- **Megatron-LM's README table** (H100 SXM, sequences of 4,096, vocabulary 131,072, GPT blocks;
  the model table of its "Training Speed and Scalability" section): each row's MFU predicted from
  its tensor, pipeline and data-parallel degrees and its batch. The row gives neither the
  micro-batch nor the schedule; the prediction takes Megatron's defaults, micro-batches of one
  sequence and non-interleaved 1F1B, with activations kept unless they do not fit. One constant
  is calibrated, on one row: the matmuls' sustained fraction of the H100's peak, fitted so that
  the 462B row -- the largest run, the one Megatron-LM leads with -- predicts its published 47 %;
  the other rows are predicted with it. Which row calibrates matters: the sensitivity table
  calibrates on each row in turn and gives the other rows' errors.
- **torchtitan's published Llama 3.1 runs** (pytorch/torchtitan/benchmarks/llama3_h100_202412_torchtitan.md: H100s of
  96 GB HBM2e, torch of 2024-12-23): each run's per-GPU memory predicted from its layout as torchtitan
  ran it (FSDP's weights gathered once a step within a pipeline, ``pipeline_parallel_microbatches``
  defaulting to the stage count, its selective or full activation checkpointing, DTensor's
  ``loss_parallel()``, torch.distributed.pipelining's buffers and its split points: ``TORCHTITAN``),
  against the published figure -- the allocator's peak *reserved* bytes, where the model counts the
  tensors alive and, of the allocator's blocks beyond them, the bf16 logits'. And the run that published
  an out-of-memory (405B on 128 H100s with FSDP alone) must never be predicted to fit, nor a run
  that trained predicted not to.
- **Planning time**: ``plan_at_scale`` over every degree for Llama 3.1 405B on 1,024 H100s and 8B
  on 64, the seconds it takes.

docs/planning.md prints the table (``make docs-numbers``: the predictions are arithmetic, the same on
every machine).
"""
from __future__ import annotations

import time
from dataclasses import replace

import _harness as H  # noqa: F401 -- puts the checkout's src on the path

from globaltensor.nn.auto.devices import H100, MATMUL_EFFICIENCY
from globaltensor.nn.auto.runners import TORCHTITAN
from globaltensor.nn.auto.scale_model import ScaleLayout, predict_scale
from globaltensor.nn.auto.scale_search import plan_at_scale, with_matmul_efficiency
from globaltensor.nn.auto.transformer_shape import TransformerShape

#: (model, attention heads, hidden, layers, tensor, pipeline, data, GPUs, batch, TFLOP/s per GPU, MFU)
MEGATRON = [("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
            ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
            ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
            ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
            ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
            ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
            ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
            ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
            ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47)]
CALIBRATION_ROW = "462B"
LLAMA_405B = TransformerShape(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192)
LLAMA_8B = TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192)
LLAMA_70B = TransformerShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192)
#: torchtitan's H100s (Grand Teton: 96 GB of HBM2e, 95 GiB to the allocator)
TITAN_H100 = replace(H100, name="H100 (96 GB)", memory=95 * 2 ** 30)


def _titan(table, run, shape, seq, layout, batch, published, unmodelled=""):
    return (table, run, replace(shape, seq=seq), layout, batch, published, unmodelled)


#: torchtitan's published runs: (table, run, shape, layout, global batch, published peak reserved GiB
#: -- None where the run went out of memory --, what the run used that the model does not know).
#: Tables 1-6 of torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (of the rows that differ only by
#: torch.compile, Float8 or async TP, the one with the fewest of them), and docs/performance.md's
#: 405B on 128 H100s (2024), where FSDP alone went out of memory and FSDP 16 x TP 8 trained.
TITAN = [
    _titan("1", "8B, FSDP 8, local batch 2", LLAMA_8B, 8192,
           ScaleLayout(dp=8, micro_batch=2, recompute="selective", zero=3), 16, 82.4),
    _titan("2", "8B, FSDP 8, CP 1, 32k", LLAMA_8B, 32768, ScaleLayout(dp=8, recompute="full", zero=3), 8, 83.9,
           "compile, Float8"),
    _titan("2", "8B, FSDP 4, CP 2, 64k", LLAMA_8B, 65536, ScaleLayout(dp=4, cp=2, recompute="full", zero=3), 4, 84.2,
           "compile, Float8"),
    _titan("2", "8B, FSDP 2, CP 4, 128k", LLAMA_8B, 131072, ScaleLayout(dp=2, cp=4, recompute="full", zero=3), 2,
           84.0, "compile, Float8"),
    _titan("2", "8B, FSDP 1, CP 8, 256k", LLAMA_8B, 262144, ScaleLayout(dp=1, cp=8, recompute="full", zero=3), 1,
           84.5, "compile, Float8"),
    _titan("3", "8B, FSDP 128, local batch 2", LLAMA_8B, 8192,
           ScaleLayout(dp=128, micro_batch=2, recompute="selective", zero=3), 256, 67.0),
    _titan("4", "70B, FSDP 32 x TP 8, local batch 16", LLAMA_70B, 8192,
           ScaleLayout(dp=32, tp=8, micro_batch=16, recompute="full", zero=3), 512, 71.9, "compile, Float8"),
    _titan("5", "405B, FSDP 8 x TP 8 x PP 8, 1F1B", LLAMA_405B, 8192,
           ScaleLayout(dp=8, tp=8, pp=8, micro_batch=4, recompute="full", zero=3), 256, 82.5,
           "compile, Float8, async TP"),
    _titan("5", "405B, FSDP 8 x TP 8 x PP 8, interleaved 1F1B", LLAMA_405B, 8192,
           ScaleLayout(dp=8, tp=8, pp=8, micro_batch=4, virtual=2, recompute="full", zero=3), 256, 72.7,
           "compile, Float8, async TP"),
    _titan("6", "405B, FSDP 8 x TP 8 x PP 8, CP 1, 32k", LLAMA_405B, 32768,
           ScaleLayout(dp=8, tp=8, pp=8, recompute="full", zero=3), 64, 75.3, "compile, Float8, async TP"),
    _titan("6", "405B, FSDP 4 x TP 8 x PP 8, CP 2, 64k", LLAMA_405B, 65536,
           ScaleLayout(dp=4, tp=8, pp=8, cp=2, recompute="full", zero=3), 32, 75.9, "compile, Float8, async TP"),
    _titan("6", "405B, FSDP 2 x TP 8 x PP 8, CP 4, 128k", LLAMA_405B, 131072,
           ScaleLayout(dp=2, tp=8, pp=8, cp=4, recompute="full", zero=3), 16, 77.1, "compile, Float8, async TP"),
    _titan("6", "405B, FSDP 1 x TP 8 x PP 8, CP 8, 256k", LLAMA_405B, 262144,
           ScaleLayout(dp=1, tp=8, pp=8, cp=8, recompute="full", zero=3), 8, 84.9, "compile, Float8, async TP"),
    _titan("2024", "405B, FSDP 128, local batch 2", LLAMA_405B, 8192,
           ScaleLayout(dp=128, micro_batch=2, recompute="full", zero=3), 256, None),
]


def megatron_shape(heads: int, hidden: int, layers: int) -> TransformerShape:
    return TransformerShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=131072,
                            seq=4096, gated=False)


def megatron_prediction(row, device):
    """The row's step as Megatron ran it: its degrees and batch, micro-batches of one sequence,
    1F1B, activations kept -- or, where they do not fit, fully recomputed."""
    _, heads, hidden, layers, tp, pp, dp, _, batch, _, _ = row
    shape = megatron_shape(heads, hidden, layers)
    for recompute in ("none", "full"):
        lay = ScaleLayout(dp=dp, tp=tp, pp=pp, recompute=recompute)
        p = predict_scale(shape, lay, device, batch)
        if p.peak_memory <= device.memory:
            return lay, p
    return lay, p


def calibrated_efficiency(name: str = CALIBRATION_ROW) -> float:
    """The matmuls' sustained fraction of peak at which row ``name`` predicts its MFU (bisection)."""
    row = next(r for r in MEGATRON if r[0] == name)
    low, high = 0.3, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if megatron_prediction(row, with_matmul_efficiency(H100, mid))[1].mfu < row[-1]:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def megatron_table() -> str:
    efficiency = calibrated_efficiency()
    device = with_matmul_efficiency(H100, efficiency)
    lines = [f"H100 matmuls sustained at {efficiency:.3f} of peak, calibrated on the {CALIBRATION_ROW} row "
             f"(the device table's {MATMUL_EFFICIENCY} uncalibrated).", "",
             "| model | TP | PP | DP | GPUs | batch | published MFU | predicted MFU | error | predicted memory GiB | "
             "layout predicted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in MEGATRON:
        name, _, _, _, tp, pp, dp, gpus, batch, _, mfu = row
        lay, p = megatron_prediction(row, device)
        error = "(calibration)" if name == CALIBRATION_ROW else f"{p.mfu / mfu - 1:+.0%}"
        lines.append(f"| {name} | {tp} | {pp} | {dp} | {gpus} | {batch} | {mfu:.0%} | {p.mfu:.1%} | {error} | "
                     f"{p.peak_memory / 2 ** 30:.1f} | {lay.text()} |")
    return "\n".join(lines)


def calibration_sensitivity() -> str:
    """Each row as the calibration row: the fraction it gives, and the other rows' errors."""
    lines = ["| calibrated on | matmuls' fraction of peak | largest error of the others | the others' errors |",
             "|---|---|---|---|"]
    for calibration in MEGATRON:
        efficiency = calibrated_efficiency(calibration[0])
        device = with_matmul_efficiency(H100, efficiency)
        errors = [megatron_prediction(r, device)[1].mfu / r[-1] - 1 for r in MEGATRON if r is not calibration]
        lines.append(f"| {calibration[0]} | {efficiency:.3f} | {max(map(abs, errors)):.1%} | "
                     + " ".join(f"{e:+.0%}" for e in errors) + " |")
    return "\n".join(lines)


def titan_predictions():
    """Each of torchtitan's published runs with its prediction on its H100s, run by torchtitan's
    software (``TORCHTITAN``: DTensor's ``loss_parallel()`` wherever it runs tensor parallel,
    torch.distributed.pipelining's buffers, its split points)."""
    return [(row, predict_scale(row[2], row[3], TITAN_H100, row[4], TORCHTITAN)) for row in TITAN]


def titan_memory_table() -> str:
    lines = ["| table | run | published GiB | predicted GiB | error | predicted to fit | not modelled |",
             "|---|---|---|---|---|---|---|"]
    for (table, run, _, _, _, published, unmodelled), p in titan_predictions():
        gib = p.peak_memory / 2 ** 30
        shown = "out of memory" if published is None else f"{published:.1f}"
        error = "" if published is None else f"{gib / published - 1:+.0%}"
        fits = "yes" if p.peak_memory <= TITAN_H100.memory else "no"
        lines.append(f"| {table} | {run} | {shown} | {gib:.1f} | {error} | {fits} | {unmodelled or '-'} |")
    return "\n".join(lines)


def planning_times() -> str:
    rows = ["| model | GPUs | global batch | layouts that fit | seconds | chosen |", "|---|---|---|---|---|---|"]
    for name, shape, gpus, batch in (("Llama 3.1 8B", LLAMA_8B, 64, 256), ("Llama 3.1 405B", LLAMA_405B, 1024, 512)):
        start = time.perf_counter()
        plan = plan_at_scale(shape, gpus, batch, device="H100")
        seconds = time.perf_counter() - start
        rows.append(f"| {name} | {gpus} | {batch} | {len(plan.options)} | {seconds:.1f} | {plan.layout.text()} |")
    return "\n".join(rows)


def main() -> None:
    print(H.header("published runs"))
    print(megatron_table())
    print()
    print(calibration_sensitivity())
    print()
    print(titan_memory_table())
    print()
    print(planning_times())


if __name__ == "__main__":
    main()
