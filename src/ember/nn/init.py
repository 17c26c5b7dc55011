"""Parameter initialisation, with torch.nn.init's names, formulas and defaults.

Each function fills its tensor in place (lazily: the values are drawn from ember's
counter-based generator when the tensor is first computed) outside autograd, and
returns it.
"""

from __future__ import annotations

import math
import warnings

from ember import dtypes
from ember.autograd import no_grad
from ember.errors import ShapeError
from ember.ops.pointwise import cast, clamp, log, sqrt, where
from ember.tensor import Tensor


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for an activation, as torch.nn.init.calculate_gain."""
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d", "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, (int, float)) and not isinstance(param, bool):
            slope = param
        else:
            raise ValueError(f"calculate_gain: negative_slope {param!r} is not a valid number")
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    if tensor.ndim < 2:
        raise ShapeError(f"fan in and fan out cannot be computed for a tensor with fewer than 2 dims "
                         f"(shape {tensor.shape})")
    receptive = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _fan(tensor: Tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out', not {mode!r}")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    with no_grad():
        return tensor.uniform_(a, b)


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    with no_grad():
        return tensor.normal_(mean, std)


# Giles' single-precision erf⁻¹ ("Approximating the erfinv function", GPU Computing Gems, 2010): a polynomial in
# w = -log(1 - x²) - 2.5 for w < 5, else in sqrt(w) - 3, times x; highest power first
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                   -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                0.00943887047, 1.00167406, 2.83297682)
_BELOW_ONE = 1 - 2.0**-24  # the float32 nearest 1 from below: erf⁻¹ of it is finite (about 3.83)


def _polynomial(coefficients: tuple[float, ...], w: Tensor) -> Tensor:
    p = coefficients[0]
    for c in coefficients[1:]:
        p = p * w + c
    return p


def _erfinv(x: Tensor) -> Tensor:
    """erf⁻¹(x) for x in (-1, 1), to float32 precision (ember has no erfinv primitive; it is needed here only)."""
    x = clamp(x, -_BELOW_ONE, _BELOW_ONE)
    w = -log((1 - x) * (1 + x))
    return where(w < 5, _polynomial(_ERFINV_CENTRAL, w - 2.5), _polynomial(_ERFINV_TAIL, sqrt(w) - 3)) * x


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator: None = None) -> Tensor:
    """Normal(mean, std) values truncated to [a, b], as torch draws them: uniform values between the normal CDF's
    values at a and b, mapped back through the inverse CDF. ember draws from one counter-based stream per thread
    (`ember.manual_seed`), so `generator` must be None."""
    if generator is not None:
        raise ValueError("trunc_normal_: ember has no Generator objects; seed its random stream with "
                         "ember.manual_seed and leave generator=None")
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn("mean is more than 2 std from [a, b] in nn.init.trunc_normal_. The distribution of values may "
                      "be incorrect.", stacklevel=2)

    def cdf(x: float) -> float:  # of the standard normal
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    low, high = cdf((a - mean) / std), cdf((b - mean) / std)
    with no_grad():
        uniform_(tensor, 2 * low - 1, 2 * high - 1)
        x = cast(tensor, dtypes.compute_dtype(tensor.dtype))  # half types: erf⁻¹ in float32
        return tensor.copy_(clamp(_erfinv(x) * (std * math.sqrt(2.0)) + mean, a, b))


def constant_(tensor: Tensor, val: float) -> Tensor:
    with no_grad():
        return tensor.fill_(val)


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)))


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu") -> Tensor:
    if 0 in tensor.shape:
        return tensor
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu") -> Tensor:
    if 0 in tensor.shape:
        return tensor
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)))
