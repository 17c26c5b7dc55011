"""Realization: turn pending graph into values on the nodes' devices.

`realize(nodes)` evaluates everything the requested nodes need in one go. Besides
the requested nodes, every node of that graph that a live Tensor still shows to the
user is kept, so a value is computed once even when the user reads it later (the
loss of a step realized together with the optimizer update, for example). The runtime target of the
graph's device type (runtime/targets.py) computes the values.

`this_thread.recorder` is the observer `ember.jit` installs while it records a step: realization tells it
what the host reads and computes and what it uploads; the launcher, the plans it executes. It, the observers
and the values waiting for the next realization are per thread: a thread that records or explains sees its
own realizations only, as a thread building its own graph expects, and those done on its behalf (`reporting_to`).
"""

from __future__ import annotations

import _signal
import contextlib
import threading
import weakref
from collections.abc import Iterable

import numpy as np

from ember.device import Device
from ember.errors import DeviceError
from ember.ir import Node, Op, toposort
from ember.runtime import targets


class _ThisThread(threading.local):
    recorder = None  # the step ember.jit is recording in this thread (an ember.recording.Recorder), None when none is

    def __init__(self) -> None:
        self.companions: list[weakref.ref] = []  # nodes to realize with the next realization (realize_with_next)
        self.observers: list = []  # callables given (order, keep) before each realization, e.g. explain.capture


this_thread = _ThisThread()


@contextlib.contextmanager
def reporting_to(observers: list):
    """This thread's realizations inside the block are also shown to `observers`, another thread's: for work done
    on that thread's behalf (a torch.compile backward, which autograd runs on a thread of its own)."""
    added = [o for o in observers if o not in this_thread.observers]
    this_thread.observers.extend(added)
    try:
        yield
    finally:
        for o in added:
            this_thread.observers.remove(o)

# nodes showing a buffer that a later replay of an ember.jit step overwrites (once no returned Tensor shows it),
# each with the step's program: one whose memory is shared outside ember gets a buffer of its own first, unless
# the program lends it (runtime.dlpack.torch_buffers)
transient: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# buffers, by id, that a later run of a steady plan (runtime.steady) overwrites once nothing shows them: the same
recycled: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def to_host(buffer, device: Device) -> np.ndarray:
    """A device buffer as a NumPy array."""
    if device.type == "cpu":
        return buffer
    if this_thread.recorder is not None:
        this_thread.recorder.fail(f"it reads a value from {device} on the host (.item(), .numpy(), .cpu(), print)")
    from ember.runtime import index_checks, transfer  # torch: only for a cuda value

    array = transfer.download(buffer)
    index_checks.raise_found(buffer)  # what the work computing it found, now that it is done
    return array


def from_host(array: np.ndarray, device: Device):
    """A NumPy array as a buffer on `device`."""
    if device.type == "cpu":
        return array
    from ember.runtime import transfer  # torch: only for a cuda value

    return transfer.upload(array, device)


def filled(shape: tuple[int, ...], dtype, device: Device, value) -> object:
    """A buffer of `value` made on `device` now (filled there, nothing uploaded)."""
    if device.type == "cpu":
        return np.full(shape, value, dtype=dtype.np)
    from ember.runtime import cuda  # torch: only for a cuda value

    buffer = cuda.allocate(shape, dtype, cuda.torch_device(device), device, "a filled buffer")
    buffer.fill_(value)
    return buffer


def _transfer(node: Node) -> None:
    """A COPY across devices: compute its input where it lives, then move the value."""
    source = node.inputs[0]
    realize([source])
    node.set_buffer(from_host(to_host(source.buffer, source.device), node.device))
    if this_thread.recorder is not None:
        this_thread.recorder.note_upload(node.buffer, source)


def realize_with_next(node: Node) -> None:
    """Compute `node` with the next realization on its device, if a Tensor still shows it then.

    `backward()` registers its root this way, so the loss of a training step is computed
    in the same graph as the optimizer update instead of on its own afterwards.
    """
    this_thread.companions.append(weakref.ref(node))


def pending_on_one_device(nodes: list[Node]) -> list[Node]:
    """The pending graph behind `nodes`, after moving across devices what it copies from elsewhere
    (a transfer computes its source where it lives first, unless the source depends on no data at all):
    what one backend then evaluates."""
    order = toposort(nodes)
    transfers = [n for n in order if n.op is Op.COPY and n.inputs[0].device != n.device]
    # values that depend on no data are made on the GPU they go to, together (a model's initial parameters:
    # one plan per GPU), apart from the graph using them; not while ember.jit records, which must see a step
    # that draws random numbers on the host to know it cannot replay it
    made_here = [n for n in transfers if n.device.type != "cpu" and this_thread.recorder is None
                 and _made_here(n)]
    for device in {n.device for n in made_here}:
        realize([n for n in made_here if n.device == device])
    for n in transfers:
        if not n.realized:  # an earlier transfer's source may have moved it
            _transfer(n)
    return toposort(nodes) if transfers else order


_DATA_FREE = frozenset({Op.RAND, Op.CONST, Op.IOTA})


def _made_here(copy: Node) -> bool:
    """Turn a COPY of a value that depends on no data (random numbers, constants, ranges and what is computed
    from them, such as a parameter's initial value) into that computation on the destination device: the
    generator is the same on every device, so nothing is computed on the host or moved. The values agree
    with the source device's to the rounding of their arithmetic. False (nothing changed) otherwise."""
    source = copy.inputs[0]
    graph = toposort([source])
    if not graph or any((not n.inputs and n.op not in _DATA_FREE) or n.op is Op.COPY
                        or any(i.buffer is not None for i in n.inputs) for n in graph):
        return False
    made: dict[int, Node] = {}
    for n in graph[:-1]:
        made[id(n)] = Node(n.op, tuple(made[id(i)] for i in n.inputs), n.attrs, n.shape, n.dtype, copy.device)
    copy.op, copy.inputs, copy.attrs, copy.static = source.op, tuple(made[id(i)] for i in source.inputs), \
        source.attrs, None
    return True


def realize(nodes: Iterable[Node]) -> None:
    requested = [n for n in nodes if not n.realized]
    if not requested:
        return
    companions = this_thread.companions
    if companions:
        device = requested[0].device
        extra = [n for ref in companions if (n := ref()) is not None and not n.realized
                 and n.device == device and n.is_held()]
        companions.clear()
        requested += [n for n in extra if n not in requested]
    order = pending_on_one_device(requested)
    if not order:
        return
    keep = {id(n) for n in requested}
    for n in order:  # and what a live Tensor shows (Node.is_held, inlined: this runs on every realization)
        for ref in n.handles:
            if ref() is not None:
                keep.add(id(n))
                break
    device_types = {n.device.type for n in order}
    if len(device_types) > 1 and len({n.device for n in requested}) > 1:  # values on several devices: one by one
        for device in dict.fromkeys(n.device for n in requested):
            realize([n for n in requested if n.device == device])
        return
    if len(device_types) > 1:
        raise DeviceError(f"one graph spans several devices: {', '.join(sorted(device_types))}")
    for observe in this_thread.observers:
        observe(order, keep)
    (device_type,) = device_types
    if device_type == "cpu" and this_thread.recorder is not None:
        this_thread.recorder.note_host_work(order)
    values = targets.for_device(device_type).run(order, keep)
    with deferred_interrupt():  # every result is bound, or (interrupted before) none: never half a step
        for n in order:
            if id(n) in values:
                n.set_buffer(values[id(n)])


class deferred_interrupt:
    """Hold Ctrl-C until the block ends, so that results (or a replay updating state in place) are
    never bound halfway."""

    def __enter__(self):
        self.caught = None
        self.active = threading.get_ident() == threading.main_thread().ident
        if self.active:  # _signal: signal.signal's enum conversions cost more than the swap itself
            self.previous = _signal.signal(_signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        self.caught = (signum, frame)

    def __exit__(self, *exc) -> None:
        if self.active:
            _signal.signal(_signal.SIGINT, self.previous)
            if self.caught is not None and callable(self.previous):
                self.previous(*self.caught)
