"""Activation functions, as in torch.nn.functional: compositions of pointwise ops (ember/ops/pointwise.py), so
they fuse with their neighbours and differentiate through the primitives' VJP rules. The most used (relu, gelu,
silu) are composite ops on float tensors: one node each while a step's graph is built and looked up, their
compositions from compilation on."""

from __future__ import annotations

import math

from ember.autograd import is_grad_enabled
from ember.ir import Op
from ember.ops.pointwise import (
    _float_input,
    abs,
    clamp,
    erf,
    exp,
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
    expect_tensors("elu", input=x)
    return where(x > 0, x, (exp(minimum(x, 0)) - 1) * alpha)


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


def _same(inputs, attrs) -> tuple:
    return inputs[0].shape, inputs[0].dtype


composite(Op.RELU, _same, _relu)
composite(Op.GELU, _same, _gelu)
composite(Op.SILU, _same, _silu)
