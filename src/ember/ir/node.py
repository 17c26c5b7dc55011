"""Node: one value of the lazy graph, `(op, inputs, attrs, shape, dtype, device)`.

Realizing a node gives it a buffer and turns it into a leaf (`Op.BUFFER`), dropping
its inputs, so the graph behind a realized value can be freed.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from collections.abc import Iterable

from ember.device import Device
from ember.dtypes import DType
from ember.errors import device_mismatch
from ember.ir.ops import Kind, Op, infer

# while templates record (ember.ir.template), the nodes `make` makes, by recording thread; None while none does
# (so that `make` tests one global: a threading.local's attribute costs it several times more to read)
made: dict[int, list] | None = None


class Node:
    __slots__ = ("op", "inputs", "attrs", "shape", "dtype", "device", "buffer", "handles", "static", "__weakref__")

    def __init__(self, op: Op, inputs: tuple[Node, ...], attrs: dict, shape: tuple[int, ...],
                 dtype: DType, device: Device, buffer=None, static: tuple | None = None):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.buffer = buffer
        self.handles: list[weakref.ref] = []  # the Tensors that show this node to the user
        self.static = static  # its part of a plan key (static_key), once a signature has read it

    @staticmethod
    def make(op: Op, inputs: tuple[Node, ...] = (), device: Device | None = None, **attrs) -> Node:
        """Build a node, applying the primitive's shape and dtype rule."""
        if op is Op.COPY:
            attrs["device"] = device  # the target; the input lives elsewhere
        elif inputs:
            device = inputs[0].device
            for i in inputs:
                if i.device is not device and i.device != device:
                    raise device_mismatch(op.label, *inputs)
        assert device is not None, f"{op.label}: a leaf needs a device"
        shape, dtype = infer(op, inputs, attrs)
        node = Node(op, inputs, attrs, shape, dtype, device)
        recordings = made  # one read: another thread may reset the global between two
        if recordings is not None:
            recording = recordings.get(threading.get_ident())
            if recording is not None:
                recording.append(node)
        return node

    @staticmethod
    def from_buffer(buffer, dtype: DType, device: Device) -> Node:
        return Node(Op.BUFFER, (), {}, tuple(buffer.shape), dtype, device, buffer)

    def __getstate__(self):
        """Pickled without data or handles: only the graph of a compiled plan is ever stored."""
        return (self.op, self.inputs, self.attrs, self.shape, self.dtype, self.device)

    def __setstate__(self, state) -> None:
        self.op, self.inputs, self.attrs, self.shape, self.dtype, self.device = state
        self.buffer = None
        self.handles = []
        self.static = None

    @property
    def realized(self) -> bool:
        return self.buffer is not None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_held(self) -> bool:
        """Whether a live Tensor shows this node to the user (so its value must be kept)."""
        return any(ref() is not None for ref in self.handles)

    def set_buffer(self, buffer) -> None:
        """Become a realized leaf: the graph behind this node is no longer needed."""
        self.buffer = buffer
        self.op = Op.BUFFER
        self.inputs = ()
        self.attrs = {}
        self.static = None

    def __repr__(self) -> str:
        return f"Node({self.op.label}, shape={self.shape}, dtype={self.dtype.name}, device={self.device})"


# Float constants with these values are part of a plan's structure (and may be simplified away; a power of 2 or 3
# is products); every other float constant is a runtime argument, so a changing learning rate does not compile a
# new plan.
STRUCTURAL_FLOATS = frozenset({0.0, 1.0, -1.0, 2.0, 0.5, 3.0})


def is_runtime_scalar(node: Node) -> bool:
    """Whether a constant is an argument of the plan (a float that may change from step to step) rather than
    part of its code: not a whole or infinite value, and not one a composite's expansion fixes ("fixed")."""
    if node.op is not Op.CONST or not node.dtype.is_floating_point:
        return False
    attrs = node.attrs
    if "fixed" in attrs:
        return False
    value = attrs["value"]
    return not (value in STRUCTURAL_FLOATS or math.isinf(value) or math.isnan(value))


def static_key(node: Node) -> tuple:
    """A pending node's own part of the structural key of a graph (its inputs' part is their positions):
    op, shape, dtype and attributes, without what changes from step to step (a runtime scalar's value, a
    random draw's seed and offset)."""
    op, attrs = node.op, node.attrs
    if op is Op.RAND:
        own = attrs["distribution"]
    elif op is Op.CONST and is_runtime_scalar(node):
        own = None
    elif op is Op.CONST and attrs["value"] != attrs["value"]:
        own = ("nan", attrs["dtype"])  # NaN is not equal to itself
    elif op is Op.CONST and attrs["value"] == 0 and math.copysign(1.0, attrs["value"]) < 0:
        own = ("-0.0", attrs["dtype"])  # equal to 0.0, but not the same constant (1 / -0.0 is -inf)
    else:
        own = tuple(attrs.items())
    return (op, node.shape, node.dtype, own)


def toposort(roots: Iterable[Node], placed: set[Node] | None = None) -> list[Node]:
    """Unrealized nodes needed for `roots`, inputs before users (iterative: graphs get deep); nodes in `placed`
    (already ordered by the caller) and what they need are left out."""
    order: list[Node] = []
    append = order.append
    seen: set[Node] = set(placed) if placed else set()  # nodes hash by identity: no id() call per visit
    see = seen.add
    # tuples of inputs already ordered whole (a template's results share one, often of hundreds of nodes)
    done: set[int] = set()
    for root in roots:
        if root.buffer is not None or root in seen:
            continue
        see(root)
        stack = [(root, iter(()) if id(root.inputs) in done else iter(root.inputs))]
        push, pop = stack.append, stack.pop
        while stack:
            node, it = stack[-1]
            for child in it:
                if child.buffer is None and child not in seen:
                    see(child)
                    push((child, iter(()) if id(child.inputs) in done else iter(child.inputs)))
                    break
            else:
                pop()
                append(node)
                if len(node.inputs) > 8:
                    done.add(id(node.inputs))
    return order


def is_elementwise(op: Op) -> bool:
    return op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY)


def picker(refs: tuple[int, ...] | list[int]):
    """A function of a list giving its entries at `refs`, as a tuple (itemgetter: C speed): a template's
    step picks its inputs from the nodes made so far with one."""
    if len(refs) >= 2:
        return operator.itemgetter(*refs)
    if len(refs) == 1:
        (only,) = refs
        return lambda made: (made[only],)
    return lambda made: ()
