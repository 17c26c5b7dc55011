"""Recording and replay of a step's plans: the runtime half of `ember.jit`.

While a step function runs under a `Recorder`, every plan the cuda backend executes
is noted with its input and output buffers, as are the facts the frontend needs to
turn that into a `Program`: which Tensors were rebound (parameters, optimizer state),
which host values were uploaded, which random offsets were drawn, and which Python
values the step read (guards). A Program re-runs the same plans on fixed buffers:

- an argument's buffer is copied into the argument's slot before each replay;
- a state Tensor (a parameter, a moment estimate) lives in one buffer that the
  replay reads and overwrites in place — directly from the kernel that computes the
  new value when that is safe, else through a copy at the end of the plan;
- everything else the step reads is a constant, and what it computes for Tensors
  outside the step (gradients, returned values) lands in the same buffers each time.

On a GPU the whole replay is one CUDA graph; a step that draws random numbers is
replayed launch by launch instead, so each replay gets fresh random offsets.
"""

from __future__ import annotations

import functools
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.compiler import KernelKind, Signature
from ember.ir import Kind, Node, Op

_recording: list[Recorder] = []  # the capture in progress, if any


class NotCapturable(Exception):
    """The step cannot be replayed; the message says why, and the step keeps running as written."""


@dataclass
class RecordedPlan:
    plan: object  # a compiled Plan
    sig: Signature
    device: object
    inputs: list  # buffers, one per input of the lowered graph
    outputs: list  # buffers, one per kept node
    kept: list[Node]


@dataclass
class Recorder:
    guards: list[tuple[Callable[[], object], object]] = field(default_factory=list)
    refreshers: list[Callable[[], None]] = field(default_factory=list)
    plans: list[RecordedPlan] = field(default_factory=list)
    rebound: dict[int, tuple[weakref.ref, Node]] = field(default_factory=dict)  # id(tensor) -> (tensor, old node)
    uploads: dict[int, Node] = field(default_factory=dict)  # id(device buffer) -> the host node it came from
    draws: list[tuple[int, int, int]] = field(default_factory=list)  # (seed, offset, count) per random draw
    arguments: set[int] = field(default_factory=set)  # ids of the step's argument nodes
    grads: dict[int, tuple] = field(default_factory=dict)  # id(tensor) -> (tensor, .grad before, first new)
    failure: str | None = None


def recording() -> bool:
    return bool(_recording)


def guard(read: Callable[[], object]) -> None:
    """Make the capture in progress depend on `read()`: a replay re-reads it and recaptures on a change."""
    if _recording:
        _recording[-1].guards.append((read, read()))


def refresh(update: Callable[[], None]) -> None:
    """Run `update()` before each replay of the step being recorded: it brings Tensors the step reads
    up to date with Python state (an optimizer's learning rate), and the replay follows them."""
    if _recording and update not in _recording[-1].refreshers:
        _recording[-1].refreshers.append(update)


def fail(reason: str) -> None:
    """The step being recorded cannot be replayed (it still runs normally)."""
    if _recording and _recording[-1].failure is None:
        _recording[-1].failure = reason


def note_rebind(tensor, old: Node) -> None:
    if _recording and id(tensor) not in _recording[-1].rebound:
        _recording[-1].rebound[id(tensor)] = (weakref.ref(tensor), old)


def note_grad(tensor, old, new) -> None:
    if _recording and id(tensor) not in _recording[-1].grads:
        _recording[-1].grads[id(tensor)] = (weakref.ref(tensor), old, new)


def note_grad_read(tensor) -> None:
    """The step reads `tensor.grad`. A gradient set inside the step is part of the recording; one
    computed before it is an input: a replay must see the same one (or the step is recorded again),
    and one still pending would be computed inside the recording from inputs the replay cannot know."""
    if not _recording or id(tensor) in _recording[-1].grads:
        return
    if not tensor.grad._node.realized:
        fail("it reads gradients of a backward pass run outside it (run the backward pass inside the step)")
    else:  # the buffer stays alive while the recording reads it, so its id names it
        guard(functools.partial(_grad_buffer, tensor))


def _grad_buffer(tensor) -> int | None:
    return id(tensor.grad._node.buffer) if tensor.grad is not None else None


def note_upload(buffer, source: Node) -> None:
    if _recording:
        _recording[-1].uploads[id(buffer)] = source


def note_draw(seed: int, offset: int, count: int) -> None:
    if _recording:
        _recording[-1].draws.append((seed, offset, count))


def note_host_work(order: list[Node]) -> None:
    """The cpu computed `order` during the step. Work that waited from before the step (a model built
    on the cpu, moved to the GPU) is computed once, as it would be anyway; work on the step's arguments
    or on random numbers would be computed anew by each call, and the replay cannot."""
    if not _recording:
        return
    rec = _recording[-1]
    drawn = {(seed, offset) for seed, offset, _ in rec.draws}
    if any((n.op is Op.RAND and (n.attrs["seed"], n.attrs["offset"]) in drawn)
           or any(id(i) in rec.arguments for i in n.inputs) for n in order):
        fail("it computes on the cpu, whose reference backend runs op by op and has nothing to replay")


def record_plan(plan, sig: Signature, device, inputs: list, outputs: list, kept: list[Node]) -> None:
    _recording[-1].plans.append(RecordedPlan(plan, sig, device, inputs, outputs, kept))


class record:
    """`with record() as recorder:` notes what the cuda backend runs in the block."""

    def __enter__(self) -> Recorder:
        self.recorder = Recorder()
        _recording.append(self.recorder)
        return self.recorder

    def __exit__(self, *exc) -> None:
        _recording.remove(self.recorder)


# -- in-place writes ---------------------------------------------------------------------------

def writes_in_place(plan, input_index: int, output_index: int) -> bool | None:
    """Whether the plan can write output `output_index` into the buffer of input `input_index`:
    None when the output is that input itself (nothing to write), True when the kernel computing it
    is the last to read the input and reads it element for element where it writes."""
    source = plan.lowered.inputs[input_index]
    result = plan.lowered.outputs[output_index]
    if result is source:
        return None
    kernels = [ck.kernel for ck in plan.kernels]
    writer = next((i for i, k in enumerate(kernels) if result in k.outputs), None)
    if writer is None or result.shape != source.shape or result.dtype is not source.dtype:
        return False
    group_start = next((a for a, b in plan.schedule.groups if a <= writer < b), writer)
    for i, k in enumerate(kernels):
        if i != writer and source in k.reads and i >= group_start:
            return False
    kernel = kernels[writer]
    if source not in kernel.reads:
        return True
    part = next((s for s in kernel.segments if result in s.outputs), kernel)
    if any(source in s.reads for s in kernel.segments if s is not part):
        return False
    # a GEMM's epilogue (an optimizer update fused after a weight gradient) reads element for element too;
    # a value read by its mainloop is used at other positions, which _elementwise_use rejects
    elementwise_kernel = part.kind is KernelKind.POINTWISE and not part.reductions or part.core is not None
    return elementwise_kernel and _elementwise_use(part, source)


def _elementwise_use(kernel, source: Node) -> bool:
    """Every value of the kernel derived from `source` is computed element for element (no view,
    broadcast or gather moves an element of `source` to another position)."""
    derived = {id(source)}
    for n in kernel.covers:
        if any(id(i) in derived for i in n.inputs):
            if n.op.kind not in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) or n.shape != source.shape:
                return False
            derived.add(id(n))
    return True


# -- interrupts --------------------------------------------------------------------------------

class deferred_interrupt:
    """Hold Ctrl-C until the block ends, so a replay that updates state in place is never cut halfway."""

    def __enter__(self):
        self.caught = None
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            self.previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        self.caught = (signum, frame)

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.signal(signal.SIGINT, self.previous)
            if self.caught is not None and callable(self.previous):
                self.previous(*self.caught)
