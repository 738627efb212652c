"""Reaching a head budget exactly: a Lagrangian penalty on the expected L0 (CoFi style).

Xia, Zhong & Chen 2022 ("Structured Pruning Learns Compact and Accurate Models", Sec. 3.2,
following Wang et al. 2020): instead of a fixed lambda times L_C, minimise

    L = L_xent + lambda_1 (E[L0] - t) + lambda_2 (E[L0] - t)^2

over the model and the gates while *maximising* over lambda_1, lambda_2 (gradient ascent). The
multipliers grow as long as the expected number of open heads E[L0] misses the target t, which
pushes E[L0] onto t. As in CoFi, t moves linearly from the number of gated heads to the budget
N over ``warmup_steps`` updates, then stays at N.

Gradient ascent inside a minimising optimizer: the multipliers enter the loss through
``_ascend(x) = 2 x.detach() - x``, which has the value of x and the gradient -1 times that of x.
At export the N heads with the highest log_alpha are kept, so the count is exact whatever the
last E[L0] was.
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.errors import HeadlabError, counted

__all__ = ["LagrangianBudget"]


def _ascend(x: torch.Tensor) -> torch.Tensor:
    """Value x, gradient reversed: minimising the loss maximises it over x."""
    return 2 * x.detach() - x


class LagrangianBudget(nn.Module):
    """The multipliers (trainable, registered under the gate module) and the target schedule."""

    def __init__(self, n_gates: int, keep: int, warmup_steps: int = 0):
        super().__init__()
        if not isinstance(keep, int) or keep < 0:
            raise HeadlabError(f"--keep must be a non-negative number of heads, got {keep!r}")
        if keep > n_gates:
            raise HeadlabError(f"--keep {keep} is larger than the {counted(n_gates, 'gated head')}")
        self.n_gates, self.keep, self.warmup_steps = int(n_gates), int(keep), int(warmup_steps)
        self.lambda_1 = nn.Parameter(torch.zeros(()))
        self.lambda_2 = nn.Parameter(torch.zeros(()))

    def target(self, step: int) -> float:
        """t(step): linear from n_gates to keep over warmup_steps (Xia et al. 2022, Sec. 3.2)."""
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return float(self.keep)
        return self.n_gates - (self.n_gates - self.keep) * step / self.warmup_steps

    def penalty(self, expected_l0: torch.Tensor, step: int) -> torch.Tensor:
        gap = expected_l0 - self.target(step)
        return _ascend(self.lambda_1) * gap + _ascend(self.lambda_2) * gap * gap
