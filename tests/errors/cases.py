"""One way to trigger each error of docs/errors.md that a single process can raise (4 simulated
ranks): ``CASES[entry id]()`` raises it. The errors only a process world raises are triggered by
``_process_errors.py`` (see test_process_errors.py)."""
from __future__ import annotations

import contextlib
import io
import os
import types
from unittest import mock

import torch
from torch import nn

import globaltensor as gt
import globaltensor.nn as gnn
from moe_models import MoE
from globaltensor import launch
from globaltensor.comm import timeouts
from globaltensor.comm.process import ProcessWorld

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
relu = torch.ops.aten.relu.default


class _ReadsAValue(nn.Linear):
    """A Linear whose forward asks whether its input has a positive value."""

    def __init__(self):
        super().__init__(4, 4)

    def forward(self, x):
        return super().forward(x) * (2 if bool((x > 0).any()) else 1)


def _styled():
    """A module for the parallel-style cases: a Linear ``fc``, a LayerNorm ``norm``, an Embedding ``emb``."""
    m = nn.Module()
    m.fc, m.norm, m.emb = nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(4, 4)
    return m


def _partial_style():
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import PrepareModuleOutput
    gnn.from_parallel_styles(_styled(), {"fc": PrepareModuleOutput(output_layouts=Partial(),
                                                                   desired_output_layouts=Partial())})


def _laid_out(model):
    gnn.distribute_module(model, p4(), {})
    return model


def _SMALL_SHAPE():
    return gnn.TransformerShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, seq=16)


def p4():
    return gt.placement("cpu", [0, 1, 2, 3])


def p22():
    return gt.placement("cpu", [[0, 1], [2, 3]])


def x84():
    return gt.randn(8, 4, placement=p4(), sbp=S(0))


def p2():
    return gt.placement("cpu", [0, 1])


def x4(placement=None):
    return gt.zeros(4, placement=placement or p2(), sbp=S(0))


def f(*args, **kwargs):
    """A mapped function's stand-in: the messages name it."""
    return args[0] if args else torch.zeros(1)


def _mapped_collective():
    other = x4()

    def f(a):
        return a + other.full_tensor()[:2]
    return gt.local_map(f, (S(0),), S(0))(x4())


def _mapped_shape_changed():
    """A compiled step whose mapped function keeps 2 rows, then 1, as the data says."""
    mapped = gt.local_map(lambda a: a[: int(a[0, 0].item() > 0) + 1], (S(0),), S(0))
    compiled = gt.compile(lambda x: mapped(x) * 2)
    for sign in (1, 1, -1):                 # eager, capture, then a replay with other data
        compiled(gt.distribute(torch.ones(4, 2) * sign, p2(), S(0)))


def _mapped_dtypes():
    return gt.local_map(lambda a: a.double() if gt.local_map.rank() == 0 else a, (S(0),), S(0))(x4())


def _mapped_group_axis():
    return gt.local_map(lambda a: a + len(gt.local_map.group(1)), (S(0),), S(0))(x4())


def _moe(distributed=True, plan=None):
    block = MoE(num_experts=4)
    if distributed:
        gt.nn.distribute_module(block, p2(), plan or {"*_proj": S(0)}, strict=False)
    return block


class Block(torch.nn.Module):
    """A MoE block that routes and loops over its experts in its own forward."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(6, 2)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))

    def forward(self, hidden_states):
        choice = self.router(hidden_states).argmax(-1, keepdim=True)
        return sum(expert(hidden_states) * (choice == e) for e, expert in enumerate(self.experts))


def _moe_plain_inputs():
    block = gt.nn.expert_parallel(_moe(), p2())
    return block.experts(torch.randn(4, 6), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2))


def _moe_compiled():
    block = gt.nn.expert_parallel(_moe(), p2())
    step = gt.compile(lambda x: block(x).sum())
    x = gt.distribute(torch.randn(2, 2, 6), p2(), S(0))
    for _ in range(2):
        step(x)


def _moe_routed(index: torch.Tensor, compiled: bool = False):
    """An expert-parallel experts module (capacity 12 a rank and expert) given 32 tokens routed by
    ``index``; compiled: the graph's run on it, after an eager call and a capture routed evenly."""
    experts = gt.nn.expert_parallel(_moe(plan={"*_proj": S(0)}), p2(), capacity_factor=1.5).experts
    run = gt.compile(lambda x, i, w: experts(x, i, w).sum()) if compiled else experts
    x, weights = (gt.distribute(t, p2(), S(0)) for t in (torch.randn(32, 6), torch.full((32, 2), 0.5)))
    if compiled:
        tokens = torch.arange(32)
        for _ in range(2):
            run(x, gt.distribute(torch.stack([tokens % 4, (tokens + 1) % 4], dim=1), p2(), S(0)), weights)
    return run(x, gt.distribute(index, p2(), S(0)), weights)


def _tied_index():
    return torch.zeros(32, 2, dtype=torch.int64).index_fill_(1, torch.tensor([1]), 1)


def _explicitly(fn):
    with gt.explicit():
        return fn()


def _fused_step(params):
    for t in params:
        t.grad = torch.ones_like(t)
    torch.optim.AdamW(params, lr=0.1, fused=True).step()


@contextlib.contextmanager
def _unlisted(op_name: str):
    """``op_name`` taken off the list of ops whose unreturned writes are kept: a newer torch's op."""
    from globaltensor.ops import dispatch
    from globaltensor.ops.schema import written_args
    listed = written_args.HANDLED.pop(op_name)
    dispatch.CACHE.clear()
    try:
        yield
    finally:
        written_args.HANDLED[op_name] = listed
        dispatch.CACHE.clear()


def _unlisted_fused_step():
    """The fused AdamW op on global tensors (an optimizer's step runs it on the pieces, not here)."""
    with _unlisted("aten._fused_adamw_.default"):
        lists = [[gt.distribute(torch.zeros(8, 4), p4(), S(0))] for _ in range(4)]
        torch.ops.aten._fused_adamw_.default(*lists, [], [torch.zeros(())], lr=0.1, beta1=0.9, beta2=0.999,
                                             weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


def _flash_attention_with_dropout():
    """The CUDA kernel's rule decides on meta pieces, as on a GPU."""
    from globaltensor.boxing import Layout
    from globaltensor.tensor import GlobalTensor
    layout = Layout((4, 4, 16, 32), torch.float16, p4(), (S(0),))
    q = GlobalTensor(layout, {r: torch.empty(layout.piece_shape(r), dtype=torch.float16, device="meta")
                              for r in range(4)})
    torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.1, False)


def _calibrate_one_rank():
    with gt.simulate(1):
        gt.calibrate()


def _assign_split_dim():
    S(0).dim = 1


def _delete_split_dim():
    del S(0).dim


def _stale_world():
    x = x84()
    with gt.simulate(2):
        x.to_global(sbp=B)


def _zero_plain_grad():
    layer = gnn.distribute_module(nn.Linear(4, 4), p4(), {"*": B})
    opt = gnn.ZeroOptimizer(layer.parameters(), torch.optim.SGD, lr=0.1)
    layer.weight.grad = torch.ones(4, 4)
    opt.step()


def _tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight
    gnn.distribute_module(Tied(), p4(), {"a.weight": S(0), "b.weight": B})


def _compiled(fn, *args, **options):
    """Call ``gt.compile(fn, **options)`` three times: warm-up, capture, a graph run."""
    g = gt.compile(fn, **options)
    for _ in range(3):
        g(*args)
    return g


def _layered(layers: int) -> torch.nn.Module:
    """A model whose layers are an nn.ModuleList named ``blocks``."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(layers))
    return model


def _four_stages_two_micro_batches():
    """A 4-stage pipeline (a weight per rank, the activation handed on) under 1F1B with 2 micro-batches."""
    stages = [gt.placement("cpu", [r]) for r in range(4)]
    ws = [gt.randn(4, 4, placement=p, sbp=B).requires_grad_() for p in stages]

    def step(x):
        for p, w in zip(stages, ws):
            x = x.to_global(placement=p, sbp=B) @ w
        x.sum().backward()
    _compiled(step, gt.randn(8, 4, placement=stages[0], sbp=B), micro_batches=2, schedule="1f1b")


def _cuda_graphs_where(gpu: bool, graphs: bool = True):
    """A compiled CPU step with ``cuda_graphs=True`` as torch would be with or without a GPU, and with
    or without CUDA graph support."""
    with mock.patch.dict(torch.cuda.__dict__):          # restored whole afterwards
        torch.cuda.is_available = lambda: gpu
        if not graphs:
            del torch.cuda.CUDAGraph
        _compiled(lambda x: x * 2, x84(), cuda_graphs=True)


def _graph_error():
    """A graph captured on good pieces, then run on an argument of the same meta whose rank-2 piece
    cannot be gathered with the others: the all-gather task raises."""
    g = gt.compile(lambda x: (x * 2).to_global(sbp=B), warmup=0)
    g(x84())
    bad = x84()
    bad._pieces[2] = torch.ones(5, 5)
    g(bad)


def _env_timeout():
    saved, os.environ["GT_COLLECTIVE_TIMEOUT"] = os.environ.get("GT_COLLECTIVE_TIMEOUT"), "soon"
    previous, timeouts._seconds = timeouts._seconds, None
    try:
        timeouts.timeout_s()
    finally:
        timeouts._seconds = previous
        if saved is None:
            del os.environ["GT_COLLECTIVE_TIMEOUT"]
        else:
            os.environ["GT_COLLECTIVE_TIMEOUT"] = saved


def _process_world_env():
    saved = {k: os.environ.pop(k, None) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(WORLD_SIZE="2", RANK="0")
    try:
        ProcessWorld()
    finally:
        for k in ("WORLD_SIZE", "RANK"):
            del os.environ[k]
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def _check_replicas():
    previous = gt.set_check(True)
    try:
        x = gt.distribute(torch.arange(8.0).reshape(4, 2), p4(), B)
        x.to_local(rank=2).add_(1)                 # rank 2's replica no longer equals the others
        x * 2
    finally:
        gt.set_check(previous)


def _check_piece_shape():
    previous = gt.set_check(True)
    try:
        x = gt.distribute(torch.arange(8.0).reshape(4, 2), p4(), S(0))
        x._pieces[1] = torch.zeros(3, 2)           # not the piece S(0) gives rank 1
        x.to_global(sbp=B)
    finally:
        gt.set_check(previous)


def _profile_table(by):
    with gt.comm_profile() as prof:
        x84().to_global(sbp=B)
    prof.table(by=by)


def _no_sync_optimizer():
    with gnn.no_sync(torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)):
        pass


def _launch(*argv):
    """The launcher's command line: argparse prints ``... error: MESSAGE`` and exits with status 2;
    raised here as that SystemExit with the message, for the catalogue to compare."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            launch.parse_args(list(argv))
    except SystemExit as e:
        assert e.code == 2, e.code
        raise SystemExit(err.getvalue().strip().splitlines()[-1].split(" error: ", 1)[1]) from None


CASES = {
    # placements
    "placement-type-not-str": lambda: gt.placement(3, [0]),
    "placement-type-unknown": lambda: gt.placement("tpu", [0]),
    "placement-ranks-missing": lambda: gt.placement("cpu"),
    "placement-ranks-int": lambda: gt.placement("cpu", 3),
    "placement-ranks-not-ints": lambda: gt.placement("cpu", [0, "1"]),
    "placement-ranks-ragged": lambda: gt.placement("cpu", [[0, 1], [2]]),
    "placement-ranks-empty": lambda: gt.placement("cpu", []),
    "placement-ranks-duplicate": lambda: gt.placement("cpu", [0, 1, 1]),
    "placement-ranks-negative": lambda: gt.placement("cpu", [-1, 0]),
    "placement-ranks-outside-world": lambda: gt.placement("cpu", [0, 7]),
    "placement-coord-outside": lambda: p4().coord(7),
    # SBP
    "split-dim-not-int": lambda: S("0"),
    "split-blocks-not-int": lambda: S(1, blocks=0),
    "split-order-unknown": lambda: S(1, order="zigzag"),
    "split-blocks-layout": lambda: gt.randn(8, 5, placement=p4(), sbp=S(1, blocks=3)),
    "dtensor-blocked-split": lambda: gt.randn(8, 6, placement=p4(), sbp=S(1, blocks=3)).to_dtensor(),
    "sbp-immutable": _assign_split_dim,
    "sbp-immutable-delete": _delete_split_dim,
    "sbp-not-sbp": lambda: x84().to_global(sbp="B"),
    "sbp-value-not-sbp": lambda: gt.randn(4, 4, placement=p22(), sbp=(S(0), "B")),
    "sbp-length": lambda: gt.randn(4, 4, placement=p22(), sbp=S(0)),
    "split-dim-out-of-range": lambda: gt.randn(4, 4, placement=p4(), sbp=S(2)),
    "split-of-0-dim": lambda: gt.randn(placement=p4(), sbp=S(0)),
    # global tensors
    "to-global-not-tensor": lambda: gt.to_global([1.0, 2.0], placement=p4(), sbp=B),
    "to-global-needs-placement-and-sbp": lambda: torch.ones(2).to_global(placement=p4()),
    "to-global-placement-type": lambda: torch.ones(2).to_global(placement="cpu", sbp=B),
    "to-global-sbp-for-new-ndim": lambda: x84().to_global(placement=p22()),
    "to-global-device": lambda: torch.ones(2).to_global(placement=gt.placement("cuda", [0, 1, 2, 3]), sbp=B),
    "to-global-piece-shape": lambda: gt.to_global(torch.ones(3, 2), placement=p4(), sbp=S(0), shape=(8, 2)),
    "to-local-rank": lambda: x84().to_local(rank=5),
    "distribute-not-plain": lambda: gt.distribute(x84(), p4(), B),
    "stale-world": _stale_world,
    # per-rank code: gt.local_map
    "local-map-fn-not-callable": lambda: gt.local_map(3, (S(0),), S(0)),
    "local-map-in-sbp-not-sequence": lambda: gt.local_map(f, S(0), S(0)),
    "local-map-arity": lambda: gt.local_map(f, (S(0), B), S(0))(x4()),
    "local-map-global-keyword": lambda: gt.local_map(f, (S(0),), S(0))(x4(), b=x4()),
    "local-map-global-without-sbp": lambda: gt.local_map(f, (None,), S(0))(x4()),
    "local-map-plain-with-sbp": lambda: gt.local_map(f, (S(0),), S(0))(torch.zeros(4)),
    "local-map-placement-differs": lambda: gt.local_map(f, (S(0),), S(0), placement=gt.placement("cpu", [1, 0]))(x4()),
    "local-map-two-placements": lambda: gt.local_map(f, (S(0), S(0)), S(0))(x4(), x4(gt.placement("cpu", [1, 0]))),
    "local-map-needs-placement": lambda: gt.local_map(f, (), S(0))(),
    "local-map-result-count": lambda: gt.local_map(lambda a: (a, a), (S(0),), S(0))(x4()),
    "local-map-non-tensor-with-sbp": lambda: gt.local_map(lambda a: (a, 3), (S(0),), (S(0), S(0)))(x4()),
    "local-map-value-differs": lambda: gt.local_map(lambda a: (a, gt.local_map.rank()), (S(0),), (S(0), None))(x4()),
    "local-map-result-without-sbp": lambda: gt.local_map(lambda a: a, (S(0),), None)(x4()),
    "local-map-result-not-plain": lambda: gt.local_map(lambda a: x4(), (S(0),), S(0))(x4()),
    "local-map-result-dtypes": _mapped_dtypes,
    "local-map-outside-call": lambda: gt.local_map.rank(),
    "local-map-group-axis": _mapped_group_axis,
    "local-map-collective": _mapped_collective,
    "local-map-compiled-shape-changed": _mapped_shape_changed,
    # expert parallelism
    "expert-parallel-axis": lambda: gt.nn.expert_parallel(_moe(), p2(), axis=1),
    "expert-parallel-no-experts": lambda: gt.nn.expert_parallel(torch.nn.Linear(2, 2), p2()),
    "expert-parallel-routing-block": lambda: gt.nn.expert_parallel(Block(), p2()),
    "expert-parallel-not-distributed": lambda: gt.nn.expert_parallel(_moe(distributed=False), p2()),
    "expert-parallel-weight-layout": lambda: gt.nn.expert_parallel(_moe(plan={"*down_proj": S(0)}), p2()),
    "expert-parallel-plain-inputs": _moe_plain_inputs,
    "expert-parallel-compile": _moe_compiled,
    "expert-parallel-capacity-factor": lambda: gt.nn.expert_parallel(_moe(), p2(), capacity_factor=0),
    "expert-parallel-over-capacity": lambda: _moe_routed(_tied_index()),
    "expert-parallel-over-capacity-compiled": lambda: _moe_routed(_tied_index(), compiled=True),
    # ops
    "op-placements-differ": lambda: x84() + gt.randn(8, 4, placement=gt.placement("cpu", [0, 1]), sbp=S(0)),
    "op-writes-plain": lambda: torch.zeros(8, 4).add_(x84()),
    "op-writes-unlisted": _unlisted_fused_step,
    "auto-plan-model": lambda: gnn.auto_plan("net", p4(), [(8, 4)]),
    "auto-plan-placement": lambda: gnn.auto_plan(nn.Linear(4, 4), [0, 1, 2, 3], [(8, 4)]),
    "auto-plan-args": lambda: gnn.auto_plan(nn.Linear(4, 4), p4(), "x"),
    "auto-plan-arg": lambda: gnn.auto_plan(nn.Linear(4, 4), p4(), ["x"]),
    "auto-plan-step": lambda: gnn.auto_plan(nn.Linear(4, 4), p4(), [(8, 4)], step=3),
    "auto-plan-host-read": lambda: gnn.auto_plan(_ReadsAValue(), p4(), [(6, 4)]),
    "auto-plan-memory-limit": lambda: gnn.auto_plan(nn.Linear(4, 4), p4(), [(8, 4)], memory_limit=-1),
    "auto-plan-no-fit": lambda: gnn.auto_plan(nn.Linear(4, 4), p4(), [(8, 4)], memory_limit=100),
    "auto-plan-device": lambda: gnn.auto_plan(nn.Linear(4, 4), p4(), [(8, 4)], device="TPU"),
    "auto-plan-predict-loaded": lambda: gnn.AutoPlan.from_dict(gnn.auto_plan(nn.Linear(4, 4), p4(), [(8, 4)])
                                                                .to_dict()).predict(),
    "predict-step-model": lambda: gnn.predict_step("net", [x84()]),
    "predict-step-plain": lambda: gnn.predict_step(nn.Linear(4, 4), [x84()]),
    "predict-step-args": lambda: gnn.predict_step(_laid_out(nn.Linear(4, 4)), [torch.zeros(8, 4)]),
    "predict-step-host-read": lambda: gnn.predict_step(_laid_out(_ReadsAValue()), [x84()]),
    "scale-shape-heads": lambda: gnn.TransformerShape(layers=2, hidden=64, heads=6, kv_heads=6, ffn=256, vocab=100,
                                                      seq=16),
    "scale-shape-moe": lambda: gnn.TransformerShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100,
                                                    seq=16, experts=8, top_k=0, expert_ffn=128),
    "scale-shape-config": lambda: gnn.TransformerShape.of(nn.Linear(4, 4), seq=16),
    "scale-plan-shape": lambda: gnn.plan_at_scale("llama", gpus=8, global_batch=8),
    "scale-plan-device": lambda: gnn.plan_at_scale(_SMALL_SHAPE(), gpus=8, global_batch=8, device=None),
    "scale-plan-no-fit": lambda: gnn.plan_at_scale(_SMALL_SHAPE(), gpus=8, global_batch=8, memory_limit=1),
    "scale-plan-layout": lambda: gnn.plan_at_scale(_SMALL_SHAPE(), gpus=8, global_batch=8).predict(
        gnn.ScaleLayout(dp=4)),
    "calibrate-argument": lambda: gt.calibrate(small=0),
    "calibrate-sizes": lambda: gt.calibrate(small=4096, large=1024),
    "calibrate-world": _calibrate_one_rank,
    "cuda-attention-dropout": _flash_attention_with_dropout,
    "list-op-plain-element": lambda: _fused_step([gt.distribute(torch.zeros(8, 4), p4(), S(0)).requires_grad_(),
                                                  torch.zeros(3, requires_grad=True)]),
    "torch-op-error": lambda: x84() @ x84(),
    "cast-device": lambda: x84().to("lazy"),        # "cuda" with CUDA; torch refuses it above the dispatcher without
    "cast-meta": lambda: x84() + torch._efficientzerotensor(8, 4),
    "op-sparse-input": lambda: torch.sparse.mm(torch.eye(8).to_sparse(), x84()),
    "op-sparse-result": lambda: x84().to_sparse(),
    "resize-elements": lambda: x84().resize_(100),
    "implicit-boxing": lambda: _explicitly(lambda: x84() @ gt.randn(4, 3, placement=p4(), sbp=S(0))),
    # factories and random numbers
    "factory-size": lambda: gt.zeros(-1, 4, placement=p4(), sbp=B),
    "factory-placement": lambda: gt.ones(4, placement="cpu", sbp=B),
    "factory-sbp-required": lambda: gt.zeros(4, placement=p4()),
    "factory-dtype": lambda: gt.zeros(4, placement=p4(), sbp=B, dtype="float32"),
    "random-not-floating": lambda: gt.randn(4, placement=p4(), sbp=B, dtype=torch.int64),
    "arange-step": lambda: gt.arange(0, 10, -1, placement=p4(), sbp=B),
    "manual-seed": lambda: gt.manual_seed(1.5),
    # rules
    "rule-op": lambda: gt.register_rule("aten.relu", ["S(0) -> S(0)"]),
    "rule-candidates": lambda: gt.register_rule(relu, "S(0) -> S(0)"),
    "rule-candidate-unreadable": lambda: gt.register_rule(relu, ["S(0) -> X"]),
    "rule-candidate-no-arrow": lambda: gt.register_rule(relu, ["S(0)"]),
    "rule-function": lambda: gt.register_rule(relu, ["S(0) -> S(0)"], local="rows"),
    "rule-any-order": lambda: gt.register_rule(relu, ["S(0) -> S(0)"], any_order="head_tail"),
    "rule-keyed": lambda: gt.register_rule(relu, ["S(0) -> S(0)"], keyed=["value"]),
    "rule-keyed-name": lambda: gt.register_rule(torch.ops.aten.masked_fill.Scalar, ["S(0), S(0) -> S(0)"],
                                                keyed={"fill": None}),
    "dispatch-cache-size": lambda: gt.set_dispatch_cache_size(1),
    # modules and optimizers
    "plan-type": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), "colwise"),
    "plan-entry": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), [("weight", S(0), "extra")]),
    "plan-pattern": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {0: S(0)}),
    "plan-sbp": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"weight": 0.5}),
    "plan-style-name": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"weight": "column"}),
    "plan-style-placement": lambda: gnn.distribute_module(_styled(), p22(), {"fc": "colwise"}),
    "styles-module": lambda: gnn.from_parallel_styles(object(), {}),
    "styles-dict": lambda: gnn.from_parallel_styles(_styled(), [("fc", "colwise")]),
    "styles-unmatched": lambda: gnn.from_parallel_styles(_styled(), {"nowhere": "colwise"}),
    "styles-value": lambda: gnn.from_parallel_styles(_styled(), {"fc": 3}),
    "styles-unknown-name": lambda: gnn.from_parallel_styles(_styled(), {"fc": "column"}),
    "styles-local": lambda: gnn.from_parallel_styles(_styled(), {"fc": "local_colwise"}),
    "styles-layer": lambda: gnn.from_parallel_styles(_styled(), {"norm": "colwise"}),
    "styles-packed-layer": lambda: gnn.from_parallel_styles(_styled(), {"emb": "packed_colwise"}),
    "styles-parameter": lambda: gnn.from_parallel_styles(_styled(), {"norm.weight": "colwise"}),
    "styles-partial": _partial_style,
    "hf-tp-plan-none": lambda: gnn.hf_tp_plan(_styled()),
    "plan-partial": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"weight": P}),
    "plan-unused": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"*.qkv.weight": S(0)}),
    "plan-tied": _tied,
    "plan-activation-sbp": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"*.up:input": (None, None)}),
    "plan-activation-partial": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"fc:output": P}),
    "plan-activation-ndim": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"fc:input": (None, B)}),
    "plan-activation-unused": lambda: gnn.distribute_module(nn.Linear(4, 4), p4(), {"*.nowhere:input": B}),
    "distribute-module-placement": lambda: gnn.distribute_module(nn.Linear(4, 4), "cpu", {}),
    "distribute-module-module": lambda: gnn.distribute_module(lambda x: x, p4(), {}),
    "plan-axis": lambda: gnn.on_axis(S(0), axis=2, ndim=2),
    "plan-ndim": lambda: gnn.on_axis(S(0), axis=0, ndim=0),
    "layer-plan-pattern": lambda: gnn.layer_plan(3, gnn.COLUMN_PARALLEL),
    "zero-optimizer-class": lambda: gnn.ZeroOptimizer([], "adam"),
    "zero-plain-parameter": lambda: gnn.ZeroOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD, lr=0.1),
    "zero-axis": lambda: gnn.ZeroOptimizer(gnn.distribute_module(nn.Linear(4, 4), p4(), {"*": B}).parameters(),
                                           torch.optim.SGD, axis=1, lr=0.1),
    "zero-partial-parameter": lambda: gnn.ZeroOptimizer([nn.Parameter(gt.zeros(4, placement=p4(), sbp=P))],
                                                        torch.optim.SGD, lr=0.1),
    "zero-plain-gradient": _zero_plain_grad,
    "megatron-plan-flags": lambda: gnn.megatron_plan(["*.fc1"], ["*.fc2"], bias="no"),
    "megatron-plan-patterns": lambda: gnn.megatron_plan(column="*.mlp.fc1"),
    "megatron-plan-extra": lambda: gnn.megatron_plan(["*.fc1"], ["*.fc2"], extra=[("lm_head.weight", S(0))]),
    "model-plan-config": lambda: gnn.gpt2_plan({"n_head": 32}, 4),
    "llama-plan-heads": lambda: gnn.llama_plan({"num_attention_heads": 32}, 4),
    "model-plan-ranks": lambda: gnn.llama_plan(types.SimpleNamespace(num_attention_heads=32), 0),
    "bucket-gradients-params": lambda: gnn.bucket_gradients(3),
    "no-sync-module": _no_sync_optimizer,
    "init-optimizer-state": lambda: gnn.init_optimizer_state(nn.Linear(4, 4)),
    # inspection
    "boxing-plan-tensor": lambda: gt.boxing_plan(torch.ones(2), sbp=B),
    "boxing-plan-placement": lambda: gt.boxing_plan(x84(), placement="cpu"),
    "visualize-tensor": lambda: gt.visualize(torch.ones(2)),
    "visualize-ndim": lambda: gt.visualize(gt.randn(2, 2, 2, placement=p4(), sbp=S(0))),
    # profiling and logging
    "comm-profile-module": lambda: gt.comm_profile("model"),
    "profile-by": lambda: _profile_table("rank"),
    "profile-by-type": lambda: _profile_table(0),
    "log-level-type": lambda: gt.set_log_level(True),
    "log-level-name": lambda: gt.set_log_level("verbose"),
    # DTensor (the errors that need a DTensor, and so a process world: _process_errors.py)
    "to-dtensor-tensor": lambda: gt.to_dtensor(torch.ones(2)),
    "to-dtensor-mesh-type": lambda: x84().to_dtensor(mesh="cpu"),
    "dtensor-needs-process-world": lambda: x84().to_dtensor(),
    "from-dtensor-tensor": lambda: gt.from_dtensor(x84()),
    "from-dtensor-module-module": lambda: gnn.from_dtensor_module(nn.Linear(4, 4).state_dict()),
    "to-dtensor-module-module": lambda: gnn.to_dtensor_module(nn.Linear(4, 4).parameters()),
    # traced mode
    "compile-function": lambda: gt.compile(3),
    "compile-micro-batches": lambda: gt.compile(lambda x: x, micro_batches=0),
    "compile-registers": lambda: gt.compile(lambda x: x, registers=0),
    "compile-warmup": lambda: gt.compile(lambda x: x, warmup=-1),
    "compile-streams": lambda: gt.compile(lambda x: x, streams="fast"),
    "compile-argument": lambda: gt.compile(lambda x, y: x)(x84(), {"a": [1]}.keys()),
    "compile-bucket-bytes": lambda: gt.compile(lambda x: x, bucket_bytes=-1),
    "compile-cuda-graphs-type": lambda: gt.compile(lambda x: x, cuda_graphs="yes"),
    "compile-cuda-graphs-no-gpu": lambda: _cuda_graphs_where(gpu=False),
    "compile-cuda-graphs-unsupported": lambda: _cuda_graphs_where(gpu=True, graphs=False),
    "compile-cuda-graphs-nothing-to-capture": lambda: _cuda_graphs_where(gpu=True),
    "compile-nothing-captured": lambda: gt.compile(lambda x: x).plan,
    "compile-no-timeline": lambda: _compiled(lambda x: x * 2, x84()).trace_to("trace.json"),
    "compile-register-count": lambda: _compiled(lambda x: x * 2, x84(), registers=lambda task: 0),
    "compile-stream-name": lambda: _compiled(lambda x: x * 2, x84(), streams=lambda task: ""),
    "compile-micro-batch-shape": lambda: _compiled(lambda x: x.sum(), gt.randn(6, 4, placement=p4(), sbp=B),
                                                   micro_batches=4),
    "compile-micro-batch-pieces": lambda: _compiled(lambda x: x.sum(), gt.randn(6, 4, placement=p4(), sbp=S(0)),
                                                    micro_batches=2),
    "compile-micro-batches-without-backward": lambda: _compiled(lambda x: x * 2, gt.randn(8, 4, placement=p4(),
                                                                                            sbp=S(0)),
                                                                micro_batches=2),
    "pipeline-stages": lambda: gt.nn.pipeline_stages(_layered(2), [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])],
                                                     chunks_per_stage=2),
    "pipeline-stages-placements": lambda: gt.nn.pipeline_stages(_layered(2), "cpu"),
    "pipeline-stages-cut": lambda: gt.nn.pipeline_stages(_layered(2), [gt.placement("cpu", [0, 1]),
                                                                        gt.placement("cpu", [2, 3])], cut="flops"),
    "pipeline-stages-cut-sizes": lambda: gt.nn.pipeline_stages(_layered(2), [gt.placement("cpu", [0, 1]),
                                                                              gt.placement("cpu", [2, 3])], cut=[1, 2]),
    "compile-schedule-name": lambda: gt.compile(lambda x: x, micro_batches=8, schedule="1F1B"),
    "compile-schedule": _four_stages_two_micro_batches,
    "capture-host-read": lambda: _compiled(lambda x: x * x.sum().item(), x84()),
    "capture-data-dependent": lambda: _compiled(lambda x: torch.nonzero(x.to_global(sbp=B)), x84()),
    "graph-error": _graph_error,
    # worlds, timeouts, the consistency check
    "simulate-n": lambda: gt.simulate(0),
    "set-timeout": lambda: gt.set_timeout(0),
    "timeout-environment": _env_timeout,
    "process-world-environment": _process_world_env,
    "set-check": lambda: gt.set_check("yes"),
    "check-replicas": _check_replicas,
    "check-piece-shape": _check_piece_shape,
    # the launcher's command line
    "launch-number": lambda: _launch("--nproc-per-node", "0", "train.py"),
    "launch-script": lambda: _launch("--nproc-per-node", "2", "no_such_script.py"),
}
