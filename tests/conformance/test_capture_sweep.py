"""Every rule kernel is capturable where its op has static shapes: ``gt.compile`` over the conformance
recipes (opinfo_run.plan) of the OpInfo ops that reach the kernels, compared with eager
(capture_run.py). A kernel that made a shape depend on the data (boolean indexing) would raise
gt.CaptureError here, as the vocabulary-split embedding backward once did on a 4x4 mesh."""
import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest, a dev extra "
                                         "(pip install -e '.[dev]'; make test installs it)")

import capture_run  # noqa: E402
import opinfo_run as run  # noqa: E402
from globaltensor.ops.registry import RULES  # noqa: E402

# the OpInfo ops whose samples reach the rule kernels
SWEEP = [
    "nn.functional.adaptive_avg_pool2d", "nn.functional.adaptive_avg_pool3d", "nn.functional.adaptive_max_pool2d",
    "nn.functional.adaptive_max_pool3d", "nn.functional.avg_pool2d", "nn.functional.avg_pool3d",
    "nn.functional.max_pool2d", "nn.functional.max_pool3d", "max_pool2d_with_indices_backward",
    "fft.fft", "fft.rfft", "fft.irfft", "softmax", "log_softmax", "_softmax_backward_data",
    "nn.functional.batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
    "nn.functional.scaled_dot_product_attention", "nn.functional.interpolate.nearest",
    "nn.functional.interpolate.nearest-exact", "nn.functional.interpolate.linear",
    "nn.functional.interpolate.bilinear", "nn.functional.interpolate.bicubic", "nn.functional.interpolate.trilinear",
    "_upsample_bilinear2d_aa", "bernoulli", "nn.functional.dropout", "nn.functional.unfold", "nn.functional.conv1d",
    "nn.functional.conv2d", "nn.functional.conv3d", "nn.functional.embedding", "nn.functional.nll_loss",
    "nn.functional.cross_entropy", "rand_like", "randn_like", "randint_like", "nn.functional.pad.replicate",
    "linalg.vector_norm",
]

# kernels neither an OpInfo sample nor capture_run.EXTRA reaches on global tensors, and why
UNREACHED = {
    "aten._upsample_bicubic2d_aa.default": "no OpInfo op samples bicubic antialiasing",
    "aten._upsample_bicubic2d_aa_backward.default": "no OpInfo op samples bicubic antialiasing",
    "aten._native_batch_norm_legit_functional.default": "made by functionalization (torch.compile), not eager",
    "aten.embedding_renorm.default": "the functional form, made by functionalization (torch.compile)",
    **{f"aten.norm.{o}": "torch.norm with a number p reaches linalg_vector_norm; aten.norm only by a direct call "
                         "(tests/ops/test_reduction.py runs each candidate)"
       for o in ("Scalar", "ScalarOpt_dim", "ScalarOpt_dim_dtype", "ScalarOpt_dtype")},
}

OPS = {run.op_id(op): op for op in run.load_ops()}


def _cases(name):
    op = OPS[name]
    have = run.samples(op, run.FLAG_SAMPLES_LOOKED_AT)
    return op, have, [(i, recipe, seed) for i, recipe, seed in run.plan(op, have) if i < len(have)]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", [n for n in SWEEP if n in OPS])
def test_compiled_kernels_equal_eager(name):
    op, have, cases = _cases(name)
    ran = 0
    for i, recipe, seed in cases:
        result = capture_run.compare_compiled(op, have[i], recipe, seed)
        if result.skipped:
            continue
        assert not result.problem, f"{name} sample {i} on {recipe}: {result.problem}"
        ran += 1
    assert ran, f"{name}: every case was skipped"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(capture_run.EXTRA))
def test_compiled_kernels_the_samples_miss_equal_eager(name):
    result = capture_run.compare_extra(name)
    assert not result.problem, f"{name}: {result.problem}"
    assert result.kernels, f"{name} reached no rule kernel"


@pytest.mark.filterwarnings("ignore")
def test_every_kernel_is_swept():
    """The sweep's cases, run eagerly, reach every op with a rule kernel (but those UNREACHED says)."""
    covered = set().union(*(capture_run.compare_extra(name, compiled=False).kernels for name in capture_run.EXTRA))
    for name in SWEEP:
        if name in OPS:
            op, have, cases = _cases(name)
            for i, recipe, seed in cases:
                covered |= capture_run.compare_compiled(op, have[i], recipe, seed, compiled=False).kernels
    kernels = {str(op) for op, rule in RULES.items() if rule.kernel is not None}
    missing = sorted(kernels - covered - set(UNREACHED))
    assert not missing, f"rule kernels no swept case reaches: {missing}"
    stale = sorted(set(UNREACHED) & covered)
    assert not stale, f"UNREACHED lists kernels the sweep reaches: {stale}"
