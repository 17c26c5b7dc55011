"""Pointwise ops against torch: values, result dtypes and gradients, on every dtype torch supports.

Each table row names an op once as a function of the library (`m` is `ember` or torch); the
test ids read `op-dtype-case`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import (
    DTYPES,
    FLOATS,
    GRAD_TOLERANCES,
    HALVES,
    NUMERIC,
    TORCH,
    assert_same,
    check_against_torch,
    check_finite_differences,
    random_array,
)

import ember

pytestmark = pytest.mark.usefixtures("device")


@dataclass(frozen=True)
class Domain:
    """Where an op's inputs are drawn from: [low, high], and a value to stay clear of (a pole or kink)."""

    low: float = -2.0
    high: float = 2.0
    avoid: float | None = None


REAL = Domain()
POSITIVE = Domain(0.2, 3.0)
NONZERO = Domain(avoid=0.0)
SMALL = Domain(-3.0, 3.0)

# -- unary ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unary:
    name: str
    fn: object
    dtypes: tuple
    domain: Domain = REAL
    smooth: bool = True  # whether finite differences measure the gradient (not for floor and friends)


SIGNED_INTS = ("int8", "int16", "int32", "int64")  # torch's hardtanh refuses uint8 with a negative bound

UNARY = [
    Unary("neg", lambda m, x: m.neg(x), NUMERIC),
    Unary("neg-operator", lambda m, x: -x, NUMERIC),
    Unary("abs", lambda m, x: m.abs(x), NUMERIC, NONZERO),
    Unary("exp", lambda m, x: m.exp(x), DTYPES),
    Unary("log", lambda m, x: m.log(x), DTYPES, POSITIVE),
    Unary("log1p", lambda m, x: m.log1p(x), DTYPES, Domain(-0.5, 3.0)),
    Unary("sqrt", lambda m, x: m.sqrt(x), DTYPES, POSITIVE),
    Unary("rsqrt", lambda m, x: m.rsqrt(x), DTYPES, POSITIVE),
    Unary("reciprocal", lambda m, x: m.reciprocal(x), DTYPES, NONZERO),
    Unary("sin", lambda m, x: m.sin(x), DTYPES, SMALL),
    Unary("cos", lambda m, x: m.cos(x), DTYPES, SMALL),
    Unary("tanh", lambda m, x: m.tanh(x), DTYPES, SMALL),
    Unary("sigmoid", lambda m, x: m.sigmoid(x), DTYPES, SMALL),
    Unary("relu", lambda m, x: m.relu(x), NUMERIC, NONZERO),
    Unary("gelu", lambda m, x: m.gelu(x), FLOATS, SMALL),
    Unary("gelu-tanh", lambda m, x: m.gelu(x, approximate="tanh"), FLOATS, SMALL),
    Unary("silu", lambda m, x: m.silu(x), FLOATS, SMALL),
    Unary("softplus", lambda m, x: m.softplus(x), FLOATS, SMALL),
    Unary("softplus-beta", lambda m, x: m.softplus(x, beta=2.0, threshold=3.0), FLOATS, Domain(-3.0, 3.0, 1.5)),
    Unary("erf", lambda m, x: m.erf(x), DTYPES),
    Unary("floor", lambda m, x: m.floor(x), NUMERIC, SMALL, smooth=False),
    Unary("ceil", lambda m, x: m.ceil(x), NUMERIC, SMALL, smooth=False),
    Unary("round", lambda m, x: m.round(x), NUMERIC, SMALL, smooth=False),
    Unary("round-decimals", lambda m, x: m.round(x, decimals=1), FLOATS, SMALL, smooth=False),
    Unary("sign", lambda m, x: m.sign(x), DTYPES, NONZERO, smooth=False),
    Unary("logical_not", lambda m, x: m.logical_not(x), DTYPES),
    Unary("square", lambda m, x: m.square(x), DTYPES),
    Unary("hardtanh", lambda m, x: m.nn.functional.hardtanh(x, -1.5, 2.5), FLOATS + SIGNED_INTS, SMALL,
          smooth=False),
    Unary("relu6", lambda m, x: m.nn.functional.relu6(x), NUMERIC, Domain(-3.0, 8.0), smooth=False),
]

UNARY_CASES = {  # name: (shape, layout)
    "scalar": ((), "contiguous"),
    "vector": ((7,), "contiguous"),
    "matrix": ((3, 5), "contiguous"),
    "batch": ((2, 3, 4), "contiguous"),
    "empty": ((0, 3), "contiguous"),
    "empty-middle": ((2, 0, 3), "contiguous"),
    "transposed": ((4, 3), "transposed"),
    "strided": ((3, 4), "strided"),
}


def _unary_params():
    return [pytest.param(op, dtype, case, id=f"{op.name}-{dtype}-{case}")
            for op in UNARY for dtype in op.dtypes for case in UNARY_CASES]


@pytest.mark.parametrize("op, dtype, case", _unary_params())
def test_unary_matches_torch(op: Unary, dtype, case, rng):
    shape, layout = UNARY_CASES[case]
    d = op.domain
    x = random_array(rng, shape, dtype, d.low, d.high, d.avoid)
    check_against_torch(op.fn, x, layout=layout)


@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in UNARY if op.smooth and "float64" in op.dtypes])
def test_unary_gradient_matches_finite_differences(op: Unary, rng):
    d = op.domain
    check_finite_differences(op.fn, random_array(rng, (3, 4), "float64", d.low, d.high, d.avoid))


# -- binary -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binary:
    name: str
    fn: object
    dtypes: tuple
    left: Domain = REAL
    right: Domain = REAL
    scalars: bool = True  # accepts Python scalars (operators do; torch.maximum and friends do not)
    smooth: bool = True
    grad: bool = True  # torch has a derivative for it (not for floor_divide)


INT_BASE = Domain(-3.0, 3.0)
INT_EXPONENT = Domain(0.0, 3.0)

BINARY = [
    Binary("add", lambda m, a, b: a + b, DTYPES),
    Binary("add-alpha", lambda m, a, b: m.add(a, b, alpha=2), NUMERIC),
    Binary("sub", lambda m, a, b: a - b, NUMERIC),
    Binary("mul", lambda m, a, b: a * b, DTYPES),
    Binary("div", lambda m, a, b: a / b, DTYPES, right=NONZERO),
    Binary("div-trunc", lambda m, a, b: m.div(a, b, rounding_mode="trunc"), NUMERIC, SMALL, NONZERO, smooth=False),
    Binary("div-floor", lambda m, a, b: m.div(a, b, rounding_mode="floor"), NUMERIC, SMALL, NONZERO, smooth=False),
    Binary("floordiv", lambda m, a, b: a // b, NUMERIC, SMALL, NONZERO, smooth=False, grad=False),
    Binary("remainder", lambda m, a, b: a % b, NUMERIC, SMALL, NONZERO, smooth=False),
    Binary("fmod", lambda m, a, b: m.fmod(a, b), NUMERIC, SMALL, NONZERO, scalars=False, smooth=False),
    Binary("pow", lambda m, a, b: a ** b, NUMERIC, POSITIVE, REAL),
    Binary("maximum", lambda m, a, b: m.maximum(a, b), DTYPES, scalars=False),
    Binary("minimum", lambda m, a, b: m.minimum(a, b), DTYPES, scalars=False),
    Binary("eq", lambda m, a, b: a == b, DTYPES),
    Binary("ne", lambda m, a, b: a != b, DTYPES),
    Binary("lt", lambda m, a, b: a < b, DTYPES),
    Binary("le", lambda m, a, b: a <= b, DTYPES),
    Binary("gt", lambda m, a, b: a > b, DTYPES),
    Binary("ge", lambda m, a, b: a >= b, DTYPES),
    Binary("logical_and", lambda m, a, b: m.logical_and(a, b), DTYPES, scalars=False),
    Binary("logical_or", lambda m, a, b: m.logical_or(a, b), DTYPES, scalars=False),
    Binary("logical_xor", lambda m, a, b: m.logical_xor(a, b), DTYPES, scalars=False),
]

BINARY_CASES = {  # name: (left shape or scalar, right shape or scalar, layout)
    "same": ((3, 4), (3, 4), "contiguous"),
    "broadcast": ((3, 1), (1, 4), "contiguous"),
    "broadcast-rank": ((2, 3, 4), (4,), "contiguous"),
    "0d-right": ((3, 4), (), "contiguous"),
    "0d-both": ((), (), "contiguous"),
    "empty": ((0, 4), (1, 4), "contiguous"),
    "transposed": ((4, 3), (4, 3), "transposed"),
    "strided": ((3, 4), (3, 1), "strided"),
    "int-right": ((3, 4), 2, "contiguous"),
    "float-right": ((3, 4), 1.5, "contiguous"),
    "int-left": (3, (3, 4), "contiguous"),
    "float-left": (2.5, (3, 4), "contiguous"),
}
SCALAR_CASES = {"int-right", "float-right", "int-left", "float-left"}


def _operand(rng, spec, dtype, domain: Domain, op: Binary):
    if not isinstance(spec, tuple):
        return spec
    if dtype in NUMERIC and dtype not in FLOATS and op.name == "pow":
        domain = INT_BASE if domain is POSITIVE else INT_EXPONENT
    if dtype == "uint8" and domain.low < 0 and op.name in ("floordiv", "remainder", "fmod", "div-trunc", "div-floor"):
        domain = Domain(1.0, 9.0)
    return random_array(rng, spec, dtype, domain.low, domain.high, domain.avoid)


def _binary_params():
    return [pytest.param(op, dtype, case, id=f"{op.name}-{dtype}-{case}")
            for op in BINARY for dtype in op.dtypes for case in BINARY_CASES
            if op.scalars or case not in SCALAR_CASES]


@pytest.mark.parametrize("op, dtype, case", _binary_params())
def test_binary_matches_torch(op: Binary, dtype, case, rng, device):
    left, right, layout = BINARY_CASES[case]
    a = _operand(rng, left, dtype, op.left, op)
    b = _operand(rng, right, dtype, op.right, op)
    if op.name == "pow" and isinstance(a, int):
        a = 2  # an integer base to an integer tensor power stays an integer; keep it small
    # torch has no derivative of remainder(scalar, tensor) for the tensor; ember's is checked below
    grad = op.grad and not (op.name == "remainder" and not isinstance(a, np.ndarray))
    # a fused kernel keeps a half-precision quotient in float32 where torch rounds it: when rounding
    # carries it to a whole number, the truncated results differ by one
    tolerance = {"atol": 1.0} if device == "cuda" and op.name == "div-trunc" and dtype in HALVES else {}
    check_against_torch(op.fn, a, b, layout=layout, grad=grad, **tolerance)


@pytest.mark.parametrize("op, case", [
    pytest.param(op, case, id=f"{op.name}-{case}")
    for op in BINARY if op.smooth and "float64" in op.dtypes
    for case in ("same", "broadcast", "float-left", "float-right") if op.scalars or case not in SCALAR_CASES])
def test_binary_gradient_matches_finite_differences(op: Binary, case, rng):
    left, right, _ = BINARY_CASES[case]
    a = _operand(rng, left, "float64", op.left, op)
    b = _operand(rng, right, "float64", op.right, op)
    check_finite_differences(op.fn, a, b)


MIXED_PAIRS = [  # dtypes of (left, right), promoted as torch does
    ("int32", "float16"), ("uint8", "int8"), ("bool", "float32"), ("int64", "bfloat16"), ("float16", "bfloat16"),
    ("float32", "float64"), ("bool", "int16"), ("uint8", "bool"), ("int8", "int64"), ("bfloat16", "float32"),
]
MIXED_OPS = ["add", "mul", "div", "maximum", "lt", "eq", "logical_and"]


@pytest.mark.parametrize("left, right", MIXED_PAIRS, ids=[f"{a}-{b}" for a, b in MIXED_PAIRS])
@pytest.mark.parametrize("name", MIXED_OPS)
def test_binary_with_mixed_dtypes_promotes_as_torch(name, left, right, rng):
    op = next(o for o in BINARY if o.name == name)
    a = random_array(rng, (3, 4), left, -2, 2, 0)
    b = random_array(rng, (4,), right, -2, 2, 0)
    check_against_torch(op.fn, a, b)


@pytest.mark.parametrize("zero_d", ["float64", "int64", "float16", "bool"])
@pytest.mark.parametrize("tensor_dtype", ["float16", "int32", "uint8", "bool", "bfloat16"])
def test_binary_with_zero_dim_tensor_follows_torch_promotion(tensor_dtype, zero_d, rng, device):
    a = random_array(rng, (3, 4), tensor_dtype, -2, 2)
    b = random_array(rng, (), zero_d, -2, 2)
    # the 0-d operand's gradient sums half-precision products, which a fused kernel keeps in float32:
    # it matches torch's as closely as half precision allows, whatever the operand's own dtype
    tolerance = {}
    if device == "cuda" and tensor_dtype in HALVES:
        tolerance = dict(zip(("grad_rtol", "grad_atol"), GRAD_TOLERANCES[tensor_dtype]))
    check_against_torch(lambda m, x, y: x * y, a, b, **tolerance)
    check_against_torch(lambda m, x, y: y + x, a, b, **tolerance)


@pytest.mark.parametrize("scalar", [True, 3, -2.5, 1e10], ids=["bool", "int", "float", "big-float"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_python_scalar_on_either_side(dtype, scalar, rng):
    x = random_array(rng, (2, 3), dtype, 1, 3)
    check_against_torch(lambda m, t: t * scalar, x)
    check_against_torch(lambda m, t: scalar * t, x)
    check_against_torch(lambda m, t: t == scalar, x)
    if dtype != "bool" and not isinstance(scalar, bool):
        check_against_torch(lambda m, t: scalar - t, x)


@pytest.mark.parametrize("left, right", [((2, 3), (3, 2)), ((4,), (3,)), ((2, 1, 3), (2, 4))],
                         ids=["matrix", "vector", "rank"])
def test_broadcast_mismatch_raises_like_torch(left, right):
    with pytest.raises(RuntimeError):
        TORCH.ones(left) + TORCH.ones(right)
    with pytest.raises(ember.ShapeError):
        ember.ones(left) + ember.ones(right)


# -- where and clamp --------------------------------------------------------------------------------

# -- half-precision tensors with Python numbers they cannot hold exactly -------------------------------

INEXACT = [3.3, 0.1, 1 / 3, 1e-3, 65519.0]  # 65519 is past float16's largest finite value, 65504
WITH_NUMBER = {  # torch computes mul and div in float32 with the number in float32, the rest with it rounded
    "mul": lambda m, x, s: x * s, "rmul": lambda m, x, s: s * x, "div": lambda m, x, s: x / s,
    "rdiv": lambda m, x, s: s / x, "floor_divide": lambda m, x, s: x // s, "add": lambda m, x, s: x + s,
    "radd": lambda m, x, s: s + x, "sub": lambda m, x, s: x - s, "rsub": lambda m, x, s: s - x,
    "remainder": lambda m, x, s: x % s, "rremainder": lambda m, x, s: s % x, "fmod": lambda m, x, s: m.fmod(x, s),
    "add_alpha": lambda m, x, s: m.add(x, x * 0.5, alpha=s), "sub_alpha": lambda m, x, s: m.sub(x, x * 0.5, alpha=s),
    "lt": lambda m, x, s: x < s, "le": lambda m, x, s: x <= s, "gt": lambda m, x, s: x > s,
    "ge": lambda m, x, s: x >= s, "eq": lambda m, x, s: x == s, "ne": lambda m, x, s: x != s,
    "where_self": lambda m, x, s: m.where(x > 0, s, x), "where_other": lambda m, x, s: m.where(x > 0, x, s),
    "masked_fill": lambda m, x, s: x.masked_fill(x > 0, s), "clamp": lambda m, x, s: x.clamp(-s, s),
    "leaky_relu": lambda m, x, s: m.leaky_relu(x, s),
}


def test_a_float_alpha_with_integer_operands_is_refused_as_torch_refuses_it():
    a = ember.tensor([1, 2])
    for fn in (ember.add, ember.sub):
        with pytest.raises(ember.DTypeError, match="alpha must not be a floating point number"):
            fn(a, a, alpha=2.5)
        with pytest.raises(ember.DTypeError, match="alpha must not be a floating point number"):
            fn(a, 3, alpha=0.5)
    check_against_torch(lambda m, x, y: m.add(x, y, alpha=2), np.array([1, 2, 3]), np.array([4.5, 5.5, 6.5]),
                        grad=False)


def _half_values(dtype: str, scalar: float) -> np.ndarray:
    """Random values of a half type, with some equal to the number as the type rounds it (for ==)."""
    values = np.random.default_rng(7).standard_normal(4096) * 3
    values[::97] = scalar
    return values.astype(ember.dtypes.as_dtype(dtype).np)


def _torch_or_skip(fn, x, scalar):
    try:
        return fn(TORCH, torch.from_numpy(x.astype(np.float32)).to(getattr(torch, x.dtype.name)), scalar)
    except RuntimeError as error:  # torch refuses a number its type cannot hold in some ops (65519 in float16)
        pytest.skip(f"torch refuses: {error}")


@pytest.mark.parametrize("scalar", INEXACT, ids=["3.3", "0.1", "1_3", "1e-3", "65519"])
@pytest.mark.parametrize("name", sorted(WITH_NUMBER))
@pytest.mark.parametrize("dtype", HALVES)
def test_half_tensor_with_an_inexact_python_number_is_bit_exact_with_torch(dtype, name, scalar):
    x = _half_values(dtype, scalar)
    fn = WITH_NUMBER[name]
    expected = _torch_or_skip(fn, x, scalar)
    assert_same(fn(ember, ember.tensor(x), scalar), expected, rtol=0, atol=0, what=f"{name} with {scalar}")


@pytest.mark.parametrize("scalar", INEXACT, ids=["3.3", "0.1", "1_3", "1e-3", "65519"])
@pytest.mark.parametrize("name, fn", [("pow", lambda m, x, s: x.abs() ** s), ("rpow", lambda m, x, s: s ** (x / 4))])
@pytest.mark.parametrize("dtype", HALVES)
def test_half_pow_with_an_inexact_python_number_is_within_one_unit_of_torch(dtype, name, fn, scalar):
    """The number is rounded to the half type as torch does; the power itself may differ from torch's by
    one unit in the last place (torch's float32 pow and ember's are different approximations)."""
    x = _half_values(dtype, scalar)
    expected = _torch_or_skip(fn, x, scalar)
    got = fn(ember, ember.tensor(x), scalar)
    assert got.dtype.name == dtype
    got_bits = got.numpy().astype(ember.dtypes.as_dtype(dtype).np).view(np.int16).astype(np.int32)
    want_bits = expected.view(torch.int16).numpy().astype(np.int32)
    assert np.abs(got_bits - want_bits).max() <= 1


WHERE_CASES = {  # name: (condition shape, x shape or scalar, y shape or scalar)
    "same": ((3, 4), (3, 4), (3, 4)),
    "broadcast": ((3, 1), (1, 4), (4,)),
    "scalar-other": ((3, 4), (3, 4), 0.5),
    "scalar-self": ((3, 4), 2, (3, 4)),
    "empty": ((0, 4), (0, 4), (1, 4)),
}


@pytest.mark.parametrize("case", WHERE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_where_matches_torch(dtype, case, rng):
    cond_shape, xs, ys = WHERE_CASES[case]
    cond = random_array(rng, cond_shape, "bool")
    x = random_array(rng, xs, dtype) if isinstance(xs, tuple) else xs
    y = random_array(rng, ys, dtype) if isinstance(ys, tuple) else ys
    check_against_torch(lambda m, c, a, b: m.where(c, a, b), cond, x, y)
    if dtype == "float64":
        check_finite_differences(lambda m, c, a, b: m.where(c, a, b), cond, x, y)


def test_where_on_transposed_operands(rng):
    cond = random_array(rng, (4, 3), "bool")
    x, y = random_array(rng, (4, 3), "float32"), random_array(rng, (4, 3), "float32")
    check_against_torch(lambda m, c, a, b: m.where(c, a, b), cond, x, y, layout="transposed")


CLAMP_CASES = {  # name: function of (m, x, lo, hi) and whether the bounds are tensors
    "both": (lambda m, x, lo, hi: m.clamp(x, -0.5, 0.5), False),
    "min-only": (lambda m, x, lo, hi: m.clamp(x, min=-0.5), False),
    "max-only": (lambda m, x, lo, hi: x.clamp(max=0.5), False),
    "int-bounds": (lambda m, x, lo, hi: m.clamp(x, -1, 1), False),
    "tensor-bounds": (lambda m, x, lo, hi: m.clamp(x, lo, hi), True),
    "clip": (lambda m, x, lo, hi: m.clip(x, -1, 1), False),
}


@pytest.mark.parametrize("case", CLAMP_CASES)
@pytest.mark.parametrize("dtype", NUMERIC)
def test_clamp_matches_torch(dtype, case, rng):
    fn, tensor_bounds = CLAMP_CASES[case]
    x = random_array(rng, (3, 4), dtype, -2, 2, avoid=0.5)
    lo = random_array(rng, (3, 1), dtype, -1.5, -0.2) if tensor_bounds else None
    hi = random_array(rng, (4,), dtype, 0.2, 1.5) if tensor_bounds else None
    if dtype == "uint8" and tensor_bounds:
        lo, hi = np.zeros((3, 1), np.uint8), np.full((4,), 1, np.uint8)
    check_against_torch(fn, x, lo, hi)
    if dtype == "float64":
        check_finite_differences(fn, x, lo, hi)


# -- special values: NaN and inf propagate as in torch -------------------------------------------------

SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.0, 1e-30, 100.0]


@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in UNARY if "float32" in op.dtypes])
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_special_values_match_torch(op: Unary, dtype):
    values = [v for v in SPECIAL if not (op.name == "gelu" and v == math.inf)]
    x = np.array(values, dtype=np.float64).astype(ember.dtypes.as_dtype(dtype).np)
    check_against_torch(op.fn, x, grad=False)


@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu_at_infinity_is_its_limit(dtype):
    """gelu(+inf) = +inf and gelu(-inf) = 0 in every float dtype, as torch's float64 computes. (torch's
    vectorised float32/bfloat16 GELU gives NaN at +inf on some CPUs and inf on others.)"""
    x = np.array([math.inf, -math.inf] * 8, dtype=ember.dtypes.as_dtype(dtype).np)
    expected = TORCH.gelu(torch.tensor([math.inf, -math.inf] * 8, dtype=torch.float64)).numpy()
    np.testing.assert_array_equal(ember.gelu(ember.tensor(x)).numpy().astype(np.float64), expected)


SPECIAL_BINARY = [o for o in BINARY if o.name not in ("add-alpha",)]


@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in SPECIAL_BINARY])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_binary_special_values_match_torch(op: Binary, dtype):
    values = np.array(SPECIAL, dtype=np.float64)
    a, b = np.meshgrid(values, values)
    np_dtype = ember.dtypes.as_dtype(dtype).np
    check_against_torch(op.fn, a.ravel().astype(np_dtype), b.ravel().astype(np_dtype), grad=False)


@pytest.mark.parametrize("name, fn", [
    ("relu", lambda m, x: m.relu(x)),
    ("sigmoid", lambda m, x: m.sigmoid(x)),
    ("softplus", lambda m, x: m.softplus(x)),
    ("gelu", lambda m, x: m.gelu(x)),
    ("silu", lambda m, x: m.silu(x)),
    ("clamp", lambda m, x: m.clamp(x, -1, 1)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_activation_gradients_at_special_values(name, fn):
    x = np.array([-1e4, -30.0, -1.0, -1e-3, 1e-3, 1.0, 30.0, 1e4], dtype=np.float32)
    check_against_torch(fn, x)


# -- casts --------------------------------------------------------------------------------------------

CAST_METHODS = {
    "float": lambda m, x: x.float(),
    "double": lambda m, x: x.double(),
    "half": lambda m, x: x.half(),
    "bfloat16": lambda m, x: x.bfloat16(),
    "int": lambda m, x: x.int(),
    "long": lambda m, x: x.long(),
    "bool": lambda m, x: x.bool(),
}


def _cast_source(rng, shape, source: str, target: str) -> np.ndarray:
    """Values that every target dtype holds exactly or converts without undefined behaviour."""
    unsigned = "uint8" in (source, target)
    if source in FLOATS:
        values = rng.uniform(0 if unsigned else -100, 100, size=shape)
        return values.astype(ember.dtypes.as_dtype(source).np)
    return random_array(rng, shape, source, -100, 100)


@pytest.mark.parametrize("target", DTYPES)
@pytest.mark.parametrize("source", DTYPES)
def test_to_dtype_matches_torch(source, target, rng):
    x = _cast_source(rng, (3, 5), source, target)
    check_against_torch(lambda m, t: t.to(getattr(m, target)), x, layout="transposed")


@pytest.mark.parametrize("method", CAST_METHODS)
@pytest.mark.parametrize("source", ["float32", "float16", "int64", "bool"])
def test_cast_methods_match_torch(source, method, rng):
    x = _cast_source(rng, (2, 3), source, "uint8")
    check_against_torch(CAST_METHODS[method], x)


@pytest.mark.parametrize("target", FLOATS + ("int64", "bool"))
@pytest.mark.parametrize("source", FLOATS)
def test_cast_special_values_match_torch(source, target):
    values = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30, 65504.0, 70000.0, 3.4e38, 1e300, 1.0000001]
    if target not in FLOATS:  # converting inf or a value out of the integer's range is undefined behaviour
        largest = 65504.0 if source == "float16" else 1e18  # (float16 rounds 70000 to inf)
        values = [v for v in values if math.isfinite(v) and abs(v) <= largest] + ([math.nan, math.inf]
                                                                                   if target == "bool" else [])
    with np.errstate(over="ignore"):  # the overflow to inf is the point
        x = np.array(values, dtype=np.float64).astype(ember.dtypes.as_dtype(source).np)
    check_against_torch(lambda m, t: t.to(getattr(m, target)), x, grad=False)


def test_cast_gradient_matches_finite_differences(rng):
    check_finite_differences(lambda m, x: (x.float() * 3).double(), random_array(rng, (3,), "float64"),
                             eps=1e-2, rtol=1e-4, atol=1e-5)



def test_constants_keep_the_sign_of_zero_and_their_dtype_whatever_was_made_before():
    """Constants are converted once per value and dtype; -0.0 is not 0.0, and 1 as bool is not 1 as float."""
    x = ember.ones(2)
    assert (1 / (x * 0.0)).tolist() == [math.inf, math.inf]
    assert (1 / (x * -0.0)).tolist() == [-math.inf, -math.inf]
    assert ember.full((1,), 1, dtype=ember.bool).tolist() == [True]
    assert ember.full((1,), 3.3, dtype=ember.bfloat16).item() == float(np.float32(3.296875))
    assert ember.full((1,), 3.3, dtype=ember.float16).item() == float(np.float16(3.3))


@pytest.mark.parametrize("exponent", [2.0, 3.0, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_squares_and_cubes_are_torchs_on_every_special_value(dtype, exponent, rng, device):
    """x ** 2 and x ** 3 are products in the kernels, as torch computes those powers: torch's values exactly, signed
    zeros, infinities, NaN and overflow included (the reference's pow rounds once: to the unit in the last place),
    and no general power's logarithm and exponential in the kernel."""
    special = [-3.5, -0.0, 0.0, 1e-20, -1e13, 7e12, np.inf, -np.inf, np.nan, 1.5, -1.1, 2.0 ** 60]
    x = np.concatenate([np.array(special), rng.standard_normal(40) * 4]).astype(np.float32)
    want = torch.tensor(x).to(getattr(torch, dtype)) ** exponent
    got = ember.tensor(x).to(dtype) ** exponent
    assert got.dtype.name == dtype
    if device == "cuda":
        (source,) = ember.explain.plan(got).sources.values()
        assert "pow" not in source.text.split("@triton.jit")[-1], source.text
    # (bfloat16 to its unit: torch's cpu rounds the square to bfloat16 before it multiplies again, its GPU and ember
    # compute the product in float32 and round once)
    ulp = 2 ** -7 if dtype == "bfloat16" else 0 if device == "cuda" else 2 ** -22
    assert_same(got, want, rtol=ulp, atol=0, what=f"x ** {exponent}")
    np.testing.assert_array_equal(np.signbit(got.float().numpy()), np.signbit(want.float().numpy()))
