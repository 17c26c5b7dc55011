"""The primitive op set, and the table of each primitive's rules.

Every user-facing op (softmax, layer norm, cross entropy, pooling, indexing...) is a
composition of these primitives, so an autograd rule, a reference implementation and
a code generator exist once per primitive. Frontend functions check user input and
give the user-facing error; the shape rules assert the invariants the frontend must
have established (equal shapes for elementwise ops, equal dtypes for binary ops).

`RULES` holds, per primitive: its shape and dtype rule, its derivative (VJP), its reference
implementation, its lowering per code generator and, for a reduction, its identity. The table lives
here, at the bottom of the pipeline, so every layer reads it without importing the layers above:
`infer` its shape rules, autograd its VJPs, the reference backend its NumPy implementations, a code
generator its lowerings. The rules are declared side by side with the primitive's user-facing ops,
one `define` per primitive in the op-family module (`ember/ops/pointwise_rules.py`, `reduce.py`, `movement.py`,
`contraction.py`, `index.py`, `sorting.py`, `creation.py`, `random.py`, and `ember/placement.py` for COPY),
which fill the table when ember is imported, as JAX's lax.py registers each primitive's rules.
tests/test_primitives.py checks that every primitive declares every rule.

A composite op (Kind.COMPOSITE: linear, relu, gelu, silu, softmax, log_softmax, layer_norm, batch_norm, mse_loss,
cross_entropy, max_pool2d, an optimizer's update) is one node where a user calls one function, so a step's graph is
built, keyed and looked up with fewer nodes; it declares a shape rule, a VJP and its expansion into primitives
(`define_composite`), and the compiler expands it before anything else sees the graph. A composite with several
results (batch norm's output and running statistics, an optimizer's update of a parameter and its state:
ember.ir.template) is one node per result, all on the same inputs; they share one expansion (`expand`).
"""

from __future__ import annotations

import enum
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
    COMPOSITE = "composite"  # a user-level op that the compiler expands into primitives (see `composite`)


class Op(enum.Enum):
    # an op is hashed by identity, in C: a plan key holds one per node and is hashed at every realization (Enum's
    # own __hash__ is a Python function); members are singletons, so equality is identity anyway
    __hash__ = object.__hash__

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
    CONV2D_INPUT_GRAD = ("conv2d_input_grad", Kind.CONTRACTION)  # a convolution's gradient to its input
    CONV2D_WEIGHT_GRAD = ("conv2d_weight_grad", Kind.CONTRACTION)  # a convolution's gradient to its weight
    # softmax(q @ kᵀ · scale, masked) @ v over (..., L, D) queries, (..., S, D) keys, (..., S, E) values and an
    # optional (..., L, S) mask, or its rows' log-sum-exp (attrs: scale, causal, mask, safe, result)
    ATTENTION = ("attention", Kind.CONTRACTION)
    ATTENTION_GRAD = ("attention_grad", Kind.CONTRACTION)  # its gradient to q, k or v (attrs["result"])
    # index
    GATHER = ("gather", Kind.INDEX)
    SCATTER_ADD = ("scatter_add", Kind.INDEX)
    ARGSORT = ("argsort", Kind.INDEX)  # int64 positions that sort along attrs["axis"], stably (attrs: descending)
    # an index passed through as it is, checked against its dimension where it is computed (pointwise)
    CHECK_INDEX = ("check_index", Kind.UNARY)
    # transfers
    COPY = ("copy", Kind.DEVICE)
    # a collective of the process group (ember.distributed): its input as this process holds it, its result as every
    # process gets it (attrs: collective, reduce, source, world)
    COLLECTIVE = ("collective", Kind.DEVICE)
    # composites: one node while the graph is built and looked up, primitives from compilation on
    LINEAR = ("linear", Kind.COMPOSITE)  # x @ weight.T (+ bias), as torch.nn.functional.linear
    RELU = ("relu", Kind.COMPOSITE)  # max(x, 0) of a float tensor, NaN passing through
    GELU = ("gelu", Kind.COMPOSITE)  # x * Φ(x), exact or the tanh approximation (attrs: approximate)
    SILU = ("silu", Kind.COMPOSITE)  # x * sigmoid(x)
    MSE_LOSS = ("mse_loss", Kind.COMPOSITE)  # mean squared error of equal shapes and dtypes (attrs: reduction)
    CROSS_ENTROPY = ("cross_entropy", Kind.COMPOSITE)  # of logits and class indices, without class weights
    SOFTMAX = ("softmax", Kind.COMPOSITE)  # of a float tensor along attrs["axis"], as attrs["dtype"]
    LOG_SOFTMAX = ("log_softmax", Kind.COMPOSITE)  # likewise
    LAYER_NORM = ("layer_norm", Kind.COMPOSITE)  # over the last attrs["dims"] axes; inputs x (, weight) (, bias)
    # batch norm in training with running statistics: one node per result (attrs["result"]: 0 the output, 1 and 2
    # the new running mean and variance); inputs x, running mean, running variance (, weight) (, bias)
    BATCH_NORM = ("batch_norm", Kind.COMPOSITE)
    # the maximum over windows of the last two dims (attrs: kernel, stride, padding, ceil_mode; no dilation), whose
    # gradient reads, for each input element, only the windows that hold it
    MAX_POOL2D = ("max_pool2d", Kind.COMPOSITE)
    TEMPLATE = ("template", Kind.COMPOSITE)  # one output of a recorded subgraph (ember.ir.template): an update

    def __init__(self, label: str, kind: Kind):
        self.label = label
        self.kind = kind

    def __repr__(self) -> str:
        return f"Op.{self.name}"


def check_shape(cond: bool, op: Op, msg: str) -> None:
    """A shape rule's check of an invariant the frontend should have established."""
    if not cond:
        raise ShapeError(f"{op.label}: {msg}")


# Movement ops a strided view (shape, strides, offset) expresses: a vendor library (cuBLAS, cuDNN) reads an
# operand through them without a copy. FLIP would need negative strides and PAD a mask, so their results are
# computed into a buffer first; generated kernels fold every movement op into their index arithmetic.
STRIDED_VIEWS = (Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE)


# -- the rules table -------------------------------------------------------------------------------

TARGETS = ("triton",)  # code generators with per-primitive lowerings

# a VJP rule: no gradient flows through the primitive (bool results; leaves, which have no inputs)
NOT_DIFFERENTIABLE = "not differentiable"


@dataclass
class Rules:
    shape: Callable | None = None  # (inputs, attrs) -> (shape, dtype); inputs are Nodes
    vjp: Callable | str | None = None  # (g, xs, out, attrs) -> one gradient or None per input
    # (*inputs, **attrs) -> array: the inputs are NumPy arrays (half types widened to float32 but for
    # movement and transfers), the node's attributes come as keywords, as JAX's impl rules take params
    reference: Callable | None = None
    lowerings: dict[str, Callable] = field(default_factory=dict)  # target -> lowering
    identity: Callable[[DType], bool | int | float] | None = None  # a reduction's neutral element, per dtype
    expand: Callable | None = None  # a composite's (input nodes, attrs) -> its value, made of primitives
    # a composite with several results: attrs -> (what its expansion is of, besides the inputs; which result
    # the node is), and `expand` gives every result
    result: Callable | None = None


RULES: dict[Op, Rules] = {op: Rules() for op in Op}


def define(op: Op, *, shape: Callable, vjp: Callable | str, reference: Callable,
           identity: Callable[[DType], bool | int | float] | None = None, **lowerings: Callable) -> None:
    """Declare a primitive's rules (once; a second declaration is a mistake)."""
    assert RULES[op].shape is None, f"{op} is declared twice"
    unknown = set(lowerings) - set(TARGETS)
    assert not unknown, f"{op}: lowerings for unknown targets {unknown}"
    RULES[op] = Rules(shape, vjp, reference, dict(lowerings), identity)


def define_composite(op: Op, *, shape: Callable, vjp: Callable | str, expand: Callable,
                     result: Callable | None = None) -> None:
    """Declare a composite op: a shape rule (cheap: the node is made at every call), a VJP and its expansion
    into primitives, which the compiler applies once per plan (and the reference backend where it runs it).
    With `result`, the op has several results, one node each (see Rules.result)."""
    assert op.kind is Kind.COMPOSITE and RULES[op].shape is None, f"{op} is declared twice, or is a primitive"
    RULES[op] = Rules(shape, vjp, expand=expand, result=result)


def expand(op: Op, inputs: tuple, attrs: dict, shared: dict):
    """A composite node's value made of primitives on `inputs`. The results of a composite with several share
    one expansion, kept in `shared` (a caller's one dict per graph) under the inputs, so each is expanded once."""
    rules = RULES[op]
    if rules.result is None:
        return rules.expand(inputs, attrs)
    of, k = rules.result(attrs)
    key = (op, of, tuple(map(id, inputs)))
    results = shared.get(key)
    if results is None:
        results = shared[key] = rules.expand(inputs, attrs)
    return results[k]


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
    """Shape and dtype of `op` applied to input nodes with these attributes, by the primitive's rule."""
    return RULES[op].shape(inputs, attrs)
