"""Recording for `ember.jit`: while a call of a step records, a `Recorder` is the runtime's
`executor.this_thread.recorder` and notes every plan the cuda backend executes with its input and output buffers,
the Tensors rebound (parameters, optimizer state), the host values uploaded, the random offsets drawn and the Python
values the step read (guards). ember.jit turns that into a replay (`_Program`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.compiler import Signature
from ember.ir import Node, Op
from ember.nn import module as nn_module
from ember.runtime import executor
from ember.tensor import Tensor


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
    """What one call of a step ran and read. While it records, it is `executor.this_thread.recorder`: the
    runtime tells it the plans it executes, the uploads and the host's reads and work; Tensors, modules,
    optimizers and the random stream tell it what they rebind, guard, refresh and draw."""

    guards: list[tuple[Callable[[], object], object]] = field(default_factory=list)
    refreshers: list[Callable[[], None]] = field(default_factory=list)
    plans: list[RecordedPlan] = field(default_factory=list)
    rebound: dict[int, tuple[weakref.ref, Node]] = field(default_factory=dict)  # id(tensor) -> (tensor, old node)
    uploads: dict[int, Node] = field(default_factory=dict)  # id(device buffer) -> the host node it came from
    draws: list[tuple[int, int, int]] = field(default_factory=list)  # (seed, offset, count) per random draw
    arguments: set[int] = field(default_factory=set)  # ids of the step's argument nodes
    grads: dict[int, tuple] = field(default_factory=dict)  # id(tensor) -> (tensor, .grad before, first new)
    modules: dict[int, tuple] = field(default_factory=dict)  # id(module) -> (module, its mode, parameters,
    # its own and its submodules', which of them train, its children), as its first call in the step found them
    generation: int = field(default_factory=lambda: nn_module.generation)  # modules' registries at the start
    failure: str | None = None

    def guard(self, read: Callable[[], object]) -> None:
        """Make the recording depend on `read()`: a replay re-reads it and records again on a change."""
        self.guards.append((read, read()))

    def note_module(self, module) -> None:
        """The step calls `module`: a replay depends on its train/eval mode, its parameters and its submodules'
        (a forward may read a child's weight without calling it) and which of them train (a change records
        the step again)."""
        if id(module) not in self.modules:
            params = list(module.parameters())
            self.modules[id(module)] = (module, module.training, params, [p.requires_grad for p in params],
                                        list(module._modules.values()))

    def refresh(self, update: Callable[[], None]) -> None:
        """Run `update()` before each replay: it brings Tensors the step reads up to date with Python
        state (an optimizer's learning rate), and the replay follows them."""
        if update not in self.refreshers:
            self.refreshers.append(update)

    def fail(self, reason: str) -> None:
        """The step cannot be replayed (it still runs normally)."""
        if self.failure is None:
            self.failure = reason

    def note_rebind(self, tensor: Tensor, old: Node) -> None:
        if id(tensor) not in self.rebound:
            self.rebound[id(tensor)] = (weakref.ref(tensor), old)

    def note_grad(self, tensor: Tensor, old: Tensor | None, new: Tensor | None) -> None:
        if id(tensor) not in self.grads:
            self.grads[id(tensor)] = (weakref.ref(tensor), old, new)

    def note_grad_read(self, tensor: Tensor) -> None:
        """The step reads `tensor.grad`. A gradient set inside the step is part of the recording; one
        computed before it is an input: a replay must see the same one (or the step is recorded again),
        and one still pending would be computed inside the recording from inputs the replay cannot know."""
        if id(tensor) in self.grads:
            return
        if not tensor.grad._node.realized:
            self.fail("it reads gradients of a backward pass run outside it (run the backward pass inside the step)")
        else:  # the buffer stays alive while the recording reads it, so its id names it
            self.guard(functools.partial(_grad_buffer, tensor))

    def note_upload(self, buffer, source: Node) -> None:
        self.uploads[id(buffer)] = source

    def note_draw(self, seed: int, offset: int, count: int) -> None:
        self.draws.append((seed, offset, count))

    def note_host_work(self, order: list[Node]) -> None:
        """The cpu computed `order` during the step. Work that waited from before the step (a model built
        on the cpu, moved to the GPU) is computed once, as it would be anyway; work on the step's arguments
        or on random numbers would be computed anew by each call, and the replay cannot."""
        drawn = {(seed, offset) for seed, offset, _ in self.draws}
        if any((n.op is Op.RAND and (n.attrs["seed"], n.attrs["offset"]) in drawn)
               or any(id(i) in self.arguments for i in n.inputs) for n in order):
            self.fail("it computes on the cpu, whose reference backend runs op by op and has nothing to replay")

    def record_plan(self, plan, sig: Signature, device, inputs: list, outputs: list, kept: list[Node]) -> None:
        self.plans.append(RecordedPlan(plan, sig, device, inputs, outputs, kept))


def _grad_buffer(tensor: Tensor) -> int | None:
    return id(tensor.grad._node.buffer) if tensor.grad is not None else None


class record:
    """`with record() as recorder:` notes what runs in the block (a recording inside it notes its own)."""

    def __enter__(self) -> Recorder:
        self.recorder, self.outer = Recorder(), executor.this_thread.recorder
        executor.this_thread.recorder = self.recorder
        return self.recorder

    def __exit__(self, *exc) -> None:
        executor.this_thread.recorder = self.outer
