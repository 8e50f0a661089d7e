"""A small CNN with BatchNorm (conv + BatchNorm2d + relu + pool + linear), trained data parallel
on 4 simulated ranks (batch split) beside one device: values, gradients, running statistics and
eval outputs equal one device's (float64), and BatchNorm's communication is per-channel sums,
within SyncBatchNorm's bytes."""
import copy

import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from models_helpers import no_fallback

CHANNELS = 8
TOL = dict(rtol=1e-10, atol=1e-10)     # float64, sums in another order (see models_helpers)


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(CHANNELS)
        self.fc = torch.nn.Linear(CHANNELS * 4 * 4, 5)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def _sync_batch_norm_bytes(p: int, channels: int, itemsize: int) -> int:
    """torch.nn.SyncBatchNorm per training step, per rank: the forward all-gathers each rank's
    per-channel mean, inverse std and its count ((2C + 1) floats: p - 1 pieces passed on in a
    ring), the backward all-reduces sum(dy) and sum(dy * (x - mean)) (2C floats)."""
    return (p - 1) * (2 * channels + 1) * itemsize + 2 * (p - 1) * 2 * channels * itemsize // p


def test_batch_split_training_and_eval_equal_one_device(p1):
    torch.manual_seed(0)
    model = SmallCNN().double()
    reference = copy.deepcopy(model)
    gt.nn.distribute_module(model, p1)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    data = torch.Generator().manual_seed(1)
    for step in range(2):
        x, target = torch.randn(8, 3, 8, 8, dtype=torch.float64, generator=data), torch.randint(0, 5, (8,), generator=data)
        with no_fallback():
            out = model(gt.distribute(x, p1, S(0)))
            loss = F.cross_entropy(out, gt.distribute(target, p1, S(0)))
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
        ref_loss = F.cross_entropy(reference(x), target)
        ref_loss.backward()
        assert out.sbp == (S(0),)
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL)
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert grads[n].sbp == (B,), n
            torch.testing.assert_close(grads[n].full_tensor(), q.grad, **TOL, msg=lambda m: f"{n}: {m}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for (n, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b.full_tensor(), c, **TOL, msg=lambda m: f"{n}: {m}")
    model.eval(), reference.eval()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64, generator=data)
    with no_fallback(), gt.comm_stats() as st:
        out = model(gt.distribute(x, p1, S(0)))
    assert st.count == 0 and out.sbp == (S(0),)
    torch.testing.assert_close(out.full_tensor(), reference(x), **TOL)


def test_batch_norm_sends_per_channel_sums_within_sync_batch_norms_bytes(p1):
    bn = torch.nn.BatchNorm2d(CHANNELS)
    gt.nn.distribute_module(bn, p1)
    h = gt.distribute(torch.randn(8, CHANNELS, 8, 8), p1, S(0)).requires_grad_()
    with no_fallback(), gt.comm_stats() as st:
        bn(h).square().sum().backward()
    assert st.ops() == ["all_reduce"] * 3               # the sums, the squared deviations; the backward's two sums
    assert st.bytes_sent <= _sync_batch_norm_bytes(4, CHANNELS, 4)
    assert h.grad.sbp == (S(0),)
