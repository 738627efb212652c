"""Pick the number of CPU threads from measured speed (``--threads auto``).

On a CPU shared with other jobs, a process with several intra-op threads can be much slower
than one with a single thread: each parallel region waits for its slowest thread, and a thread
that the scheduler has parked stalls the others (we measured 67 against 518 target tokens/s on
a busy 2-core machine). :class:`AdaptiveThreads` is a training callback that measures target
tokens per second for each thread count, keeps the fastest, and probes the others for a couple
of steps now and then, doubling the gap between probes while the choice holds, so a bad setting
costs little and a change in load is still noticed.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

__all__ = ["AdaptiveThreads"]


class AdaptiveThreads:
    """A ``callback(model, step, info)`` for :func:`headlab.training.loop.train`; call it every step.

    ``choices`` defaults to ``[1, all cores]``; it starts with the first, measures the others
    in probes of ``probe_steps`` steps (the first step after a switch is not counted), first
    after ``first_interval`` steps, then at intervals that double up to ``max_interval`` while
    the best choice does not change.
    """

    def __init__(self, choices: Sequence[int] | None = None, *, probe_steps: int = 2, first_interval: int = 8,
                 max_interval: int = 512, log: Callable[[str], None] | None = None):
        cores = torch.get_num_threads()
        self.choices = list(choices) if choices else sorted({1, max(cores, 1)})
        self.probe_steps = probe_steps
        self.first_interval = first_interval
        self.max_interval = max_interval
        self.log = log
        self.rates: dict[int, float] = {}  # EMA of target tokens/s per thread count
        self.current = self.choices[0]
        self.best = self.current
        self.interval = first_interval
        self.next_probe = first_interval
        self._probe_queue: list[int] = []
        self._counted = 0  # steps measured since the last switch
        self._last: tuple[float, int, int] | None = None  # (time, tokens, epoch)
        torch.set_num_threads(self.current)

    def _switch(self, threads: int) -> None:
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
            self._counted = -1  # the first step after a switch pays for the switch: not counted

    def __call__(self, model, step: int, info: dict) -> None:
        now, tokens, epoch = time.perf_counter(), info["tokens"], info["epoch"]
        last, self._last = self._last, (now, tokens, epoch)
        if last is None or last[2] != epoch or now <= last[0]:
            return  # first call, or a new epoch: validation time is not training time
        if self._counted >= 0:
            rate = (tokens - last[1]) / (now - last[0])
            old = self.rates.get(self.current)
            self.rates[self.current] = rate if old is None else 0.7 * old + 0.3 * rate
        self._counted += 1

        if self._probe_queue or self.current != self.best:  # probing
            if self._counted < self.probe_steps:
                return
            if self._probe_queue:
                self._switch(self._probe_queue.pop(0))
                return
            self._finish_probe(step)
        elif step >= self.next_probe and len(self.choices) > 1:
            others = [c for c in self.choices if c != self.best]
            self._switch(others[0])
            self._probe_queue = others[1:]

    def _finish_probe(self, step: int) -> None:
        best = max(self.rates, key=self.rates.__getitem__)
        if best == self.best:
            self.interval = min(2 * self.interval, self.max_interval)
        else:
            self.interval = self.first_interval
            if self.log is not None:
                rates = ", ".join(f"{c} thread(s): {r:.0f} tok/s" for c, r in sorted(self.rates.items()))
                self.log(f"[threads] now using {best} ({rates})")
        self.best = best
        self.next_probe = step + self.interval
        self._switch(best)
