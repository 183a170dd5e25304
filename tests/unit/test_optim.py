"""The optimizer: torch's fused AdamW where the parameters allow it, the same update as torch's default AdamW."""

from __future__ import annotations

import torch

from vidray.config import OptimConfig
from vidray.train.optim import build_optimizer


def test_the_fused_adamw_on_cpu_takes_the_same_steps_as_the_default_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(model.parameters(), optim)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=tuple(optim.betas), weight_decay=0.1,
                              eps=optim.eps)
    assert fused.param_groups[0]["fused"] is True and not plain.param_groups[0]["fused"]
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(5):
        for net, opt in ((model, fused), (reference, plain)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # its state round-trips through a state dict (what a checkpoint holds) into a fresh fused optimizer
    again = build_optimizer(model.parameters(), optim)
    again.load_state_dict(fused.state_dict())
    assert again.param_groups[0]["fused"] is True
    torch.testing.assert_close(again.state_dict()["state"][0]["exp_avg"], fused.state_dict()["state"][0]["exp_avg"])
