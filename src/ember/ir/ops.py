"""The primitive op set, and the table of each primitive's rules.

Every user-facing op (softmax, layer norm, cross entropy, pooling, indexing...) is a
composition of these primitives, so an autograd rule, a reference implementation and
a code generator exist once per primitive. Frontend functions check user input and
give the user-facing error; the shape rules assert the invariants the frontend must
have established (equal shapes for elementwise ops, equal dtypes for binary ops).

`RULES` holds, per primitive: its shape and dtype rule, its derivative (VJP), its reference
implementation and its lowering per code generator. The table lives here, at the bottom of the
pipeline, so every layer reads it without importing the layers above: `infer` its shape rules,
autograd its VJPs, the reference backend its NumPy implementations, a code generator its lowerings.
The rules are declared side by side with the primitive's user-facing ops (the pointwise primitives
in `ember/ops/pointwise.py`), which fill the table when ember is imported, as JAX's lax.py registers
each primitive's rules. tests/test_primitives.py checks that every primitive declares every rule.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ember import dtypes
from ember.dtypes import DType
from ember.errors import ShapeError


class Kind(enum.Enum):
    LEAF = "leaf"
    UNARY = "unary"
    BINARY = "binary"
    TERNARY = "ternary"
    REDUCE = "reduce"
    MOVEMENT = "movement"
    CONTRACTION = "contraction"
    INDEX = "index"
    DEVICE = "device"


class Op(enum.Enum):
    # leaves
    BUFFER = ("buffer", Kind.LEAF)  # realized data
    CONST = ("const", Kind.LEAF)  # one scalar value of a given shape
    IOTA = ("iota", Kind.LEAF)  # 0, 1, ..., n-1 as int64
    RAND = ("rand", Kind.LEAF)  # Philox uniform or normal float32, a pure function of (seed, offset)
    # unary pointwise
    NEG = ("neg", Kind.UNARY)
    ABS = ("abs", Kind.UNARY)
    SIGN = ("sign", Kind.UNARY)
    EXP = ("exp", Kind.UNARY)
    LOG = ("log", Kind.UNARY)
    LOG1P = ("log1p", Kind.UNARY)
    SQRT = ("sqrt", Kind.UNARY)
    RECIPROCAL = ("reciprocal", Kind.UNARY)
    SIN = ("sin", Kind.UNARY)
    COS = ("cos", Kind.UNARY)
    TANH = ("tanh", Kind.UNARY)
    ERF = ("erf", Kind.UNARY)
    FLOOR = ("floor", Kind.UNARY)
    CEIL = ("ceil", Kind.UNARY)
    ROUND = ("round", Kind.UNARY)
    NOT = ("logical_not", Kind.UNARY)
    CAST = ("cast", Kind.UNARY)
    # binary pointwise (operands of one shape and one dtype)
    ADD = ("add", Kind.BINARY)
    SUB = ("sub", Kind.BINARY)
    MUL = ("mul", Kind.BINARY)
    DIV = ("div", Kind.BINARY)  # true division on floats, C (truncating) division on integers
    FLOORDIV = ("floordiv", Kind.BINARY)
    MOD = ("remainder", Kind.BINARY)  # Python's remainder: the sign of the divisor
    POW = ("pow", Kind.BINARY)
    MAXIMUM = ("maximum", Kind.BINARY)
    MINIMUM = ("minimum", Kind.BINARY)
    EQ = ("eq", Kind.BINARY)
    NE = ("ne", Kind.BINARY)
    LT = ("lt", Kind.BINARY)
    LE = ("le", Kind.BINARY)
    AND = ("logical_and", Kind.BINARY)
    OR = ("logical_or", Kind.BINARY)
    # ternary
    WHERE = ("where", Kind.TERNARY)
    # reductions: dims are kept with size 1
    SUM = ("sum", Kind.REDUCE)
    PROD = ("prod", Kind.REDUCE)
    MAX = ("max", Kind.REDUCE)
    MIN = ("min", Kind.REDUCE)
    ARGMAX = ("argmax", Kind.REDUCE)
    ARGMIN = ("argmin", Kind.REDUCE)
    # movement: change the view, never the data
    RESHAPE = ("reshape", Kind.MOVEMENT)
    PERMUTE = ("permute", Kind.MOVEMENT)
    EXPAND = ("expand", Kind.MOVEMENT)
    SLICE = ("slice", Kind.MOVEMENT)
    FLIP = ("flip", Kind.MOVEMENT)
    PAD = ("pad", Kind.MOVEMENT)
    # contraction: the anchors of fused kernels
    MATMUL = ("matmul", Kind.CONTRACTION)
    CONV2D = ("conv2d", Kind.CONTRACTION)
    # index
    GATHER = ("gather", Kind.INDEX)
    SCATTER_ADD = ("scatter_add", Kind.INDEX)
    # transfers
    COPY = ("copy", Kind.DEVICE)

    def __init__(self, label: str, kind: Kind):
        self.label = label
        self.kind = kind

    def __repr__(self) -> str:
        return f"Op.{self.name}"


def _check(cond: bool, op: Op, msg: str) -> None:
    if not cond:
        raise ShapeError(f"{op.label}: {msg}")


def slice_length(start: int, stop: int, step: int) -> int:
    return max(0, -(-(stop - start) // step))


# -- the rules table -------------------------------------------------------------------------------

TARGETS = ("triton",)  # code generators with per-primitive lowerings

NOT_DIFFERENTIABLE = "not differentiable"  # a VJP rule: the output carries no gradient (bool results)


@dataclass
class Rules:
    shape: Callable | None = None  # (inputs, attrs) -> (shape, dtype); inputs are Nodes
    vjp: Callable | str | None = None  # (g, xs, out, attrs) -> one gradient or None per input
    reference: Callable | None = None  # NumPy arrays in (half types widened to float32) -> array
    lowerings: dict[str, Callable] = field(default_factory=dict)  # target -> lowering


RULES: dict[Op, Rules] = {op: Rules() for op in Op}


def define(op: Op, *, shape: Callable, vjp: Callable | str, reference: Callable, **lowerings: Callable) -> None:
    """Declare a primitive's rules (once; a second declaration is a mistake)."""
    assert RULES[op].shape is None, f"{op} is declared twice"
    unknown = set(lowerings) - set(TARGETS)
    assert not unknown, f"{op}: lowerings for unknown targets {unknown}"
    RULES[op] = Rules(shape, vjp, reference, dict(lowerings))


def vjp_rule(op: Op, rule: Callable | str) -> None:
    """Declare the VJP of a primitive whose other rules are not in the table yet."""
    RULES[op].vjp = rule


# -- shape and dtype rules shared by the pointwise primitives ------------------------------------

def _same_shape(op: Op, inputs) -> tuple[int, ...]:
    shape = inputs[0].shape
    if any(i.shape != shape for i in inputs):
        raise ShapeError(f"{op.label}: operand shapes differ: {', '.join(str(i.shape) for i in inputs)}")
    return shape


def elementwise(op: Op):
    """Operands of one shape and one dtype; the result has both."""
    def rule(inputs, attrs) -> tuple[tuple[int, ...], DType]:
        shape = _same_shape(op, inputs)
        assert all(i.dtype is inputs[0].dtype for i in inputs), \
            f"{op.label}: dtypes differ: {', '.join(str(i.dtype) for i in inputs)}"
        return shape, inputs[0].dtype
    return rule


def predicate(op: Op):
    """Operands of one shape and one dtype; the result is bool."""
    same = elementwise(op)

    def rule(inputs, attrs) -> tuple[tuple[int, ...], DType]:
        return same(inputs, attrs)[0], dtypes.bool_
    return rule


def cast_rule(inputs, attrs) -> tuple[tuple[int, ...], DType]:
    return inputs[0].shape, attrs["dtype"]


def where_rule(inputs, attrs) -> tuple[tuple[int, ...], DType]:
    condition, a, b = inputs
    shape = _same_shape(Op.WHERE, inputs)
    assert condition.dtype is dtypes.bool_ and a.dtype is b.dtype
    return shape, a.dtype


def infer(op: Op, inputs: tuple, attrs: dict) -> tuple[tuple[int, ...], DType]:
    """Shape and dtype of `op` applied to input nodes with these attributes."""
    rule = RULES[op].shape
    if rule is not None:
        return rule(inputs, attrs)
    kind = op.kind
    if kind is Kind.LEAF:
        shape = attrs["shape"] if op is not Op.IOTA else (attrs["n"],)
        dtype = {Op.IOTA: dtypes.int64, Op.RAND: dtypes.float32}.get(op) or attrs["dtype"]
        return tuple(shape), dtype
    x = inputs[0]
    if kind is Kind.REDUCE:
        axes = attrs["axes"]
        _check(all(0 <= a < len(x.shape) for a in axes), op, f"axes {axes} out of range for {x.shape}")
        shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        return shape, (dtypes.int64 if op in (Op.ARGMAX, Op.ARGMIN) else x.dtype)
    if kind is Kind.MOVEMENT:
        return _movement_shape(op, x.shape, attrs), x.dtype
    if op is Op.MATMUL:
        a, b = x.shape, inputs[1].shape
        _check(len(a) == len(b) >= 2 and a[:-2] == b[:-2] and a[-1] == b[-2], op,
               f"cannot multiply {a} by {b}")
        return a[:-1] + b[-1:], x.dtype
    if op is Op.CONV2D:
        return _conv2d_shape(x.shape, inputs[1].shape, attrs), x.dtype
    if op is Op.GATHER:
        return inputs[1].shape, x.dtype
    if op is Op.SCATTER_ADD:
        return x.shape, x.dtype
    if op is Op.COPY:
        return x.shape, x.dtype
    raise AssertionError(f"no shape rule for {op}")


def _movement_shape(op: Op, shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    if op is Op.RESHAPE:
        new = tuple(attrs["shape"])
        _check(math.prod(new) == math.prod(shape), op, f"cannot reshape {shape} to {new}")
        return new
    if op is Op.PERMUTE:
        order = attrs["order"]
        _check(sorted(order) == list(range(len(shape))), op, f"bad order {order} for {shape}")
        return tuple(shape[i] for i in order)
    if op is Op.EXPAND:
        new = tuple(attrs["shape"])
        _check(len(new) == len(shape) and all(s in (1, n) for s, n in zip(shape, new)), op,
               f"cannot expand {shape} to {new}")
        return new
    if op is Op.SLICE:
        return tuple(slice_length(*s) for s in attrs["slices"])
    if op is Op.FLIP:
        return shape
    if op is Op.PAD:
        pads = attrs["pads"]
        _check(len(pads) == len(shape) and all(lo >= 0 and hi >= 0 for lo, hi in pads), op,
               f"bad pads {pads} for {shape}")
        return tuple(s + lo + hi for s, (lo, hi) in zip(shape, pads))
    raise AssertionError(op)


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _conv2d_shape(x: tuple, w: tuple, attrs: dict) -> tuple[int, ...]:
    n, c, h, wd = x
    o, cg, kh, kw = w
    (sh, sw), (ph, pw), (dh, dw), g = attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]
    _check(c == cg * g and o % g == 0, Op.CONV2D, f"input {x} and weight {w} do not fit groups={g}")
    return (n, o, conv_out_size(h, kh, sh, ph, dh), conv_out_size(wd, kw, sw, pw, dw))
