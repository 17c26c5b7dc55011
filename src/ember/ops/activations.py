"""Activation functions, as in torch.nn.functional: compositions of pointwise ops (ember/ops/pointwise.py), so
they fuse with their neighbours and differentiate through the primitives' VJP rules. The most used (relu, gelu,
silu) are composite ops on float tensors: one node each while a step's graph is built and looked up, their
compositions from compilation on."""

from __future__ import annotations

import math

from ember.autograd import is_grad_enabled
from ember.errors import ShapeError, operands
from ember.ir import Op
from ember.ops.movement import normalize_dim, slice_axis
from ember.ops.pointwise import (
    _float_input,
    abs,
    clamp,
    erf,
    exp,
    expm1,
    log1p,
    minimum,
    reciprocal,
    tanh,
    where,
)
from ember.tensor import Tensor, apply, composite, expect_tensors


def sigmoid(x: Tensor) -> Tensor:
    x = _float_input("sigmoid", x)
    z = exp(-abs(x))  # in (0, 1]: neither branch nor its gradient overflows
    return where(x >= 0, reciprocal(z + 1), z / (z + 1))


def relu(x: Tensor) -> Tensor:
    expect_tensors("relu", input=x)
    if x.dtype.is_floating_point:
        return apply(Op.RELU, x)  # one node until it is compiled
    return _relu(x)


def _relu(x: Tensor) -> Tensor:
    return where(x <= 0, 0, x)  # NaN <= 0 is false: NaN passes through, as in torch


def relu6(x: Tensor) -> Tensor:
    expect_tensors("relu6", input=x)
    return hardtanh(x, 0, 6)


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    expect_tensors("leaky_relu", input=x)
    return where(x > 0, x, x * negative_slope)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU: exact (`x * Φ(x)` through erf) or the tanh approximation, as in PyTorch."""
    x = _float_input("gelu", x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', not {approximate!r}")
    return apply(Op.GELU, x, approximate=approximate)


def _gelu(x: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)
        return x * 0.5 * (tanh(inner) + 1)
    return x * 0.5 * (erf(x * (1 / math.sqrt(2))) + 1)


def silu(x: Tensor) -> Tensor:
    expect_tensors("silu", input=x)
    if x.dtype.is_floating_point:
        return apply(Op.SILU, x)
    return _silu(x)


def _silu(x: Tensor) -> Tensor:
    return x * sigmoid(x)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    x = _float_input("softplus", x)
    scaled = x * beta
    # log1p(exp(z)) overflows for large z, where it equals z anyway
    return where(scaled > threshold, x, log1p(exp(minimum(scaled, threshold))) / beta)


def elu(x: Tensor, alpha: float = 1.0) -> Tensor:
    """x where positive, else alpha * (exp(x) - 1); the gradient at 0 is the exponential side's (alpha), as in
    torch."""
    expect_tensors("elu", input=x)
    negative = where(x > 0, 0, x)  # no overflow in the branch not taken, and the whole gradient at 0
    return where(x > 0, x, expm1(negative) * alpha)


def hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """x clamped to [min_val, max_val]; unlike clamp's, the gradient at a bound itself is 0, as in torch."""
    expect_tensors("hardtanh", input=x)
    if not x.dtype.is_floating_point:  # integers keep their dtype, the bounds truncated to it, as in torch
        min_val, max_val = int(min_val), int(max_val)
    clamped = clamp(x, min_val, max_val)
    if not (x.requires_grad and is_grad_enabled()):
        return clamped  # the values alone: a clamp, which an MLP kernel applies in its operand's conversion
    # the same values, with the gradient through x only strictly inside the bounds
    return where((x > min_val) & (x < max_val), x, clamped.detach())


def mish(x: Tensor) -> Tensor:
    expect_tensors("mish", input=x)
    return x * tanh(softplus(x))


def hardsigmoid(x: Tensor) -> Tensor:
    """(x + 3) / 6 clamped to [0, 1]; as in torch, the gradient is 1/6 strictly inside (-3, 3) and 0 elsewhere,
    the kinks included."""
    x = _float_input("hardsigmoid", x)
    return where(x <= -3, 0, where(x >= 3, 1, (x + 3) / 6))


def hardswish(x: Tensor) -> Tensor:
    """x * hardsigmoid(x). Its gradient follows torch's convention at the kinks: 0 at x = -3 (the flat side's),
    1 at x = 3 (the identity's), x / 3 + 1/2 between."""
    x = _float_input("hardswish", x)
    return where(x <= -3, 0, where(x >= 3, x, x * (x + 3) / 6))


def glu(x: Tensor, dim: int = -1) -> Tensor:
    """The gated linear unit: `a * sigmoid(b)` for the halves a, b of `x` along `dim`, which must be even."""
    x = _float_input("glu", x)
    if x.ndim == 0:
        raise ShapeError("glu: a 0-d tensor has no dimension to halve")
    axis = normalize_dim("glu", dim, x.ndim)
    n = x.shape[axis]
    if n % 2:
        raise ShapeError(f"glu: the halved dimension must be even, but dim {dim} of shape {x.shape} has size {n}")
    return slice_axis(x, axis, 0, n // 2) * sigmoid(slice_axis(x, axis, n // 2, n))


def prelu(x: Tensor, weight: Tensor) -> Tensor:
    """`x` where positive, else `weight * x`: one weight shared by every element, or one per channel (dim 1;
    an input of fewer than 2 dims has one channel). The gradient at 0 is the negative side's, as in torch."""
    expect_tensors("prelu", input=x, weight=weight)
    if weight.ndim > 1:
        raise ShapeError(f"prelu: weight must be a 0-d or 1-d tensor, got shape {weight.shape}")
    channels = x.shape[1] if x.ndim >= 2 else 1
    if weight.numel() == 1:
        slope = weight.reshape(())
    elif weight.numel() == channels:
        slope = weight.reshape((channels,) + (1,) * (x.ndim - 2))
    else:
        raise ShapeError(f"prelu: weight has {weight.numel()} entries, which must be 1 or the input's channel count "
                         f"{channels} ({operands(x, weight)})")
    return where(x > 0, x, slope * x)


def _same(inputs, attrs) -> tuple:
    return inputs[0].shape, inputs[0].dtype


composite(Op.RELU, _same, _relu)
composite(Op.GELU, _same, _gelu)
composite(Op.SILU, _same, _silu)
