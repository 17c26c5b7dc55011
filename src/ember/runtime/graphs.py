"""CUDA graphs: plans re-run on fixed buffers, launch by launch or captured as one graph.

`ember.jit` binds the plans a step ran to fixed buffers (`ReplayStep`) and decides whether their
`Replay` is captured; an uncaptured one runs plan by plan, each replay with fresh random offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.compiler import Plan, Signature
from ember.device import Device
from ember.runtime import cuda, launcher


@dataclass
class ReplayStep:
    """One recorded plan bound to fixed buffers."""

    plan: Plan
    sig: Signature
    device: Device
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination, source)
    seed_draws: list[int] = field(default_factory=list)  # per entry of sig.seeds: its draw, or -1 if fixed


class Replay:
    """Plans re-run on fixed buffers: as one CUDA graph once captured, else launch by launch."""

    def __init__(self, steps: list[ReplayStep]):
        self.steps = steps
        self.graph = None
        self.arenas = [cuda.arena_views(s.plan, cuda.torch_device(s.device), s.device) for s in steps]  # kept alive

    def capture(self) -> None:
        """Capture the steps as one CUDA graph that `run` replays (with the kernel arguments of the
        capture: no fresh random offsets); raises what the capture raises."""
        target = cuda.torch_device(self.steps[0].device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(target)
        try:
            launcher.capturing = True
            with torch.cuda.graph(graph):
                self._launch(None)
        finally:
            launcher.capturing = False
        self.graph = graph

    def run(self, draws: list[tuple[int, int]] | None) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._launch(draws)

    def _launch(self, draws: list[tuple[int, int]] | None) -> None:
        for step in self.steps:
            sig = step.sig
            if draws is not None and step.seed_draws:
                seeds = [draws[d] if d >= 0 else fixed for d, fixed in zip(step.seed_draws, sig.seeds)]
                sig = Signature(sig.key, sig.inputs, sig.scalars, seeds)
            launcher.execute(step.plan, sig, step.device, step.inputs, step.outputs)
            for destination, source in step.copies:
                destination.copy_(source)
