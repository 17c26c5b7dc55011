"""Runnable examples: `python -m ember.examples.<name>`."""

from __future__ import annotations

import importlib.util
import os
import time
from collections import deque

import numpy as np
from tqdm import tqdm

import ember

WARMUP_STEPS = 3  # the first call, the recording and the first replay of a jit step; not timed


def default_device() -> str:
    """"cuda" on a machine with a CUDA GPU and ember's GPU dependencies (torch, triton), else "cpu".

    torch and triton are optional: the cpu path needs neither, so they are looked for before torch
    is imported to ask for a GPU."""
    if os.environ.get("EMBER_INTERPRET", "0") not in ("", "0"):
        return "cpu"  # the interpreter runs the cuda device, but far too slowly to be a default
    try:
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
            return "cpu"
        import torch  # optional, and imported only once it is known to be installed
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class TrainingLog:
    """What a training loop reports of its steps: the first loss, the mean of the last ten, and the time of the steps
    after the first WARMUP_STEPS (the first call, and a jit step's recording and first replay), with a progress bar
    that shows the loss every `every` steps. Call `step(loss)` after each step and `close()` after the last."""

    def __init__(self, total: int, desc: str, progress: bool = True, every: int = 10, digits: int = 4) -> None:
        self.total, self.every, self.digits = total, every, digits
        self.bar = tqdm(total=total, disable=not progress, unit="step", desc=desc)
        self.done, self.first_loss, self.final_loss, self.timed_from = 0, float("nan"), float("nan"), 0
        self.last_losses: deque[ember.Tensor] = deque(maxlen=10)
        self.start = self.timed_start = self.end = time.perf_counter()

    def step(self, loss: ember.Tensor) -> None:
        self.done += 1
        self.last_losses.append(loss)
        if self.done == 1:
            self.first_loss = loss.item()
        if self.done == WARMUP_STEPS and self.total > WARMUP_STEPS:
            loss.item()  # wait for the warm-up steps; time the rest
            self.timed_from, self.timed_start = self.done, time.perf_counter()
        if self.done % self.every == 0 or self.done == self.total:
            self.bar.set_postfix(loss=f"{loss.item():.{self.digits}f}")
        self.bar.update()

    def close(self) -> None:
        """Wait for the last step and stop the clocks."""
        self.final_loss = float(np.mean([t.item() for t in self.last_losses]))
        self.end = time.perf_counter()
        self.bar.close()

    @property
    def seconds(self) -> float:
        """The whole run's."""
        return self.end - self.start

    @property
    def timed_steps(self) -> int:
        """The steps after the warm-up."""
        return self.done - self.timed_from

    @property
    def timed_seconds(self) -> float:
        return self.end - self.timed_start

    def per_second(self, items_per_step: int) -> float:
        """Items (images, tokens) per second over the steps after the warm-up."""
        return self.timed_steps * items_per_step / self.timed_seconds
