"""Real models at Megatron's bytes: HuggingFace Llama and GPT-2 (tiny configs, their own code) and a
small CNN with BatchNorm, one training step on 4 simulated ranks.

For each model, attention implementation and plan -- tensor parallel (``gt.nn.llama_plan`` /
``gt.nn.gpt2_plan`` over 4 ranks), data parallel (batch split, parameters broadcast), 2x2
hybrid (data axis 0, tensor axis 1) -- the table gives the bytes one rank sends and the
collectives of a step (forward, backward, the gradients read as the optimizer reads them),
beside the hand-written ideal:

- tensor parallel, Megatron: per layer one all-reduce of the activations after attention and
  one after the MLP in the forward, the same in the backward;
- data parallel: each parameter's gradient all-reduced once;
- 2x2: Megatron's all-reduces in each data group plus each parameter piece's gradient
  all-reduced once over the data axis;
- the CNN's BatchNorm over a split batch: torch.nn.SyncBatchNorm's all-gather of per-channel
  mean, inverse std and count in the forward and all-reduce of two per-channel sums in the
  backward.

Step times are the median of ``--repeats`` steps on 4 simulated ranks (one process running
every rank's pieces in turn) beside the same step on one device; the simulated step does the
work of all 4 ranks, so it says what the dispatch costs, not what 4 processes would take.

    .venv/bin/python benchmarks/models.py [--quick] [--dtype float32|float64]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB, HIDDEN, LAYERS, HEADS, BATCH, SEQ = 128, 64, 2, 4, 8, 16
KV_HEADS = 2            # llama-gqa: fewer kv heads than the 4 tensor-parallel ranks (sdpa's enable_gqa)


def make_model(kind: str, attn: str, dtype) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind.startswith("llama"):
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS if kind == "llama-gqa" else HEADS,
                          max_position_embeddings=4 * SEQ, attn_implementation=attn)
        return LlamaForCausalLM(cfg).to(dtype)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=4 * SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation=attn)
    return GPT2LMHeadModel(cfg).to(dtype)


def loss_of(model, ids):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def all_reduce_bytes(p: int, nbytes: int) -> int:
    return 2 * (p - 1) * nbytes // p


def gradient_bytes(model, axis: int) -> int:
    """One rank's bytes all-reducing each parameter's piece over placement axis ``axis``."""
    total = 0
    for prm in model.parameters():
        k = prm.placement.hierarchy[axis]
        total += all_reduce_bytes(k, prm.layout_meta.piece_bytes(prm.placement.rank_list()[0]))
    return total


def ideal(plan: str, model, itemsize: int) -> tuple:
    """(bytes, collectives) of the hand-written step."""
    n_params = len(list(model.parameters()))
    if plan == "tp":
        # Megatron with fewer kv heads than ranks repeats them over the ranks: their projections'
        # gradients are all-reduced too
        kv = [p for name, p in model.named_parameters() if name.endswith(("k_proj.weight", "v_proj.weight"))
              and all(v.is_broadcast for v in p.sbp)]
        kv_bytes = sum(all_reduce_bytes(4, p.layout_meta.piece_bytes(0)) for p in kv)
        return 4 * LAYERS * all_reduce_bytes(4, BATCH * SEQ * HIDDEN * itemsize) + kv_bytes, 4 * LAYERS + len(kv)
    if plan == "dp":
        return gradient_bytes(model, 0), n_params
    megatron = 4 * LAYERS * all_reduce_bytes(2, BATCH // 2 * SEQ * HIDDEN * itemsize)
    return megatron + gradient_bytes(model, 0), 2 * 4 * LAYERS + 2 * n_params


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_transformer(kind: str, attn: str, plan: str, dtype, repeats: int) -> dict:
    model = make_model(kind, attn, dtype)
    reference = copy.deepcopy(model)
    placement = gt.placement("cpu", [[0, 1], [2, 3]] if plan == "2x2" else [0, 1, 2, 3])
    plans = {"llama": gt.nn.llama_plan, "llama-gqa": gt.nn.llama_plan, "gpt2": gt.nn.gpt2_plan}[kind]
    layout = {"tp": plans(model, 4), "dp": {}, "2x2": plans(model, 2, axis=1, ndim=2)}[plan]
    gt.nn.distribute_module(model, placement, layout)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    gids = gt.distribute(ids, placement, {"tp": B, "dp": S(0), "2x2": (S(0), B)}[plan])
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(m, o, x):
        loss_of(m, x).backward()
        o.step()
        o.zero_grad()

    step(model, opt, gids)                          # first call: signatures decided, cached
    with gt.comm_stats() as st:
        step(model, opt, gids)
    want_bytes, want_count = ideal(plan, model, torch.finfo(dtype).bits // 8)
    return {"model": f"{kind} {attn}", "plan": plan, "bytes": st.bytes_sent, "collectives": st.count,
            "ideal bytes": want_bytes, "ideal collectives": want_count,
            "gt ms": 1e3 * timed(lambda: step(model, opt, gids), repeats),
            "1 device ms": 1e3 * timed(lambda: step(reference, ref_opt, ids), repeats)}


class SmallCNN(torch.nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.fc = torch.nn.Linear(channels * 4 * 4, 5)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def run_cnn(dtype, repeats: int) -> dict:
    torch.manual_seed(0)
    model = SmallCNN().to(dtype)
    reference = copy.deepcopy(model)
    placement = gt.placement("cpu", [0, 1, 2, 3])
    gt.nn.distribute_module(model, placement)
    x, y = torch.randn(32, 3, 8, 8, dtype=dtype), torch.randint(0, 5, (32,))
    gx, gy = gt.distribute(x, placement, S(0)), gt.distribute(y, placement, S(0))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(m, o, a, b):
        F.cross_entropy(m(a), b).backward()
        o.step()
        o.zero_grad()

    step(model, opt, gx, gy)
    with gt.comm_stats() as st:
        step(model, opt, gx, gy)
    itemsize, c = torch.finfo(dtype).bits // 8, model.bn.num_features
    sync_bn = 3 * (2 * c + 1) * itemsize + all_reduce_bytes(4, 2 * c * itemsize)   # ring all-gather + all-reduce
    return {"model": "cnn + BatchNorm", "plan": "dp", "bytes": st.bytes_sent, "collectives": st.count,
            "ideal bytes": gradient_bytes(model, 0) + sync_bn, "ideal collectives": len(list(model.parameters())) + 2,
            "gt ms": 1e3 * timed(lambda: step(model, opt, gx, gy), repeats),
            "1 device ms": 1e3 * timed(lambda: step(reference, ref_opt, x, y), repeats)}


def measure(quick: bool, dtype=torch.float32) -> list:
    """One row per model, attention and plan (and the CNN), each printed as it is measured."""
    torch.set_num_threads(1)
    repeats = 3 if quick else 10
    warnings.filterwarnings("ignore", message=".*(bos|eos)_token_id.*")
    rows = []
    with gt.simulate(4):
        for kind, attns in (("llama", ("sdpa", "eager")), ("llama-gqa", ("sdpa",)), ("gpt2", ("sdpa", "eager"))):
            for attn in attns:
                for plan in ("tp", "dp", "2x2"):
                    print(f"  models: {kind} {attn} {plan} ...", flush=True)
                    rows.append(run_transformer(kind, attn, plan, dtype, repeats))
        print("  models: cnn + BatchNorm ...", flush=True)
        rows.append(run_cnn(dtype, repeats))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed steps instead of 10")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = measure(args.quick, dtype)
    print(f"one training step, 4 simulated ranks, {args.dtype}; batch {BATCH} x {SEQ} tokens, hidden {HIDDEN}, "
          f"{LAYERS} layers; ideal = Megatron (tp), one all-reduce per gradient (dp), both (2x2), "
          f"SyncBatchNorm + gradients (cnn)")
    head = f"{'model':<16}{'plan':<6}{'bytes':>11}{'ideal':>11}{'ratio':>7}{'coll.':>7}{'ideal':>7}" \
           f"{'ratio':>7}{'gt ms':>9}{'1 dev ms':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<16}{r['plan']:<6}{r['bytes']:>11,}{r['ideal bytes']:>11,}"
              f"{r['bytes'] / r['ideal bytes']:>7.2f}{r['collectives']:>7}{r['ideal collectives']:>7}"
              f"{r['collectives'] / r['ideal collectives']:>7.2f}{r['gt ms']:>9.1f}{r['1 device ms']:>10.1f}")


if __name__ == "__main__":
    main()
