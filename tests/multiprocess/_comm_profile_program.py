"""A hybrid-parallel training step under gt.comm_profile, which the tests run on 4 simulated ranks
and as 4 launched processes; as a script it prints the profile's summary as JSON.

A small network (an MLP, tensor parallel on the 2x2 placement's axis 1, then a replicated head),
data parallel on axis 0: forward, MSE loss, backward, SGD step, the loss moved to a placement
of two ranks and read.
"""
import json

import torch

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.mlp(x).to_global(sbp=(S(0), B)))


def training_step():
    """Returns (comm_stats, comm_profile, loss) of one step."""
    torch.manual_seed(0)
    model = Net()
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    gt.nn.distribute_module(model, p, gt.nn.megatron_plan(column=["mlp.fc1"], row=["mlp.fc2"], axis=1, ndim=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (gt.distribute(t, p, (S(0), B)) for t in (torch.randn(8, 8), torch.randn(8, 4)))
    with gt.comm_stats() as stats, gt.comm_profile(model) as profile:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        value = loss.to_global(placement=gt.placement("cpu", [1, 2]), sbp=B).item()
    return stats, profile, value


def summary() -> dict:
    """The profile's rows and totals beside comm_stats', as JSON data."""
    stats, profile, loss = training_step()
    return json.loads(json.dumps({
        "rows": profile.rows(), "profile_per_rank": profile.per_rank, "stats_per_rank": stats.per_rank,
        "stats_ops": sorted(stats.ops()), "bytes_sent": [stats.bytes_sent, profile.bytes_sent], "loss": loss}))


if __name__ == "__main__":
    print("PROFILE " + json.dumps(summary()))
