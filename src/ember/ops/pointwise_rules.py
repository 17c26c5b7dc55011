"""The pointwise primitives' rules, one `define` each: shape and dtype, VJP, reference implementation and Triton
lowering. The ops that build these primitives (broadcasting, type promotion, scalars) are ember/ops/pointwise.py,
which imports this module once its own names exist.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

from ember import dtypes
from ember.ir import Op
from ember.ir.ops import NOT_DIFFERENTIABLE, cast_rule, define, elementwise, predicate, where_rule
from ember.ops.pointwise import where

# -- the pointwise primitives -------------------------------------------------------------------------
# Each primitive's rules side by side: shape and dtype, VJP (g, inputs, output, attributes -> one gradient
# or None per input), reference implementation (NumPy arrays in, half types widened to float32, and the
# attributes as keywords: only CAST has one), and Triton lowering (an expression of its operands, see
# ember.compiler.targets.triton.Operands). Adding a pointwise primitive means an Op and one `define` here.

def _zero_grad(g, xs, out, a):
    return (None,) * len(xs)


def _pow_vjp(g, xs, out, a):
    x, y = xs
    gx = g * y * x ** (y - 1)
    log_x = where((x == 0) & (y >= 0), 0.0, x.log())
    return gx, g * out * log_x


def _extremum_vjp(greater: bool):
    def vjp(g, xs, out, a):
        x, y = xs
        wins = (x > y) if greater else (x < y)
        share = where(x == y, 0.5, wins.to(g.dtype))
        return g * share, g * (1 - share)
    return vjp


def _np_sign(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        return np.where(np.isnan(a), 0, np.sign(a)).astype(a.dtype)  # torch: sign(NaN) is 0
    return a if a.dtype == np.bool_ else np.sign(a)


def _np_checked(fn):
    """Integer division by zero raises, as torch's does."""
    def run(a, b):
        if a.dtype.kind in "iu" and np.any(b == 0):
            raise ZeroDivisionError("integer division by zero")
        return fn(a, b)
    return run


@_np_checked
def _np_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """True division of floats; C-style division of integers (the quotient rounds toward zero)."""
    if a.dtype.kind == "f":
        return np.true_divide(a, b)
    q = np.floor_divide(a, b)
    return q + ((q * b != a) & ((a < 0) != (b < 0)))


def _triton_cast(t) -> str:
    target, source = t.node.attrs["dtype"], t.node.inputs[0].dtype
    x = t.x
    if t.computed(source) is not source:  # a half value kept in float32: it has its type's rounding
        x = f"({x}).to({t.tl(source)}).to(tl.float32)"
    elif target is dtypes.bfloat16 and t.dtype is not dtypes.float32:
        x = f"({x}).to(tl.float32)"  # torch converts to bfloat16 via float32
    if target is dtypes.bool_:
        return f"{x} != 0"
    text = f"({x}).to({t.tl(target)})"
    computed = t.computed(target)
    return text if computed is target else f"{text}.to({t.tl(computed)})"  # rounded, then computed in float32


def _triton_library(name: str):
    """A helper of ember's Triton library with a float and an int body, on typed operands."""
    return lambda t: f"lib.{name}_{'float' if t.floating else 'int'}({t.typed(t.x)}, {t.typed(t.y)})"


def _triton_extremum(fn: str):
    return lambda t: f"{fn}({t.x}, {t.y}, propagate_nan=tl.PropagateNan.ALL)" if t.floating else f"{fn}({t.x}, {t.y})"


def _define_unary(op: Op, vjp, reference, triton) -> None:
    define(op, shape=elementwise(op), vjp=vjp, reference=reference, triton=triton)


_define_unary(Op.NEG, lambda g, xs, out, a: (-g,), np.negative, lambda t: f"-{t.x}")
_define_unary(Op.ABS, lambda g, xs, out, a: (g * xs[0].sign(),), lambda a: a if a.dtype == np.bool_ else np.abs(a),
              lambda t: t.x if t.dtype is dtypes.bool_ else f"tl.abs({t.x})")
_define_unary(Op.SIGN, _zero_grad, _np_sign, lambda t: t.x if t.dtype is dtypes.bool_ else f"lib.sign({t.x})")
_define_unary(Op.EXP, lambda g, xs, out, a: (g * out,), np.exp, lambda t: f"tl.exp({t.x})")
_define_unary(Op.LOG, lambda g, xs, out, a: (g / xs[0],), np.log, lambda t: f"tl.log({t.x})")
_define_unary(Op.LOG1P, lambda g, xs, out, a: (g / (xs[0] + 1),), np.log1p, lambda t: f"lib.log1p({t.x})")
_define_unary(Op.SQRT, lambda g, xs, out, a: (g / (out * 2),), np.sqrt, lambda t: f"tl.sqrt({t.x})")
_define_unary(Op.RECIPROCAL, lambda g, xs, out, a: (-g * out * out,), np.reciprocal,  # float32 rounded as torch's
              lambda t: f"lib.div_rn(1.0, {t.x})" if t.dtype is dtypes.float32 else f"1.0 / {t.x}")
_define_unary(Op.SIN, lambda g, xs, out, a: (g * xs[0].cos(),), np.sin, lambda t: f"tl.sin({t.x})")
_define_unary(Op.COS, lambda g, xs, out, a: (-g * xs[0].sin(),), np.cos, lambda t: f"tl.cos({t.x})")
_define_unary(Op.TANH, lambda g, xs, out, a: (g * (1 - out * out),), np.tanh,  # bfloat16 results: the SFU's own
              lambda t: f"lib.tanh_approx({t.x})" if t.node.dtype is dtypes.bfloat16 else f"lib.tanh({t.x})")
_define_unary(Op.ERF, lambda g, xs, out, a: (g * (2 / math.sqrt(math.pi)) * (-(xs[0] * xs[0])).exp(),),
              scipy.special.erf, lambda t: f"tl.math.erf({t.x})")
_define_unary(Op.FLOOR, _zero_grad, np.floor, lambda t: f"tl.floor({t.x})")
_define_unary(Op.CEIL, _zero_grad, np.ceil, lambda t: f"tl.ceil({t.x})")
_define_unary(Op.ROUND, _zero_grad, lambda a: np.round(a) if a.dtype.kind == "f" else a,  # half to even
              lambda t: f"lib.rint({t.x}, {'4503599627370496.0' if t.dtype is dtypes.float64 else '8388608.0'})")
define(Op.NOT, shape=predicate(Op.NOT), vjp=NOT_DIFFERENTIABLE, reference=np.logical_not,
       triton=lambda t: f"{t.x} == 0")
define(Op.CAST, shape=cast_rule, reference=lambda a, dtype: a, triton=_triton_cast,
       vjp=lambda g, xs, out, a: (g.to(xs[0].dtype) if xs[0].dtype.is_floating_point else None,))


def _define_binary(op: Op, vjp, reference, triton) -> None:
    define(op, shape=elementwise(op), vjp=vjp, reference=reference, triton=triton)


_define_binary(Op.ADD, lambda g, xs, out, a: (g, g), np.add,  # True + True is True, not a 1-bit 0
               lambda t: f"{t.x} | {t.y}" if t.dtype is dtypes.bool_ else f"{t.x} + {t.y}")
_define_binary(Op.SUB, lambda g, xs, out, a: (g, -g), np.subtract, lambda t: f"{t.x} - {t.y}")
_define_binary(Op.MUL, lambda g, xs, out, a: (g * xs[1], g * xs[0]), np.multiply, lambda t: f"{t.x} * {t.y}")
def _power_of_two(text: str) -> float | None:
    """The literal `text` if it is a power of two whose reciprocal is a normal float32, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    mantissa, exponent = math.frexp(value) if math.isfinite(value) else (0.0, 0)
    return value if mantissa in (0.5, -0.5) and -120 < exponent < 120 else None


def _triton_divide(t) -> str:
    """x / y rounded as torch rounds it. By a power of two, the product with its reciprocal: the same number (the
    scaling is exact), without a division's instructions (a mean's 1/n, a norm's)."""
    if t.dtype is dtypes.float32:
        by = _power_of_two(t.y)
        return f"{t.x} * {1.0 / by!r}" if by is not None else f"lib.div_rn({t.x}, {t.y})"
    return f"{t.x} / {t.y}" if t.floating else f"lib.truncdiv_int({t.x}, {t.y})"


_define_binary(Op.DIV, lambda g, xs, out, a: (g / xs[1], -g * out / xs[1]), _np_div, _triton_divide)
_define_binary(Op.FLOORDIV, _zero_grad, _np_checked(np.floor_divide), _triton_library("floordiv"))
_define_binary(Op.MOD, lambda g, xs, out, a: (g, -g * (xs[0] // xs[1])), _np_checked(np.remainder),
               _triton_library("remainder"))


def _triton_pow(t) -> str:
    """x ** y. A float squared or cubed by a literal exponent is products, as torch's pow kernels special-case
    those powers (a half type's product is taken in float32 and rounded once, where torch rounds each step):
    right for every special value, and a few registers, where the general power's logarithm, exponential,
    reciprocal and selections held beside a GEMM's accumulator tile spill."""
    if t.floating and t.x.isidentifier():
        try:
            exponent = float(t.y)
        except ValueError:
            exponent = None
        if exponent in (2.0, 3.0):
            return " * ".join([t.x] * int(exponent))
    return _triton_library("pow")(t)


_define_binary(Op.POW, _pow_vjp, np.power, _triton_pow)
_define_binary(Op.MAXIMUM, _extremum_vjp(greater=True), np.maximum, _triton_extremum("tl.maximum"))
_define_binary(Op.MINIMUM, _extremum_vjp(greater=False), np.minimum, _triton_extremum("tl.minimum"))
for _op, _np_fn, _symbol in ((Op.EQ, np.equal, "=="), (Op.NE, np.not_equal, "!="), (Op.LT, np.less, "<"),
                             (Op.LE, np.less_equal, "<="), (Op.AND, np.logical_and, "&"),
                             (Op.OR, np.logical_or, "|")):
    define(_op, shape=predicate(_op), vjp=NOT_DIFFERENTIABLE, reference=_np_fn,
           triton=lambda t, symbol=_symbol: f"{t.x} {symbol} {t.y}")
define(Op.WHERE, shape=where_rule, reference=np.where, triton=lambda t: f"tl.where({t.x}, {t.y}, {t.z})",
       vjp=lambda g, xs, out, a: (None, g.masked_fill(~xs[0], 0), g.masked_fill(xs[0], 0)))
