"""Steady plans: a plan the lazy path runs again and again on the results of its last run (a training step:
parameters and optimizer state in, their new values out) runs on fixed buffers, and on a GPU as a CUDA graph,
the mechanism of `ember.jit`, with no decorator and the Python of the step still run as written.

Per plan and thread, from the second run that reads the results of the run before (the same positions each
time: the step's *chain*), results alternate between two sets of buffers: a run writes the set of the run
before last once nothing shows its buffers any more (no Tensor, no view into them, no DLPack capsule: their
references and their storage's say so), so a steady step allocates nothing. A set still shown (a loss kept in
a list) is left to what shows it and replaced by new buffers. With its buffers fixed, a run is captured as a
CUDA graph, once per result set, the addresses of the inputs outside the chain (the batch) and the values of
the runtime scalars; later runs with the same ones replay it in one call, with fresh random offsets.

Anything else runs the plan launch by launch as before: another chain (its sets and graphs are dropped), an
ember.jit recording, the interpreter (no CUDA graphs; the sets still alternate), more than `GRAPHS_KEPT`
graphs, a capture that fails, or sets that must be replaced `REPLACED_IN_A_ROW` runs in a row (a loop keeping
every result: recycling pauses for the plan's next `PAUSE` runs).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import threading
import weakref

import torch

from ember.compiler import Plan, Signature
from ember.device import Device
from ember.ir.node import picker
from ember.runtime import cuda, executor, graphs, launcher, plan_cache, targets

GRAPHS_KEPT = 8
REPLACED_IN_A_ROW = 3
PAUSE = 100
_storage_use_count = torch._C._storage_Use_Count
stats = cuda.stats
stats.update(steady_runs=0, graph_replays=0, graph_captures=0)


class Steady:
    """One plan's runs in one thread, on one device."""

    __slots__ = ("last", "chain", "reads", "wrote", "outside", "sets", "parity", "graphs", "replay", "replaced",
                 "off", "graphed", "why")

    def __init__(self, graphed: bool) -> None:
        self.last: list[weakref.ref] | None = None  # the last run's results, outside the sets
        self.chain: tuple[int, ...] | None = None  # per input: the position of the last run's result it is, or -1
        self.reads = self.wrote = self.outside = picker([])  # the chain's inputs, its results, the other inputs
        self.sets: list[list[torch.Tensor] | None] = [None, None]
        self.parity = 0  # the set the last run wrote
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.replay: graphs.Replay | None = None  # the plan bound to buffers, with a workspace of its own
        self.replaced = 0  # sets replaced in a row
        self.off = 0  # runs left before recycling is tried again
        self.graphed = graphed
        self.why = ""  # why no graph is captured, once one failed


def run(plan: Plan, sig: Signature, device: Device, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plan's results on `inputs`, as `launcher.execute` computes them: into a recycled set of buffers
    (`executor.recycled`), and replayed as a CUDA graph, where the runs are steady."""
    prepared = plan_cache.prepared(plan)
    layout = _recyclable(plan, prepared)
    if not layout:
        return launcher.execute(plan, sig, device, inputs)
    states = getattr(prepared, "steady", None)
    if states is None:
        states = prepared.steady = {}
    state = states.get(device)
    if state is None:  # CUDA graphs where kernels run on a GPU (not in the interpreter)
        state = states[device] = Steady(not targets.for_plan(plan).interpret)
    if state.off:  # paused: the sets are dropped, and the graphs with them
        state.off -= 1
        state.sets, state.graphs = [None, None], {}
        return _fresh(state, plan, sig, device, inputs)
    previous = state.sets[state.parity] if state.last is None else [r() for r in state.last]
    if previous is None:
        return _fresh(state, plan, sig, device, inputs)
    # the chain as before (the step's inputs that were results are those results again: C-speed check), or
    # worked out again
    if state.last is not None or state.chain is None or \
            not all(map(operator.is_, state.reads(inputs), state.wrote(previous))):
        where = {id(b): q for q, b in enumerate(previous)}
        chain = tuple(where.get(id(b), -1) for b in inputs)
        if max(chain, default=-1) < 0:  # no result of the last run is read again: nothing to recycle
            if state.chain is not None:
                state.chain, state.sets, state.graphs = None, [None, None], {}
            return _fresh(state, plan, sig, device, inputs)
        if chain != state.chain or previous is not state.sets[state.parity]:
            state.chain, state.graphs, state.replaced = chain, {}, 0
            state.reads = picker([k for k, c in enumerate(chain) if c >= 0])
            state.wrote = picker([c for c in chain if c >= 0])
            state.outside = picker([k for k, c in enumerate(chain) if c < 0])
            state.sets = [_adopted(previous), None]  # entries the last run's caller dropped are None until needed
            state.parity = 0
    target = 1 - state.parity
    outputs = state.sets[target]
    if outputs is not None and any(b is None for b in outputs):  # (not `None in`: it compares tensors)
        outputs = state.sets[target] = _completed(plan, device, outputs, layout)
    if outputs is not None and not _unshown(outputs, layout):
        outputs = state.sets[target] = None
        state.graphs = {k: g for k, g in state.graphs.items() if k[0] != target}
        state.replaced += 1
        if state.replaced >= REPLACED_IN_A_ROW:
            state.off, state.replaced, state.chain = PAUSE, 0, None
    elif outputs is not None:
        state.replaced = 0
    if state.replay is None:
        step = graphs.ReplayStep(plan, _without_leaves(sig), device, [], [], seed_draws=list(range(len(sig.seeds))),
                                 draws=launcher.upload_draws(sig.seeds, cuda.torch_device(device))
                                 if sig.seeds else None)
        state.replay = graphs.Replay([step])
    if outputs is None:  # a new set: this run allocates it
        outputs = launcher.execute(plan, sig, device, inputs, workspace=state.replay.workspaces[0])
        state.sets[target] = _adopted(outputs)
    else:
        _bound_run(state, sig, inputs, outputs, target)
        stats["steady_runs"] += 1
    state.parity, state.last = target, None
    return outputs


def release() -> bool:
    """Drop this thread's spare result sets and graphs of every cached plan (called when GPU memory runs out;
    the steps that were steady allocate new sets from their next runs). Whether there were any."""
    dropped = False
    for prepared in plan_cache.prepared_states():
        for state in (getattr(prepared, "steady", None) or {}).values():
            dropped = dropped or any(s is not None for s in state.sets) or bool(state.graphs)
            state.chain, state.sets, state.graphs, state.last = None, [None, None], {}, None
    return dropped


cuda.on_out_of_memory.append(release)


def _fresh(state: Steady, plan: Plan, sig: Signature, device: Device, inputs: list) -> list[torch.Tensor]:
    """A run into new buffers; its results are remembered weakly, to see whether the next run reads them."""
    workspace = state.replay.workspaces[0] if state.replay is not None else None
    outputs = launcher.execute(plan, sig, device, inputs, workspace=workspace)
    state.last = None if state.off else [weakref.ref(b) for b in outputs]
    return outputs


def _completed(plan: Plan, device: Device, outputs: list, layout: Layout) -> list[torch.Tensor]:
    """A set with new buffers where it has none (a result the plan computes twice shows its first buffer)."""
    target = cuda.torch_device(device)
    done: list[torch.Tensor] = []
    for b, o, first in zip(outputs, plan.lowered.outputs, layout.first):
        done.append(done[first] if first < len(done) else
                    cuda.allocate(o.shape, o.dtype, target, device, "a result") if b is None else b)
    return _adopted(done)


def _adopted(buffers: list) -> list:
    """A list of buffers as a set that later runs overwrite: whoever shares their memory outside ember gets a
    copy first (see dlpack)."""
    recycled = executor.recycled
    for b in buffers:
        if b is not None:
            recycled[id(b)] = b
    return buffers


def _without_leaves(sig: Signature) -> Signature:
    """The signature without its input nodes, which a replay holding it would keep alive (and their buffers
    shown)."""
    return Signature(sig.key, [], sig.scalars, sig.seeds)


def _bound_run(state: Steady, sig: Signature, inputs: list, outputs: list, target: int) -> None:
    """Run the plan into `outputs`: by the CUDA graph of this binding, or launch by launch (capturing a graph of
    the binding after the first such run)."""
    replay = state.replay
    (step,) = replay.steps
    key = (target, tuple([b.data_ptr() for b in state.outside(inputs)]), tuple(sig.scalars))
    graph = state.graphs.get(key) if state.graphed else None
    if graph is not None:
        replay.draw(sig.seeds)
        graph.replay()
        replay.replayed(outputs)
        stats["graph_replays"] += 1
        return
    step.sig = _without_leaves(sig)
    step.inputs, step.outputs = inputs, outputs
    try:
        replay.run(sig.seeds)
        if state.graphed and len(state.graphs) < GRAPHS_KEPT:
            try:
                state.graphs[key] = replay.capture()
                stats["graph_captures"] += 1
            except Exception as error:  # runs stay correct launch by launch
                state.graphed, state.why = False, f"capture failed: {error}"
    finally:
        step.inputs, step.outputs = [], []  # so that a buffer's references say who shows it


# a storage's uses counted by its buffer and by the check's storage object
_OWN_STORAGE_USES = 2


def _unshown(buffers: list[torch.Tensor], layout: Layout) -> bool:
    """Whether nothing outside this module shows any of `buffers`: no node, Tensor or list holds one and no
    view shares its memory."""
    distinct = layout.distinct(buffers)  # (C-speed maps: a set holds hundreds of buffers)
    if not all(map(operator.le, map(sys.getrefcount, distinct), layout.allowed)):
        return False
    return all(map(_OWN_STORAGE_USES.__ge__, map(_storage_use_count, map(_cdata, map(_storage, distinct)))))


_storage = operator.methodcaller("untyped_storage")
_cdata = operator.attrgetter("_cdata")



@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a plan's results go: per result, the position of the first result that is the same node (a value
    kept by several Tensors that the compiler found to be one); per distinct result, its position and the
    references a set of them holds when nothing else shows it (the set's list, once per position, the check's
    own: getrefcount's argument)."""

    first: tuple[int, ...]
    checks: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        # the distinct results, and their allowed references plus one: getrefcount's argument, and the
        # tuple `distinct` makes
        object.__setattr__(self, "distinct", picker([q for q, _ in self.checks]))
        object.__setattr__(self, "allowed", tuple(allowed + 1 for _, allowed in self.checks))


def _recyclable(plan: Plan, prepared: threading.local) -> Layout | None:
    """The plan's layout of results, if it allocates every result itself (none is an input or an intermediate
    of its arena); None otherwise. `prepared`: what this thread prepared from the plan (plan_cache.prepared)."""
    known = prepared.__dict__
    if "layout" not in known:
        lowered = plan.lowered
        taken = {id(n) for n in lowered.inputs} | set(plan.schedule.slots)
        ids = [id(o) for o in lowered.outputs]
        first = tuple(ids.index(i) for i in ids)
        checks = tuple((q, 1 + first.count(q)) for q in range(len(ids)) if first[q] == q)
        known["layout"] = Layout(first, checks) if ids and taken.isdisjoint(ids) else None
    return known["layout"]
