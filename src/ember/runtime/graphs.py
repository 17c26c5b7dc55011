"""CUDA graphs: plans re-run on fixed buffers, launch by launch or captured as one graph.

`ember.jit` binds the plans a step ran to buffers (`ReplayStep`): fixed ones for what the step keeps (its
intermediates, state, gradients), and, bound anew before a replay (`Replay.bind`), the buffers of the step's
arguments and of the values it returns. A bound `Replay` runs plan by plan, each time with fresh random offsets,
or is captured as a CUDA graph (`Replay.capture`), which replays the launches of its binding. A `Replay` runs
its plans in workspaces of its own (arenas and prepared launches, taken from the recording thread), so its
graphs' buffers are no thread's; a capture forbids unsafe CUDA calls in the capturing thread only, so other
threads keep launching meanwhile, but captures take turns.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from ember.compiler import KernelKind, Plan, Signature
from ember.device import Device
from ember.runtime import cuda, index_checks, launcher


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
    draws: torch.Tensor | None = None  # sig.seeds in device memory, where the plan's random kernels read them
    arguments: list[tuple[int, int]] = field(default_factory=list)  # (input position, argument slot)
    results_in: list[tuple[int, int]] = field(default_factory=list)  # (input position, result slot)
    results_out: list[tuple[int, int]] = field(default_factory=list)  # (output position, result slot)


# Captures from two threads at once can abort the process in torch's graph memory pools (a failed capture's
# clean-up while another thread captures): a lock keeps them one after the other.
_capturing = threading.Lock()
# Graphs that hold collectives of the process group: they must be reset before the group is destroyed, where
# NCCL's teardown otherwise waits for them forever (reset_collective_graphs).
_with_collectives: weakref.WeakSet = weakref.WeakSet()


class StorageUses:
    """Whether another tensor shares the memory of any of a list of buffers (`shared`), asked again and again (an
    ember.jit program's result buffers, once a call): a view or alias of one, such as a result handed to torch as
    its own tensor (`runtime.dlpack.torch_buffers`). A storage's use count is one per tensor on it plus one for
    its Python storage object, held here, so that each ask costs one use count per buffer."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers, self.length = buffers, len(buffers)
        self.storages = [b.untyped_storage() for b in buffers]
        self.handles = [s._cdata for s in self.storages]

    def of(self, buffers: list[torch.Tensor]) -> bool:
        """Whether these are the buffers it watches (the same list, not grown since)."""
        return buffers is self.buffers and len(buffers) == self.length

    def shared(self) -> bool:
        use_count = torch._C._storage_Use_Count
        return any(use_count(h) > 2 for h in self.handles)


class Replay:
    """Plans re-run on their buffers, launch by launch or captured as a CUDA graph."""

    def __init__(self, steps: list[ReplayStep]):
        self.steps = steps
        own: dict[tuple, launcher.Workspace] = {}
        for s in steps:  # one workspace per plan and device, however often the step runs it
            if (id(s.plan), s.device) not in own:
                own[id(s.plan), s.device] = launcher.take_workspace(s.plan, s.device)
        self.workspaces = [own[id(s.plan), s.device] for s in steps]
        self.checks: tuple | None = None  # (the workspaces' steps, every index check they make), once asked

    def bind(self, arguments: list[torch.Tensor], results: list[torch.Tensor]) -> None:
        """Read the step's arguments from `arguments` and write the values it returns into `results` (by
        slot), from the next run or capture on."""
        for step in self.steps:
            for position, slot in step.arguments:
                step.inputs[position] = arguments[slot]
            for position, slot in step.results_in:
                step.inputs[position] = results[slot]
            for position, slot in step.results_out:
                step.outputs[position] = results[slot]

    def capture(self) -> torch.cuda.CUDAGraph:
        """The steps, as bound, captured as one CUDA graph (with the kernel arguments of the capture: no
        fresh random offsets); raises what the capture raises."""
        target = cuda.torch_device(self.steps[0].device)
        with _capturing:  # one capture at a time in this process (other threads' plain launches go on)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(target)
            try:
                launcher.this_thread.capturing = True
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.run(None)
            finally:
                launcher.this_thread.capturing = False
        if any(ck.kernel.kind is KernelKind.COLLECTIVE for s in self.steps for ck in s.plan.kernels):
            _with_collectives.add(graph)
        return graph

    def replayed(self, results: list[torch.Tensor]) -> None:
        """A CUDA graph of the steps ran, writing `results` (and the state its steps keep): these carry every
        index check of the steps (see index_checks), as values computed by the whole step."""
        steps = tuple(id(workspace.steps) for workspace in self.workspaces)
        if self.checks is None or self.checks[0] != steps:  # (a workspace's steps are made by its first run)
            self.checks = steps, frozenset().union(*(flags.every for workspace in self.workspaces
                                                     for flags in launcher.index_flags(workspace.steps)))
        checks = self.checks[1]
        if checks:
            index_checks.depend_on(checks, [*results, *(o for step in self.steps for o in step.outputs
                                                        if o is not None)])

    def run(self, draws: list[tuple[int, int]] | None) -> None:
        """The steps, as bound, plan by plan; `draws` gives the random offsets of this run."""
        self.draw(draws)
        for step, workspace in zip(self.steps, self.workspaces):
            launcher.execute(step.plan, step.sig, step.device, step.inputs, step.outputs, step.draws, workspace)
            for destination, source in step.copies:
                destination.copy_(source)

    def draw(self, draws: list[tuple[int, int]] | None) -> None:
        """Write this run's (seed, offset) pairs where the steps' random kernels read them (a captured graph
        reads them there too); None keeps the recorded ones."""
        if draws is None:
            return
        for step in self.steps:
            if any(d >= 0 for d in step.seed_draws):
                seeds = [draws[d] if d >= 0 else fixed for d, fixed in zip(step.seed_draws, step.sig.seeds)]
                launcher.upload_draws(seeds, step.draws.device, into=step.draws)


def reset_collective_graphs() -> int:
    """Reset every CUDA graph holding a collective (before the process group goes away); a reset graph raises if
    it is replayed. How many there were."""
    graphs = list(_with_collectives)
    for graph in graphs:
        graph.reset()
    _with_collectives.clear()
    return len(graphs)
