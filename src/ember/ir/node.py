"""Node: one value of the lazy graph, `(op, inputs, attrs, shape, dtype, device)`.

Realizing a node gives it a buffer and turns it into a leaf (`Op.BUFFER`), dropping
its inputs, so the graph behind a realized value can be freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from ember.device import Device
from ember.dtypes import DType
from ember.errors import device_mismatch
from ember.ir.ops import Kind, Op, infer

made: list | None = None  # while a template records (ember.ir.template), the nodes `make` makes


class Node:
    __slots__ = ("op", "inputs", "attrs", "shape", "dtype", "device", "buffer", "handles", "__weakref__")

    def __init__(self, op: Op, inputs: tuple[Node, ...], attrs: dict, shape: tuple[int, ...],
                 dtype: DType, device: Device, buffer=None):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.buffer = buffer
        self.handles: list[weakref.ref] = []  # the Tensors that show this node to the user

    @staticmethod
    def make(op: Op, inputs: tuple[Node, ...] = (), device: Device | None = None, **attrs) -> Node:
        """Build a node, applying the primitive's shape and dtype rule."""
        if op is Op.COPY:
            attrs["device"] = device  # the target; the input lives elsewhere
        elif inputs:
            device = inputs[0].device
            if any(i.device is not device and i.device != device for i in inputs):
                raise device_mismatch(op.label, *inputs)
        assert device is not None, f"{op.label}: a leaf needs a device"
        shape, dtype = infer(op, inputs, attrs)
        node = Node(op, inputs, attrs, shape, dtype, device)
        if made is not None:
            made.append(node)
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

    def __repr__(self) -> str:
        return f"Node({self.op.label}, shape={self.shape}, dtype={self.dtype.name}, device={self.device})"


def toposort(roots: Iterable[Node]) -> list[Node]:
    """Unrealized nodes needed for `roots`, inputs before users (iterative: graphs get deep)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if root.realized or id(root) in seen:
            continue
        seen.add(id(root))
        stack = [(root, iter(root.inputs))]
        while stack:
            node, it = stack[-1]
            for child in it:
                if not child.realized and id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, iter(child.inputs)))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


def is_elementwise(op: Op) -> bool:
    return op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY)
