"""What the mixer rules share when they probe a module's own forward against the formula they were written for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from headlab.importance.lrp import _widened

__all__ = ["probing"]


@contextmanager
def probing(module: nn.Module) -> Iterator[None]:
    """Where a rule probes ``module``'s own forward: under no_grad, the module widened in place to at least float32 and
    put back exactly on exit, as LRP computes it, so that a half-precision model's own rounding does not set the two
    apart."""
    with _widened(module, torch.float32), torch.no_grad():
        yield
