"""Pointwise ops: broadcasting, PyTorch type promotion, Python scalars on either side. The pointwise primitives'
rules (shape, VJP, reference implementation, Triton lowering) are ember/ops/pointwise_rules.py.

Every binary op here broadcasts its operands to one shape and casts them to one
dtype before applying a primitive, so the primitives themselves stay simple.
Activations are compositions of these ops: ember/ops/activations.py.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ember import dtypes
from ember.device import as_device
from ember.dtypes import DType
from ember.errors import (
    DTypeError,
    ShapeError,
    conversion_hint,
    describe,
    device_mismatch,
    operands,
)
from ember.ir import Op
from ember.ops import creation  # a module, not a name: creation imports this one in turn
from ember.tensor import Tensor, apply, expect_tensors, leaf

Scalar = (numbers.Number, np.bool_, np.number)


def broadcast_shapes(*shapes, op: str = "broadcast_shapes") -> tuple[int, ...]:
    """torch.broadcast_shapes: the shape that all `shapes` (tuples, or ints for 1-d) broadcast to;
    `op` names the calling op in the error message."""
    shapes = tuple((s,) if isinstance(s, int) else tuple(s) for s in shapes)
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(-ndim, 0):
        sizes = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(sizes) > 1:
            raise ShapeError(f"{op}: shapes {', '.join(str(tuple(s)) for s in shapes)} cannot be broadcast "
                             f"together (dimension {i}: sizes {sorted(sizes)}); make the sizes equal or 1")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def scalar(value, dtype: DType, device, shape: tuple[int, ...] = ()) -> Tensor:
    """A constant of any shape: one value, no memory."""
    return leaf(Op.CONST, device, shape=shape, dtype=dtype, value=_convert(value, dtype))


def _convert(value, dtype: DType):
    """The value a constant of `dtype` holds: every backend reads the same one. A program's constants
    repeat (0.5, 1, a learning rate), so Python numbers are converted once per dtype."""
    if type(value) not in (int, float):
        return _conversion(value, dtype)
    key = (value, dtype, str(value)[0] == "-")  # -0.0 equals 0.0 but is another constant
    converted = _CONVERTED.get(key)
    if converted is None:
        converted = _conversion(value, dtype)
        if len(_CONVERTED) < 4096:
            _CONVERTED[key] = converted
    return converted


_CONVERTED: dict[tuple, object] = {}


def _conversion(value, dtype: DType):
    if dtype is dtypes.bool_:
        return bool(value)
    if dtype.is_integer:  # out-of-range Python ints wrap around, as torch's conversion does
        bits = 8 * dtype.itemsize
        wrapped = int(value) & ((1 << bits) - 1)
        return wrapped - (1 << bits) if dtype.is_signed and wrapped >= 1 << (bits - 1) else wrapped
    if dtype is dtypes.float64:
        return float(value)
    with np.errstate(over="ignore"):  # too large for the type: infinity, as a cast gives
        return float(np.asarray(float(value), dtype=dtype.np))


HALVES = (dtypes.float16, dtypes.bfloat16)


def _number_in_float32(a, b) -> tuple[Tensor, float] | None:
    """(tensor, number) when one operand is a float16/bfloat16 tensor and the other a Python number that
    the half type does not hold exactly. torch multiplies and divides such a pair in float32, with the
    number rounded to float32 only, and rounds the result once; its other binary ops (add, sub, the
    comparisons, pow, remainder...) round the number to the half type first, as a constant of that type
    does here. Where the half type holds the number exactly, both ways compute the same."""
    t, number = (a, b) if isinstance(a, Tensor) else (b, a)
    if (not isinstance(t, Tensor) or t.dtype not in HALVES or not isinstance(number, (int, float, np.number))
            or isinstance(number, (bool, np.bool_))):
        return None
    if _convert(number, t.dtype) == _convert(number, dtypes.float32):
        return None
    return t, number


def _in_float32(prim: Op, t: Tensor, number) -> Tensor:
    """`prim` of a half tensor and a number, computed in float32 and rounded once to the tensor's type."""
    wide = apply(prim, cast(t, dtypes.float32), scalar(number, dtypes.float32, t.device, t.shape))
    return cast(wide, t.dtype)


def as_tensor(x, like: Tensor | None = None, dtype: DType | None = None) -> Tensor:
    """A Tensor for x; a Python scalar takes `dtype`, or the dtype torch would give it next to `like`."""
    if isinstance(x, Tensor):
        return x
    device = like.device if like is not None else None
    if isinstance(x, Scalar):
        if dtype is None:
            dtype = dtypes.result_type(like, x) if like is not None else dtypes.scalar_dtype(x)
        return scalar(x, dtype, as_device(device))
    return creation.tensor(x, dtype=dtype, device=device)


def converted(op: str, name: str, x, like: Tensor | None = None) -> Tensor:
    """`as_tensor(x, like)` for `op`'s argument `name`: what cannot be converted is refused naming the op."""
    try:
        return as_tensor(x, like=like)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {name} must be an ember Tensor, a number or data that ember.tensor takes "
                      f"(nested lists, an array), got {describe(x)} ({e})") from None


def cast(x: Tensor, dtype: DType) -> Tensor:
    dtype = dtypes.as_dtype(dtype)
    return x if x.dtype is dtype else apply(Op.CAST, x, dtype=dtype)


def _check_devices(op: str, tensors: list[Tensor]) -> None:
    devices = {t.device for t in tensors if t.ndim > 0 or t._node.op is not Op.CONST}
    if len(devices) > 1:
        raise device_mismatch(op, *tensors)


def prepare(op: str, *xs, dtype: DType | None = None) -> list[Tensor]:
    """Broadcast operands (tensors or scalars) to one shape and cast them to `dtype`
    (by default their promoted type)."""
    if len(xs) == 2 and dtype is None:  # the common case, kept cheap: it runs for every binary op
        a, b = xs
        if type(a) is Tensor and type(b) is Tensor:
            if a.shape == b.shape and a.dtype is b.dtype and a.device == b.device:
                return [a, b]
        elif type(a) is Tensor and type(b) in (int, float) and type(b) is not bool and a.ndim:
            common = dtypes.result_type(a, b)
            return [cast(a, common), scalar(b, common, a.device, a.shape)]
    tensors = [x for x in xs if isinstance(x, Tensor)]
    if not tensors:
        raise TypeError(f"{op}: expected at least one ember Tensor operand, got {operands(*xs)}"
                        f"{next((conversion_hint(x) for x in xs if conversion_hint(x)), '')}")
    for x in xs:
        if not isinstance(x, (Tensor, *Scalar)):
            raise unsupported_operand(op, x)
    _check_devices(op, tensors)
    common = dtypes.result_type(*xs) if dtype is None else dtype
    device = next((t.device for t in tensors if t.ndim > 0), tensors[0].device)
    shape = broadcast_shapes(*(t.shape for t in tensors), op=op)
    out = []
    for x in xs:
        if not isinstance(x, Tensor):
            out.append(scalar(x, common, device, shape))
            continue
        t = x if x.device == device else x.to(device)  # a 0-d constant made elsewhere
        out.append(expand_to(cast(t, common), shape))
    return out


def unsupported_operand(op: str, x) -> TypeError:
    return TypeError(f"{op}: unsupported operand {describe(x)}; expected an ember Tensor or a number"
                     f"{conversion_hint(x)}")


def expand_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    if t.shape == shape:
        return t
    if t.ndim < len(shape):
        t = apply(Op.RESHAPE, t, shape=(1,) * (len(shape) - t.ndim) + t.shape)
    return apply(Op.EXPAND, t, shape=shape)


# -- unary ----------------------------------------------------------------------------

def _float_input(op: str, x) -> Tensor:
    """x as a floating-point Tensor; data that `ember.tensor` takes (a list, an array) is converted."""
    x = converted(op, "input", x)
    return x if x.dtype.is_floating_point else cast(x, dtypes.default_float)


def _unary_float(prim: Op):
    def fn(x: Tensor) -> Tensor:
        return apply(prim, _float_input(prim.label, x))
    fn.__name__ = prim.label
    fn.__doc__ = f"Elementwise {prim.label}; integer inputs are computed in the default float dtype."
    return fn


exp = _unary_float(Op.EXP)
log = _unary_float(Op.LOG)
log1p = _unary_float(Op.LOG1P)
sqrt = _unary_float(Op.SQRT)
sin = _unary_float(Op.SIN)
cos = _unary_float(Op.COS)
tanh = _unary_float(Op.TANH)
erf = _unary_float(Op.ERF)
reciprocal = _unary_float(Op.RECIPROCAL)


def rsqrt(x: Tensor) -> Tensor:
    return reciprocal(sqrt(_float_input("rsqrt", x)))


def log2(x: Tensor) -> Tensor:
    return log(_float_input("log2", x)) * (1 / math.log(2))


def exp2(x: Tensor) -> Tensor:
    return exp(_float_input("exp2", x) * math.log(2))


def expm1(x: Tensor) -> Tensor:
    return exp(_float_input("expm1", x)) - 1


def neg(x: Tensor) -> Tensor:
    expect_tensors("neg", input=x)
    if x.dtype is dtypes.bool_:
        raise DTypeError(f"neg: negation of a bool tensor is not supported ({operands(x)}); use ~ or logical_not")
    return apply(Op.NEG, x)


def abs(x: Tensor) -> Tensor:  # noqa: A001 - the PyTorch name
    expect_tensors("abs", input=x)
    return apply(Op.ABS, x)


def sign(x: Tensor) -> Tensor:
    expect_tensors("sign", input=x)
    return apply(Op.SIGN, x)


def _rounding(prim: Op):
    def fn(x: Tensor) -> Tensor:
        expect_tensors(prim.label, input=x)
        return x if not x.dtype.is_floating_point else apply(prim, x)
    fn.__name__ = prim.label
    return fn


floor = _rounding(Op.FLOOR)
ceil = _rounding(Op.CEIL)
_round_even = _rounding(Op.ROUND)


def round(x: Tensor, decimals: int = 0) -> Tensor:  # noqa: A001
    expect_tensors("round", input=x)
    if decimals == 0:
        return _round_even(x)
    work = cast(x, dtypes.compute_dtype(x.dtype)) if x.dtype.is_floating_point else x
    if decimals < 0:  # dividing by 10**k is exact where multiplying by 10**-k is not
        scale = 10.0 ** -decimals
        out = _round_even(work / scale) * scale
    else:
        scale = 10.0 ** decimals
        out = _round_even(work * scale) / scale
    return cast(out, x.dtype) if x.dtype.is_floating_point else out


def trunc(x: Tensor) -> Tensor:
    expect_tensors("trunc", input=x)
    return where(x < 0, ceil(x), floor(x)) if x.dtype.is_floating_point else x


def logical_not(x: Tensor) -> Tensor:
    expect_tensors("logical_not", input=x)
    return apply(Op.NOT, x)


def bitwise_not(x: Tensor) -> Tensor:
    expect_tensors("bitwise_not", input=x)
    if x.dtype is not dtypes.bool_:
        raise DTypeError(f"bitwise_not (~): only bool tensors are supported, got {operands(x)}")
    return logical_not(x)


# -- binary ---------------------------------------------------------------------------

def _binary(prim: Op, name: str):
    def fn(a, b) -> Tensor:
        return apply(prim, *prepare(name, a, b))
    fn.__name__ = name
    return fn


def add(a, b, alpha=1) -> Tensor:
    return _add_or_sub(Op.ADD, "add", a, b, alpha)


def sub(a, b, alpha=1) -> Tensor:
    return _add_or_sub(Op.SUB, "sub", a, b, alpha)


def _add_or_sub(prim: Op, name: str, a, b, alpha) -> Tensor:
    if alpha != 1:
        if isinstance(alpha, (float, np.floating)) and not dtypes.result_type(a, b).is_floating_point:
            raise DTypeError(f"{name}: for integral input tensors, alpha must not be a floating point number "
                             f"({operands(a, b)}, alpha={alpha})")
        if isinstance(b, Scalar):
            b, alpha = b * alpha, 1
    x, y = prepare(name, a, b)
    if prim is Op.SUB and x.dtype is dtypes.bool_:
        raise DTypeError(f"sub: subtraction of bool tensors is not supported ({operands(a, b)}); "
                         "use logical_xor or ^")
    if alpha == 1:
        return apply(prim, x, y)
    if x.dtype in HALVES:  # as torch: alpha rounded to the half type, a + alpha * b in float32, rounded once
        wide = apply(prim, cast(x, dtypes.float32), cast(y, dtypes.float32) * _convert(alpha, x.dtype))
        return cast(wide, x.dtype)
    return apply(prim, x, cast(mul(y, alpha), x.dtype))


def rsub(a, b) -> Tensor:
    return sub(b, a)


def mul(a, b) -> Tensor:
    pair = _number_in_float32(a, b)
    if pair is not None:
        return _in_float32(Op.MUL, *pair)
    return apply(Op.MUL, *prepare("mul", a, b))


maximum = _binary(Op.MAXIMUM, "maximum")
minimum = _binary(Op.MINIMUM, "minimum")
eq = _binary(Op.EQ, "eq")
ne = _binary(Op.NE, "ne")
lt = _binary(Op.LT, "lt")
le = _binary(Op.LE, "le")


def gt(a, b) -> Tensor:
    x, y = prepare("gt", a, b)
    return apply(Op.LT, y, x)


def ge(a, b) -> Tensor:
    x, y = prepare("ge", a, b)
    return apply(Op.LE, y, x)


def div(a, b, rounding_mode: str | None = None) -> Tensor:
    """True division (integers give the default float dtype), or 'trunc' / 'floor' rounding."""
    if rounding_mode == "floor":
        return floor_divide(a, b)
    if rounding_mode is None and isinstance(a, Scalar) and isinstance(b, Tensor):
        # number / tensor is the tensor's reciprocal times the number, as in torch; a half reciprocal is
        # rounded before the product, as torch's two ops do
        inverse = reciprocal(b)
        return _in_float32(Op.MUL, inverse, a) if inverse.dtype in HALVES else mul(inverse, a)
    if rounding_mode is None and isinstance(a, Tensor) and _number_in_float32(a, b):
        return _in_float32(Op.DIV, a, b)
    x, y = prepare("div", a, b)
    if rounding_mode == "trunc":
        return apply(Op.DIV, x, y) if x.dtype.is_integer else trunc(apply(Op.DIV, x, y))
    if rounding_mode is not None:
        raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', not {rounding_mode!r}")
    if not x.dtype.is_floating_point:
        x, y = cast(x, dtypes.default_float), cast(y, dtypes.default_float)
    return apply(Op.DIV, x, y)


true_divide = divide = div


def floor_divide(a, b) -> Tensor:
    if isinstance(a, Tensor) and _number_in_float32(a, b):
        return _in_float32(Op.FLOORDIV, a, b)
    x, y = prepare("floor_divide", a, b)
    if x.dtype is dtypes.bool_:
        raise DTypeError(f"floor_divide: not supported for bool tensors ({operands(a, b)})")
    return apply(Op.FLOORDIV, x, y)


def remainder(a, b) -> Tensor:
    x, y = prepare("remainder", a, b)
    if x.dtype is dtypes.bool_:
        raise DTypeError(f"remainder: not supported for bool tensors ({operands(a, b)})")
    return apply(Op.MOD, x, y)


def fmod(a, b) -> Tensor:
    """C's remainder: the sign of the dividend."""
    x, y = prepare("fmod", a, b)
    if x.dtype.is_floating_point:  # exact: remainder of the magnitudes, with the dividend's sign
        magnitude = apply(Op.MOD, abs(x), abs(y))
        return where(x < 0, -magnitude, magnitude)
    return x - apply(Op.DIV, x, y) * y


def pow(a, b) -> Tensor:  # noqa: A001
    x, y = prepare("pow", a, b)
    if x.dtype.is_integer and isinstance(b, Scalar) and b < 0:
        raise DTypeError(f"pow: integers to negative integer powers are not allowed ({operands(a, b)})")
    if x.dtype is dtypes.bool_:  # computed in int64, returned as bool like torch (0 ** 0 is 1: True)
        return cast(apply(Op.POW, cast(x, dtypes.int64), cast(y, dtypes.int64)), dtypes.bool_)
    if isinstance(b, Scalar) and not isinstance(a, Scalar):
        if b == 2:
            return x * x
        if b == 1:
            return x
        if b == 0.5 and x.dtype.is_floating_point:
            return sqrt(x)
    return apply(Op.POW, x, y)


def logical_and(a, b) -> Tensor:
    return apply(Op.AND, *prepare("logical_and", a, b, dtype=dtypes.bool_))


def logical_or(a, b) -> Tensor:
    return apply(Op.OR, *prepare("logical_or", a, b, dtype=dtypes.bool_))


def logical_xor(a, b) -> Tensor:
    return apply(Op.NE, *prepare("logical_xor", a, b, dtype=dtypes.bool_))


def _bitwise(name: str, logical):
    def fn(a, b) -> Tensor:
        for x in (a, b):
            if (isinstance(x, Tensor) and x.dtype is not dtypes.bool_) or (
                    isinstance(x, Scalar) and not isinstance(x, (bool, np.bool_))):
                raise DTypeError(f"{name}: only bool operands are supported, got {operands(a, b)}")
        return logical(a, b)
    fn.__name__ = name
    return fn


bitwise_and = _bitwise("bitwise_and", logical_and)
bitwise_or = _bitwise("bitwise_or", logical_or)
bitwise_xor = _bitwise("bitwise_xor", logical_xor)


def where(condition, x, y) -> Tensor:
    """Elementwise `x if condition else y`, broadcasting all three; x and y are promoted together."""
    expect_tensors("where", condition=condition)
    if condition.dtype is not dtypes.bool_:
        raise DTypeError(f"where: condition must be bool, got {operands(condition)}")
    for v in (x, y):
        if not isinstance(v, (Tensor, *Scalar)):
            raise unsupported_operand("where", v)
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        x = as_tensor(x, like=condition)
    values = [v for v in (x, y) if isinstance(v, Tensor)]
    common = dtypes.result_type(x, y)
    shape = broadcast_shapes(condition.shape, *(v.shape for v in values), op="where")
    _check_devices("where", [condition, *values])
    c = expand_to(condition, shape)
    a, b = (expand_to(cast(v, common), shape) if isinstance(v, Tensor) else scalar(v, common, condition.device, shape)
            for v in (x, y))  # a number: one constant of the shape, no reshape and expand
    return apply(Op.WHERE, c, a, b)


def masked_fill(x: Tensor, mask: Tensor, value) -> Tensor:
    expect_tensors("masked_fill", input=x, mask=mask)
    if mask.dtype is not dtypes.bool_:
        raise DTypeError(f"masked_fill: mask must be a bool tensor, got {operands(mask)} for input {operands(x)}")
    if isinstance(value, Tensor) and value.ndim != 0:
        raise ShapeError(f"masked_fill: value must be a scalar or 0-d tensor, got shape {value.shape}")
    if isinstance(value, Tensor):
        value = cast(value, x.dtype)
    if not isinstance(value, Tensor):
        value = as_tensor(value, like=x, dtype=x.dtype)
    out = where(mask, value, x)
    if out.shape != x.shape:
        raise ShapeError(f"masked_fill: mask of shape {mask.shape} does not broadcast to {x.shape}")
    return cast(out, x.dtype)


def clamp(x: Tensor, min=None, max=None) -> Tensor:  # noqa: A002
    expect_tensors("clamp", input=x)
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    out = x
    if min is not None:
        out = where(out < min, min, out) if not isinstance(min, Tensor) else maximum(out, min)
    if max is not None:
        out = where(out > max, max, out) if not isinstance(max, Tensor) else minimum(out, max)
    return out


clip = clamp


def lerp(start: Tensor, end, weight) -> Tensor:
    expect_tensors("lerp", input=start)
    return start + (end - start) * weight


def isnan(x: Tensor) -> Tensor:
    expect_tensors("isnan", input=x)
    return x != x


def isinf(x: Tensor) -> Tensor:
    expect_tensors("isinf", input=x)
    if not x.dtype.is_floating_point:
        return ne(x, x)
    return abs(x) == math.inf


def isfinite(x: Tensor) -> Tensor:
    expect_tensors("isfinite", input=x)
    if not x.dtype.is_floating_point:
        return eq(x, x)
    return abs(x) < math.inf


def nan_to_num(x: Tensor, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None) -> Tensor:
    expect_tensors("nan_to_num", input=x)
    if not x.dtype.is_floating_point:
        return x
    big = float(np.finfo(x.dtype.np).max) if x.dtype is not dtypes.bfloat16 else 3.3895313892515355e38
    x = where(isnan(x), nan, x)
    x = where(x == math.inf, big if posinf is None else posinf, x)
    return where(x == -math.inf, -big if neginf is None else neginf, x)


def square(x: Tensor) -> Tensor:
    expect_tensors("square", input=x)
    if x.dtype is dtypes.bool_:  # torch squares as pow(x, 2): bool becomes int64
        x = cast(x, dtypes.int64)
    return x * x


def addcmul(x: Tensor, a: Tensor, b: Tensor, value=1) -> Tensor:
    expect_tensors("addcmul", input=x)
    return x + a * b * value


def addcdiv(x: Tensor, a: Tensor, b: Tensor, value=1) -> Tensor:
    expect_tensors("addcdiv", input=x)
    return x + a / b * value


# the primitives' rules register when this module is imported (they read `where` above)
from ember.ops import pointwise_rules  # noqa: E402,F401
