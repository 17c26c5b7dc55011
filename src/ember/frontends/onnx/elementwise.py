"""ONNX's elementwise operators (arithmetic, comparisons, logic, activations, casts) as ember ops.

Each function takes the node's context and its input values and returns its output(s). ONNX operands of a
binary op share one type, so ember's promotion never widens them; constants are made in the operand's dtype.
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np
from onnx import TensorProto

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext
from ember.frontends.onnx.values import NARROW, NarrowFloat, NarrowInt, PowerOfTwo, numpy_type
from ember.nn import functional as F
from ember.tensor import Tensor


def _unary(fn):
    return lambda n, x: fn(x)


def _binary(fn):
    return lambda n, a, b: fn(a, b)


def _variadic(fn):
    return lambda n, *xs: reduce(fn, xs)


def _div(n: NodeContext, a, b):
    if a.dtype.is_floating_point:
        return a / b
    return ember.div(a, b, rounding_mode="trunc")


def _mod(n: NodeContext, a, b):
    if n.attr("fmod", 0):
        return ember.fmod(a, b)
    return ember.remainder(a, b)


def _pow(n: NodeContext, a, b):
    if not a.dtype.is_floating_point:
        return ember.pow(a.to(dtypes.float64), b.to(dtypes.float64)).round().to(a.dtype)
    return ember.pow(a, b.to(a.dtype))


def _mean(n: NodeContext, *xs):
    return reduce(lambda a, b: a + b, xs) / n.const(len(xs), xs[0])


def _integer_format(n: NodeContext, x, i: int) -> tuple[int, bool]:
    """(bits, signed) of integer input `i` as the graph declares it (ember may hold it in a wider type)."""
    declared = n.declared_type(i)
    npd = numpy_type(declared) if declared else x.dtype.np
    try:
        info = np.iinfo(npd)
    except ValueError:
        info = np.iinfo(x.dtype.np)
    return info.bits, info.min < 0


def _wrapped(x, bits: int, signed: bool):
    """An int64 tensor's values modulo 2**bits, in the range of a `bits`-wide integer (int64 wraps by itself)."""
    if bits >= 64:
        return x
    low = -(2 ** (bits - 1)) if signed else 0
    return ember.remainder(x - low, ember.full_like(x, 2 ** bits)) + low


def _bit_shift(n: NodeContext, x, shift):
    bits, signed = _integer_format(n, x, 0)
    wide, shift = x.to(dtypes.int64), shift.to(dtypes.int64)
    valid = (shift >= 0) & (shift < bits)
    scale = ember.pow(ember.full_like(wide, 2), ember.where(valid, shift, ember.zeros_like(shift)))
    if n.attr("direction") == "LEFT":
        out = ember.where(valid, _wrapped(wide * scale, bits, signed), ember.zeros_like(wide))
    else:
        beyond = ember.where(wide < 0, ember.full_like(wide, -1), ember.zeros_like(wide))
        out = ember.where(valid, ember.div(wide, scale, rounding_mode="floor"), beyond)
    return out.to(x.dtype)


def _bitwise(combine):
    """An integer bitwise operator, bit by bit (ember's bitwise operators take bools): each operand's bits by
    floor division, combined, weighed back (the top bit of a signed type weighs -2**(bits-1))."""
    def bitwise(n: NodeContext, a, b):
        if a.dtype is dtypes.bool_:
            return combine(a, b)
        bits, signed = _integer_format(n, a, 0)
        wide_a, wide_b = a.to(dtypes.int64), b.to(dtypes.int64)
        out = None
        for k in range(bits):
            weight = -(2 ** k) if signed and k == bits - 1 else 2 ** k
            if k == 63:
                bit_a, bit_b = (wide_a < 0).to(dtypes.int64), (wide_b < 0).to(dtypes.int64)
            else:
                bit_a = ember.remainder(ember.div(wide_a, 2 ** k, rounding_mode="floor"), 2)
                bit_b = ember.remainder(ember.div(wide_b, 2 ** k, rounding_mode="floor"), 2)
            term = _combine_bits(combine, bit_a, bit_b) * weight
            out = term if out is None else out + term
        return out.to(a.dtype)
    return bitwise


def _combine_bits(combine, a, b):
    if combine is ember.bitwise_and:
        return a * b
    if combine is ember.bitwise_or:
        return a + b - a * b
    return a + b - 2 * a * b


def _bitwise_not(n: NodeContext, x):
    if x.dtype is dtypes.bool_:
        return ember.logical_not(x)
    bits, signed = _integer_format(n, x, 0)
    wide = x.to(dtypes.int64)
    return (-wide - 1 if signed else (2 ** bits - 1) - wide).to(x.dtype)


def _clip(n: NodeContext, x, low=None, high=None):
    if n.opset < 11:
        low, high = n.attr("min"), n.attr("max")
        low = None if low is None else n.const(low, x)
        high = None if high is None else n.const(high, x)
    if low is not None:
        x = ember.maximum(x, low)
    if high is not None:
        x = ember.minimum(x, high)
    return x


def _cast(n: NodeContext, x, like=None):
    target = n.attr("to") if like is None else n.declared_type(1)
    dtype = like.dtype if like is not None else n.dtype_of(target)
    narrow = NARROW.get(numpy_type(target)) if target is not None else None
    if isinstance(narrow, NarrowFloat):
        return _round_to_format(x.to(dtypes.float32), narrow, bool(n.attr("saturate", 1))).to(dtype)
    if isinstance(narrow, PowerOfTwo):
        return _round_to_power_of_two(x.to(dtypes.float32), narrow.bias, n.attr("round_mode", "up"),
                                      bool(n.attr("saturate", 1))).to(dtype)
    if isinstance(narrow, NarrowInt):
        x = (ember.round(x) if x.dtype.is_floating_point else x).to(dtypes.int64)
        span = narrow.high - narrow.low + 1  # ONNX's reference wraps around, as an integer of that width does
        return (ember.remainder(x - narrow.low, n.const(span, x)) + narrow.low).to(dtype)
    if x.dtype.is_floating_point and not dtype.is_floating_point and dtype is not dtypes.bool_:
        x = ember.trunc(x)  # ONNX (as C) truncates toward zero; ember's cast of NaN/inf is undefined as theirs
    return x.to(dtype)


def _round_to_power_of_two(x, bias: int, mode: str, saturate: bool):
    """|x| rounded to a power of two 2**(e - bias), e in 0..2*bias, as ONNX rounds float32 to float8e8m0: up or
    down on the float32 exponent, or to nearest (up from 1.5 times the power); NaN and inf give NaN."""
    a = ember.abs(x)
    tiny = 2.0 ** (1 - bias)  # the smallest normal float32; below it the float32 exponent is 0
    exponent = ember.floor(ember.log2(ember.maximum(a, ember.full_like(a, tiny))))
    exponent = ember.where(ember.exp2(exponent + 1) <= a, exponent + 1, exponent)
    normal = a >= tiny
    biased = ember.where(normal, exponent + bias, ember.zeros_like(a))
    power = ember.where(normal, ember.exp2(exponent), ember.zeros_like(a))
    if mode == "up":
        above = a > power
    elif mode == "nearest":
        above = ember.where(normal, a >= power * 1.5, a > 2.0 ** -bias)
    else:
        above = ember.zeros_like(a).to(dtypes.bool_)
    top = 2 * bias
    if saturate:
        above = above & (biased < top)
    biased = biased + above.to(a.dtype)
    special = ember.isnan(x) | ember.isinf(x) | (biased > top)
    return ember.where(special, ember.full_like(a, math.nan), ember.exp2(biased - bias))


def _along(n: NodeContext, param, x):
    """A quantization scale or zero point laid along x: a scalar, one value per position of `axis`, or (with
    block_size) one per block of positions."""
    if param.ndim == 0 or param.numel() == 1 and param.ndim <= 1:
        return param.reshape(())
    axis = n.attr("axis", 1) % x.ndim
    block = n.attr("block_size", 0)
    if block:
        return param.repeat_interleave(block, axis)[tuple(slice(0, size) for size in x.shape)]
    return param.reshape(tuple(-1 if i == axis else 1 for i in range(x.ndim)))


def _dequantize(n: NodeContext, x, scale, zero_point=None):
    scale = _along(n, scale, x)
    centred = x.to(scale.dtype) if zero_point is None else x.to(dtypes.float32) - _along(n, zero_point, x).to(
        dtypes.float32)
    return centred.to(scale.dtype) * scale


def _quantize(n: NodeContext, x, scale, zero_point=None):
    target = n.declared_type(2) if zero_point is not None else None
    target = target or n.attr("output_dtype") or TensorProto.UINT8
    dtype = n.dtype_of(target)
    scaled = x.to(dtypes.float32) / _along(n, scale, x).to(dtypes.float32)
    narrow = NARROW.get(numpy_type(target))
    zero = 0.0 if zero_point is None else _along(n, zero_point, x).to(dtypes.float32)
    if isinstance(narrow, NarrowFloat):
        return _round_to_format(scaled + zero, narrow, bool(n.attr("saturate", 1))).to(dtype)
    low, high = (narrow.low, narrow.high) if narrow else _int_range(numpy_type(target))
    return ember.clamp(ember.round(scaled) + zero, float(low), float(high)).to(dtype)


def _int_range(npd) -> tuple[int, int]:
    info = np.iinfo(npd)
    return int(info.min), int(info.max)


def _round_to_format(x, f: NarrowFloat, saturate: bool):
    """x rounded (to nearest, ties to even) to the values of a narrow float format, in float32: the exponent
    from log2, corrected where log2 rounds across a power of two, fixes the spacing of representable values."""
    a = ember.abs(x)
    exponent = ember.floor(ember.log2(ember.maximum(a, ember.full_like(a, 2.0 ** -126))))
    exponent = ember.where(ember.exp2(exponent + 1) <= a, exponent + 1, exponent)
    spacing = ember.exp2(ember.maximum(exponent, ember.full_like(a, f.min_exponent)) - f.mantissa)
    rounded = ember.round(a / spacing) * spacing
    infinite = ember.isinf(x)
    if saturate:
        rounded = ember.where(rounded > f.largest, ember.full_like(a, f.largest), rounded)
        rounded = ember.where(infinite, ember.full_like(a, f.saturated_infinity), rounded)
    else:
        rounded = ember.where((rounded > f.largest) | infinite, ember.full_like(a, f.overflow), rounded)
    return ember.where(x < 0, -rounded, rounded)


def _where(n: NodeContext, cond, a, b):
    return ember.where(cond, a, b)


def _is_inf(n: NodeContext, x):
    out = ember.isinf(x)
    if not n.attr("detect_negative", 1):
        out = out & (x > 0)
    if not n.attr("detect_positive", 1):
        out = out & (x < 0)
    return out


def _elu(n: NodeContext, x):
    alpha = n.attr("alpha", 1.0)
    return ember.where(x > 0, x, ember.expm1(x) * alpha)


def _selu(n: NodeContext, x):
    alpha, gamma = n.attr("alpha", 1.67326319217681884765625), n.attr("gamma", 1.05070102214813232421875)
    return ember.where(x > 0, x, ember.expm1(x) * alpha) * gamma


def _celu(n: NodeContext, x):
    alpha = n.attr("alpha", 1.0)
    return ember.maximum(x, n.const(0, x)) + ember.minimum(n.const(0, x), ember.expm1(x / alpha) * alpha)


def _leaky_relu(n: NodeContext, x):
    return ember.leaky_relu(x, n.attr("alpha", 0.01))


def _thresholded_relu(n: NodeContext, x):
    return ember.where(x > n.attr("alpha", 1.0), x, n.const(0, x))


def _hard_sigmoid(n: NodeContext, x):
    return ember.clamp(x * n.attr("alpha", 0.2) + n.attr("beta", 0.5), 0.0, 1.0)


def _gelu(n: NodeContext, x):
    return F.gelu(x, approximate=n.attr("approximate", "none"))


def _prelu(n: NodeContext, x, slope):
    return ember.where(x >= 0, x, x * slope)


def _shrink(n: NodeContext, x):
    bias, lambd = n.attr("bias", 0.0), n.attr("lambd", 0.5)
    zero = n.const(0, x)
    return ember.where(x < -lambd, x + n.const(bias, x), ember.where(x > lambd, x - n.const(bias, x), zero))


def _softplus(n: NodeContext, x):
    return ember.log1p(ember.exp(-ember.abs(x))) + ember.maximum(x, n.const(0, x))


def _swish(n: NodeContext, x):
    return x * ember.sigmoid(x * n.attr("alpha", 1.0))


def _atan(x: Tensor) -> Tensor:
    """arctan by range reduction to [0, tan(pi/12)] and a Taylor polynomial there (error below 1e-8):
    ember has no arctan primitive."""
    sign = ember.sign(x)
    a = ember.abs(x)
    inverted = a > 1
    a = ember.where(inverted, 1 / ember.maximum(a, ember.full_like(a, 1e-30)), a)
    t = math.tan(math.pi / 12)
    shifted = a > t
    a = ember.where(shifted, (a - t) / (1 + a * t), a)
    a2 = a * a
    series = a * (1 - a2 * (1 / 3 - a2 * (1 / 5 - a2 * (1 / 7 - a2 * (1 / 9 - a2 * (1 / 11 - a2 / 13))))))
    series = ember.where(shifted, series + math.pi / 12, series)
    series = ember.where(inverted, math.pi / 2 - series, series)
    return sign * series


def _asin(x: Tensor) -> Tensor:
    return _atan2(x, ember.sqrt(1 - x * x))


def _atan2(y: Tensor, x: Tensor) -> Tensor:
    """atan2 for x >= 0 (what asin and acos need)."""
    safe = ember.where(x == 0, ember.ones_like(x), x)
    return ember.where(x == 0, ember.sign(y) * (math.pi / 2), _atan(y / safe))


_UNARY = {
    "Abs": ember.abs, "Neg": ember.neg, "Exp": ember.exp, "Log": ember.log, "Sqrt": ember.sqrt,
    "Reciprocal": ember.reciprocal, "Sin": ember.sin, "Cos": ember.cos, "Tanh": ember.tanh, "Sigmoid": ember.sigmoid,
    "Floor": ember.floor, "Ceil": ember.ceil, "Round": ember.round, "Sign": ember.sign, "Erf": ember.erf,
    "Not": ember.logical_not, "IsNaN": ember.isnan,
    "Relu": ember.relu,
    "Tan": lambda x: ember.sin(x) / ember.cos(x),
    "Sinh": lambda x: (ember.exp(x) - ember.exp(-x)) / 2, "Cosh": lambda x: (ember.exp(x) + ember.exp(-x)) / 2,
    "Asinh": lambda x: ember.log(x + ember.sqrt(x * x + 1)), "Acosh": lambda x: ember.log(x + ember.sqrt(x * x - 1)),
    "Atanh": lambda x: ember.log((1 + x) / (1 - x)) / 2, "Atan": _atan, "Asin": _asin,
    "Acos": lambda x: math.pi / 2 - _asin(x),
    "Softsign": lambda x: x / (1 + ember.abs(x)), "Mish": lambda x: x * ember.tanh(F.softplus(x)),
    "Identity": lambda x: x,
}

_BINARY = {
    "Add": ember.add, "Sub": ember.sub, "Mul": ember.mul, "Equal": ember.eq, "Greater": ember.gt,
    "Less": ember.lt, "GreaterOrEqual": ember.ge, "LessOrEqual": ember.le, "And": ember.logical_and,
    "Or": ember.logical_or, "Xor": ember.logical_xor,
}

OPS = {
    **{name: _unary(fn) for name, fn in _UNARY.items()},
    **{name: _binary(fn) for name, fn in _BINARY.items()},
    "Max": _variadic(ember.maximum), "Min": _variadic(ember.minimum), "Sum": _variadic(ember.add), "Mean": _mean,
    "Div": _div, "Mod": _mod, "Pow": _pow, "BitShift": _bit_shift, "Clip": _clip, "Cast": _cast,
    "CastLike": _cast, "Where": _where, "IsInf": _is_inf, "Elu": _elu, "Selu": _selu, "Celu": _celu,
    "LeakyRelu": _leaky_relu, "ThresholdedRelu": _thresholded_relu, "HardSigmoid": _hard_sigmoid,
    "HardSwish": lambda n, x: F.hardswish(x), "Gelu": _gelu, "PRelu": _prelu, "Shrink": _shrink, "Softplus": _softplus,
    "Swish": _swish, "BitwiseAnd": _bitwise(ember.bitwise_and), "BitwiseOr": _bitwise(ember.bitwise_or),
    "BitwiseXor": _bitwise(ember.bitwise_xor), "BitwiseNot": _bitwise_not,
    "QuantizeLinear": _quantize, "DequantizeLinear": _dequantize,
}
