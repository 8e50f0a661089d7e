"""Every speed goal in one table: each measure beside its peer from the same run, the ratio, met / short.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only JOB,...] [--markdown PATH]
    make bench

The measures come from the benchmark scripts' workers (boxing.py, eager_overhead.py, tp_mlp.py,
hybrid_gpt.py, actor_runtime.py, subclass_floor.py, local_map.py, ...), each run once in its own processes ("jobs"), and models.py's
counts on simulated ranks in this process; in order, with a progress line as each starts and ends. A job that fails gives its rows as n/a; the others still
run. Adding a measure is one entry of ``MEASURES``: the job it reads and a function of that job's
result giving its rows. Ratios are ours / peer, paired per round (the median over rounds of the
two sides' times in the same round; see _harness.py). The scripts themselves print the details.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from dataclasses import dataclass
from typing import Callable, List

import _harness as H
import actor_runtime
import boxing
import consistency_check
import eager_overhead
import gpu
import hybrid_gpt
import local_map
import long_context
import models
import optimizer
import pipeline_schedules
import scale
import soak
import subclass_floor
import torch_compile
import tp_mlp

MB4 = 1024                      # boxing: a 1024 x 1024 fp32 tensor, 4 MB


# -- jobs: a worker run in its own processes -------------------------------------------------
JOBS = {
    "eager": ("eager overhead per op, 2 processes", lambda q: H.spawn(eager_overhead._worker_procs, 2, q, 3)),
    "boxing2": ("1-D boxing of 4 MB, 2 processes", lambda q: H.spawn(boxing._worker, 2, MB4, q, False)),
    "boxing4": ("1-D boxing of 4 MB, 4 processes", lambda q: H.spawn(boxing._worker, 4, MB4, q, False)),
    "tp": ("TP MLP step, 2 processes", lambda q: H.spawn(tp_mlp._worker, 2, q, "sq", 3)),
    "dp": ("DP GPT step (n_embd 256), 2 processes", lambda q: H.spawn(actor_runtime._worker_dp, 2, q)),
    "dp512": ("DP GPT step (n_embd 512), 2 processes",
              lambda q: H.spawn(actor_runtime._worker_dp, 2, q, 4, actor_runtime.GPT_EMBD_LARGE)),
    "floor": ("DP GPT step of one rank (n_embd 256), plain / thin subclass / gt, 1 process",
              lambda q: H.spawn(subclass_floor._worker, 1, q)),
    "floor512": ("DP GPT step of one rank (n_embd 512), plain / thin subclass / gt, 1 process",
                 lambda q: H.spawn(subclass_floor._worker, 1, q, actor_runtime.GPT_EMBD_LARGE)),
    "hybrid": ("2x2 hybrid GPT step (n_embd 256), 4 processes", lambda q: H.spawn(hybrid_gpt._worker, 4, q)),
    "hybrid512": ("2x2 hybrid GPT step (n_embd 512), 4 processes",
                  lambda q: H.spawn(hybrid_gpt._worker, 4, q, actor_runtime.GPT_EMBD_LARGE)),
    "hfloor": ("2x2 hybrid GPT step of one rank (n_embd 256), plain / thin subclass, 1 process",
               lambda q: H.spawn(subclass_floor._worker_hybrid, 1, q)),
    "hfloor512": ("2x2 hybrid GPT step of one rank (n_embd 512), plain / thin subclass, 1 process",
                  lambda q: H.spawn(subclass_floor._worker_hybrid, 1, q, actor_runtime.GPT_EMBD_LARGE)),
    "rt_ops": ("compiled op chain, 2 processes", lambda q: H.spawn(actor_runtime._worker_ops, 2, q)),
    "rt_tp": ("compiled TP MLP step, 2 processes", lambda q: H.spawn(actor_runtime._worker_tp, 2, q)),
    "rt_pp": ("pipeline, 2 processes", lambda q: H.spawn(actor_runtime._worker_pp, 2, q)),
    "pp_sched": ("pipeline schedules, 2 processes", lambda q: H.spawn(pipeline_schedules._worker, 2, q, timeout=1800)),
    "check": ("consistency check off and on, 2 processes",
              lambda q: H.spawn(consistency_check._worker_procs, 2, q)),
    "models": ("HF Llama / GPT-2 and a BatchNorm CNN, bytes per step, 4 simulated ranks", models.measure),
    "optim": ("AdamW step over the GPT's parameters, foreach and fused, 2 processes",
              lambda q: H.spawn(optimizer._worker, 2, q)),
    "optim_sim": ("AdamW foreach and fused steps on 1 and 4 simulated ranks, 1 process",
                  lambda q: H.spawn(optimizer._worker_sim, 0, q)),
    "scale": ("GPT step eager and gt.compile on 4, 16, 64 simulated ranks, 1 process",
              lambda q: H.spawn(scale._worker, 0, q, timeout=3600)),
    "tc_dp": ("torch.compile DP GPT step (n_embd 256), 2 processes",
              lambda q: H.spawn(torch_compile._worker, 2, "dp", q, timeout=1800)),
    "tc_tp": ("torch.compile TP GPT step (n_embd 256), 2 processes",
              lambda q: H.spawn(torch_compile._worker, 2, "tp", q, timeout=1800)),
    "local_map": ("gt.local_map per call beside one eager op and DTensor's local_map, 2 processes and 4 "
                  "simulated ranks", local_map.measure),
    "long_context": ("per-rank peak memory of a T=4096 causal GPT step split on the sequence over 4 processes "
                     "(ring attention) against one device", long_context.measure),
    "gpu": ("GPT training step on one GPU (CUDA only)", lambda q: H.spawn(gpu._worker, 0, q)),
    "soak": ("a training run's length: 10,000 steps eager and compiled on 4 simulated ranks, 1,000 on 2 "
             "processes (--quick: 1,000 and 500)", soak.measure),
}


@dataclass
class Measure:
    job: str
    rows: Callable[[dict], List[list]]      # [measure, ours, peer, ratio, goal, met/short] rows


def row(measure: str, ours: str, peer: str, ratio: float, goal: float, strict: bool = False) -> list:
    """A row whose goal is ``ratio <= goal`` (``< goal`` when ``strict``)."""
    met = ratio < goal if strict else ratio <= goal
    return [measure, ours, peer, f"{ratio:.3f}x", f"{'<' if strict else '<='} {goal}x", "met" if met else "short"]


def eager_rows(res) -> list:
    out = []
    for r in res["rows"]:
        us = lambda v: f"{(v - r['local']) * 1e6:.2f} us"           # noqa: E731
        out.append(row(f"eager overhead, {r['op']} (2 procs) vs thin subclass", us(r["gt"]),
                       f"thin {us(r['thin'])}", eager_overhead._paired_overhead(r["gt"], r["local"], r["thin"]), 1.2))
        out.append(row(f"eager overhead, {r['op']} (2 procs) vs DTensor", us(r["gt"]), f"DTensor {us(r['dt'])}",
                       eager_overhead._paired_overhead(r["gt"], r["local"], r["dt"]), 1.0, strict=True))
    return out


def boxing_rows(res) -> list:
    out = []
    for r in res["one_d"]:
        name = f"boxing {r['conv']} 4 MB ({r['world']} procs)"
        ms = lambda v: f"{H.fmt(v)} ms"                              # noqa: E731
        if r["note"] == "alt raw":
            out.append(row(f"{name} vs raw {r['raw_name']}", ms(r["gt"]), f"raw {ms(r['raw'])}",
                           H.paired_ratio(r["gt"], r["raw"]), 1.2))
            continue
        if r["dt"] is not None:
            out.append(row(f"{name} vs DTensor", ms(r["gt"]), f"DTensor {ms(r['dt'])}",
                           H.paired_ratio(r["gt"], r["dt"]), 1.0))
        else:
            out.append([f"{name} vs DTensor", ms(r["gt"]), "n/a (DTensor cannot)", "-", "<= 1.0x", "-"])
        out.append(row(f"{name} vs raw {r['raw_name']}", ms(r["gt"]), f"raw {ms(r['raw'])}",
                       H.paired_ratio(r["gt"], r["raw"]), 1.2))
    return out


def step_row(measure: str, ours: str, peer: str, peer_label: str, goal: float) -> Callable[[dict], list]:
    def rows(res) -> list:
        t = res["times"]
        return [row(measure, f"{H.fmt(t[ours])} ms", f"{peer_label} {H.fmt(t[peer])} ms",
                    H.paired_ratio(t[ours], t[peer]), goal)]
    return rows


def runtime_rows(part: str) -> Callable[[dict], list]:
    """actor_runtime.py's own summary rows for ``part`` (its detailed tables are not printed here)."""
    def rows(res) -> list:
        summary: list = []
        with contextlib.redirect_stdout(io.StringIO()):
            if part == "ops":
                actor_runtime._report_ops(res, summary)
            elif part == "tp":
                actor_runtime._report_step(res, "hand", "hand-written", "", "2. TP MLP step", summary)
            elif part == "dp":
                actor_runtime._report_step(res, "ddp", "DDP", "", f"3. DP GPT step (n_embd {res['embd']})", summary)
            else:
                actor_runtime._report_pp(res, summary)
        return [[f"traced: {r[0][3:]}"] + r[1:] for r in summary]
    return rows


def model_rows(rows_in) -> list:
    """Bytes and collectives of one training step beside the hand-written ideal (Megatron, one
    all-reduce per gradient, SyncBatchNorm); exact counts, so the goal needs no noise margin."""
    out = []
    for r in rows_in:
        name = f"{r['model']} {r['plan']} step (4 sim. ranks)"
        out.append(row(f"{name}: bytes", f"{r['bytes']:,}", f"ideal {r['ideal bytes']:,}",
                       r["bytes"] / r["ideal bytes"], 1.1))
        out.append(row(f"{name}: collectives", f"{r['collectives']}", f"ideal {r['ideal collectives']}",
                       r["collectives"] / r["ideal collectives"], 1.1))
    return out


def floor_rows(step: str, embd: int) -> Callable[[dict], list]:
    """What any Python tensor subclass pays on one rank's ``step`` (a floor to know, not a goal: the
    steps' goals are against DDP and Megatron, which run no Python per op)."""
    def rows(res) -> list:
        t = res["times"]
        return [[f"{step} (n_embd {embd}) of one rank (1 proc): {k} vs {peer}", f"{H.fmt(t[k])} ms",
                 f"{peer} {H.fmt(t[peer])} ms", f"{H.paired_ratio(t[k], t[peer]):.3f}x", "floor, no goal", "-"]
                for k, peer in (("thin", "plain"), ("gt", "plain"), ("gt", "thin")) if k in t]
    return rows


def optimizer_rows(res) -> list:
    """The optimizer step over global parameters (its update on the pieces) beside plain torch's and
    DTensor's, and the global ops it dispatches; the thin subclass's step beside plain torch's (the
    floor of a step through any Python subclass, no goal)."""
    t, out = res["times"], []
    for mode in ("foreach", "fused"):
        ours, plain, dt, thin = t[f"gt {mode}"], t[f"plain {mode}"], t[f"dt {mode}"], t[f"thin {mode}"]
        out.append(row(f"AdamW {mode} step, GPT parameters (2 procs) vs plain torch", f"{H.fmt(ours)} ms",
                       f"plain {H.fmt(plain)} ms", H.paired_ratio(ours, plain), 1.1))
        out.append(row(f"AdamW {mode} step, GPT parameters (2 procs) vs DTensor", f"{H.fmt(ours)} ms",
                       f"DTensor {H.fmt(dt)} ms", H.paired_ratio(ours, dt), 1.0))
        out.append([f"AdamW {mode} step, GPT parameters (2 procs): thin subclass vs plain torch",
                    f"{H.fmt(thin)} ms", f"plain {H.fmt(plain)} ms", f"{H.paired_ratio(thin, plain):.3f}x",
                    "floor, no goal", "-"])
    dispatched = max(res["calls"].values())
    out.append(["global ops one AdamW step dispatches (its update on pieces)", f"{dispatched}", "-", "-", "0",
                "met" if dispatched == 0 else "short"])
    return out


def gpu_rows(res) -> list:
    """The goals of gpu.py's GOALS on one GPU, each at the sizes it is judged at; the thin subclass's
    eager and AdamW steps beside plain torch's (the floor of any Python subclass, no goal)."""
    if res["device"] is None:
        return [["GPU rows", "n/a (no CUDA device)", "-", "-", "-", "-"]]
    out = []
    for goal, (ours, peer, sizes, most) in gpu.GOALS.items():
        for size in sizes:
            t = res["rows"][size]
            out.append(row(f"GPU {res['device']}: {size}, {goal}", f"{H.fmt(t[ours])} ms",
                           f"{gpu.LABELS[peer]} {H.fmt(t[peer])} ms", H.paired_ratio(t[ours], t[peer]), most))
    for size, t in res["rows"].items():
        for ours, peer in (("thin", "plain"), ("thin step", "plain step")):
            out.append([f"GPU {res['device']}: {size}, {gpu.LABELS[ours]} vs {gpu.LABELS[peer]}",
                        f"{H.fmt(t[ours])} ms", f"{gpu.LABELS[peer]} {H.fmt(t[peer])} ms",
                        f"{H.paired_ratio(t[ours], t[peer]):.3f}x",
                        "floor, no goal", "-"])
    return out


def optimizer_sim_rows(res) -> list:
    """The foreach and fused AdamW steps on simulated ranks beside plain torch's over as many parameter copies."""
    return [row(f"AdamW {mode} step, GPT parameters ({n} simulated rank{'s' if n > 1 else ''}) vs plain torch",
                f"{H.fmt(r['times']['gt'])} ms", f"plain {H.fmt(r['times']['plain'])} ms",
                H.paired_ratio(r["times"]["gt"], r["times"]["plain"]), 1.1) for (n, mode), r in res.items()]


def torch_compile_rows(part: str, res) -> list:
    """torch_compile.py's own summary rows for ``part`` (its tables are not printed here)."""
    summary: list = []
    with contextlib.redirect_stdout(io.StringIO()):
        torch_compile.report(part, res, summary)
    return [[f"torch.compile {r[0]}"] + r[1:] for r in summary]


def soak_rows(res) -> list:
    """soak.py's goals, one row each (its tables are not printed here)."""
    with contextlib.redirect_stdout(io.StringIO()):
        verdicts = soak.verdicts(res)
    return [[f"soak: {goal}", detail, "-", "-", "goal", "met" if met else "short"]
            for goal, (met, detail) in verdicts.items()]


def scale_rows(res) -> list:
    """gt.compile beside eager on simulated meshes (scale.py): compiled at most 0.8x eager."""
    return [row(f"{kind} GPT step, {n} simulated ranks: gt.compile vs eager", f"{H.fmt(r['times']['compiled'])} ms",
                f"eager {H.fmt(r['times']['eager'])} ms", r["ratio"], 0.8) for (kind, n), r in res.items()]


def check_rows(res) -> list:
    """What gt.set_check(True) costs per op (a cost to know, not a goal: the check is off by default)."""
    return [[f"consistency check on, {r['op']} (2 procs)", f"{H.fmt(r['on'], 1e6, 1)} us",
             f"off {H.fmt(r['off'], 1e6, 1)} us", f"{H.paired_ratio(r['on'], r['off']):.1f}x", "cost, no goal", "-"]
            for r in res]


def local_map_rows(res) -> list:
    """local_map's overhead at most 2x one eager op's; below DTensor's local_map's."""
    return [row(what, f"{H.fmt(ours, 1e6, 1)} us", f"{peer_name} {H.fmt(peer, 1e6, 1)} us", ratio,
                local_map.GOAL if peer_name == "eager op" else 1.0, strict=peer_name != "eager op")
            for what, ours, peer, ratio, peer_name in local_map.rows(res["procs"], res["sim"])]


def long_context_rows(res) -> list:
    """The busiest rank's peak memory at most 0.35x one device's."""
    one, busiest = res["one"], max(res["split"]["peaks"])
    return [row(f"long context, T={res['seq']}, peak memory per rank (4 procs, S(1))", f"{busiest:,} B",
                f"one device {one:,} B", busiest / one, long_context.GOAL)]


def schedule_rows(res) -> list:
    """Per m: 1F1B's first-stage activations within its bound, its step at GPipe's or better, the zero
    bubble schedules' (ZB-H1, zbv) below 1F1B's (pipeline_schedules.py; 2 stages, one per process)."""
    out = []
    for (m, name), r in sorted(res.items()):
        gpipe, one_f = res[(m, "gpipe")], res[(m, "1f1b")]
        if name == "1f1b":
            act = r["activations"][0] / gpipe["activations"][0]
            out.append(row(f"pipeline 1F1B, m={m}: stage 0's activations / GPipe's (2 procs)", f"{act:.2f}",
                           f"bound {3 / m:.2f}", act / (3 / m), 1.0))
            out.append(row(f"pipeline 1F1B, m={m}: step vs GPipe (2 procs)", f"{r['step'] * 1e3:.1f} ms",
                           f"GPipe {gpipe['step'] * 1e3:.1f} ms", r["step"] / gpipe["step"], 1.0))
        elif name in ("zero_bubble", "zbv"):
            label = "zero bubble" if name == "zero_bubble" else "zbv"
            out.append(row(f"pipeline {label}, m={m}: step vs 1F1B (2 procs)", f"{r['step'] * 1e3:.1f} ms",
                           f"1F1B {one_f['step'] * 1e3:.1f} ms", r["step"] / one_f["step"], 1.0, strict=True))
    return out


MEASURES = [
    Measure("eager", eager_rows),
    Measure("dp", step_row("DP GPT step (n_embd 256), eager (2 procs, batch split)", "eager", "ddp", "DDP", 1.05)),
    Measure("dp512", step_row("DP GPT step (n_embd 512), eager (2 procs, batch split)", "eager", "ddp", "DDP", 1.05)),
    Measure("floor", floor_rows("DP GPT step", actor_runtime.GPT_EMBD)),
    Measure("floor512", floor_rows("DP GPT step", actor_runtime.GPT_EMBD_LARGE)),
    Measure("hybrid", step_row("2x2 hybrid GPT step (n_embd 256), eager (4 procs)", "gt", "hand", "DDP+Megatron", 1.1)),
    Measure("hybrid512", step_row("2x2 hybrid GPT step (n_embd 512), eager (4 procs)", "gt", "hand", "DDP+Megatron",
                                  1.1)),
    Measure("hfloor", floor_rows("2x2 hybrid GPT step", actor_runtime.GPT_EMBD)),
    Measure("hfloor512", floor_rows("2x2 hybrid GPT step", actor_runtime.GPT_EMBD_LARGE)),
    Measure("boxing2", boxing_rows),
    Measure("boxing4", boxing_rows),
    Measure("tp", step_row("TP MLP step, eager (2 procs)", "gt", "hand", "hand-written", 1.05)),
    Measure("rt_ops", runtime_rows("ops")),
    Measure("rt_tp", runtime_rows("tp")),
    Measure("dp", runtime_rows("dp")),
    Measure("dp512", runtime_rows("dp")),
    Measure("rt_pp", runtime_rows("pp")),
    Measure("pp_sched", schedule_rows),
    Measure("models", model_rows),
    Measure("check", check_rows),
    Measure("optim", optimizer_rows),
    Measure("optim_sim", optimizer_sim_rows),
    Measure("scale", scale_rows),
    Measure("tc_dp", lambda res: torch_compile_rows("dp", res)),
    Measure("tc_tp", lambda res: torch_compile_rows("tp", res)),
    Measure("local_map", local_map_rows),
    Measure("long_context", long_context_rows),
    Measure("gpu", gpu_rows),
    Measure("soak", soak_rows),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--only", help=f"comma-separated jobs to run, of {','.join(JOBS)}")
    ap.add_argument("--markdown", help="also write the table (and the header) to this file")
    args = ap.parse_args(argv)
    wanted = [j for j in JOBS if args.only is None or j in args.only.split(",")]
    if args.only and set(args.only.split(",")) - set(JOBS):
        ap.error(f"--only: expected jobs of {list(JOBS)}, got {args.only!r}")
    head = H.header("run_all")
    print(head, flush=True)
    t0 = time.time()
    results, failed = {}, {}
    for i, job in enumerate(wanted, 1):
        what, run = JOBS[job]
        print(f"[{i}/{len(wanted)}] {job}: {what} ...", flush=True)
        start = time.time()
        try:
            results[job] = run(args.quick)
            print(f"[{i}/{len(wanted)}] {job}: done in {time.time() - start:.0f} s "
                  f"(load average {H.load_average()})", flush=True)
        except Exception as e:  # noqa: BLE001 -- a failing job gives n/a rows, the others still run
            failed[job] = str(e).strip().splitlines()[-1][:100]
            print(f"[{i}/{len(wanted)}] {job}: FAILED after {time.time() - start:.0f} s:\n{e}", flush=True)
    rows = []
    for m in MEASURES:
        if m.job in results:
            rows += m.rows(results[m.job])
        elif m.job in failed:
            rows.append([f"{JOBS[m.job][0]}", f"n/a ({failed[m.job]})", "-", "-", "-", "short"])
    table = H.table(["measure", "ours", "peer", "ratio", "goal", "met/short"], rows,
                    "## Goals (ratio: ours / peer, median over rounds of the paired ratio)")
    met = sum(r[5] == "met" for r in rows)
    short = sum(r[5] == "short" for r in rows)
    tail = (f"{met} met, {short} short; total {time.time() - t0:.0f} s; "
            f"load average at the end {H.load_average()}")
    print("\n" + table + "\n\n" + tail)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{head}\n\n{table}\n\n{tail}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
