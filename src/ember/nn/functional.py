"""ember.nn.functional: activations, layers as functions, normalisation and losses.

Import as `F`, as with torch.nn.functional. Most entries are ember's ops under their
torch.nn.functional names and signatures; the normalisations are written here as
compositions of ops, so they fuse and differentiate like any other graph. The losses
live in loss_functions.py and `interpolate` in resampling.py; both are exported here.
The deprecated `size_average` / `reduce` arguments of the losses are not accepted;
use `reduction`.
"""

from __future__ import annotations

import math
import warnings
import weakref

import numpy as np

from ember import amp, dtypes
from ember.autograd import composite_vjp, enable_grad, grad, no_grad
from ember.errors import DTypeError, ShapeError
from ember.ir import Op
from ember.ir.ops import define_composite
from ember.nn.attention import scaled_dot_product_attention
from ember.nn.checks import check_float, opmath
from ember.nn.embedding_bag import embedding_bag
from ember.nn.loss_functions import (
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    cross_entropy,
    huber_loss,
    kl_div,
    l1_loss,
    mse_loss,
    nll_loss,
    smooth_l1_loss,
)
from ember.nn.resampling import interpolate
from ember.ops import (
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool2d,
    adaptive_max_pool3d,
    avg_pool2d,
    avg_pool3d,
    conv2d,
    conv3d,
    conv_transpose2d,
    conv_transpose3d,
    gelu,
    linear,
    max_pool2d,
    max_pool3d,
    mish,
    one_hot,
    sigmoid,
    softplus,
    tanh,
)
from ember.ops import dropout as _dropout
from ember.ops import elu as _elu
from ember.ops import embedding as _embedding
from ember.ops import hardtanh as _hardtanh
from ember.ops import leaky_relu as _leaky_relu
from ember.ops import log_softmax as _log_softmax
from ember.ops import pad as _pad
from ember.ops import relu as _relu
from ember.ops import silu as _silu
from ember.ops import softmax as _softmax
from ember.ops.activations import glu, prelu
from ember.ops.activations import hardsigmoid as _hardsigmoid
from ember.ops.activations import hardswish as _hardswish
from ember.ops.movement import normalize_dim, pixel_shuffle, pixel_unshuffle
from ember.ops.pointwise import cast, converted, where
from ember.ops.pooling import fold, max_unpool2d, unfold
from ember.ops.random import rand
from ember.ops.reduce import cosine_similarity, norm
from ember.runtime.executor import realize_with_next
from ember.tensor import Tensor, apply, composite, expect_tensors, realize

__all__ = [
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "batch_norm", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d",
    "cosine_similarity",
    "cross_entropy", "dropout", "dropout2d", "elu", "embedding", "embedding_bag", "fold", "gelu", "glu", "group_norm",
    "hardsigmoid", "hardswish", "hardtanh", "huber_loss", "instance_norm", "interpolate", "kl_div", "l1_loss",
    "layer_norm", "leaky_relu", "linear", "log_softmax", "logsigmoid", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_unpool1d", "max_unpool2d", "mish", "mse_loss", "nll_loss", "normalize", "one_hot", "pad", "pixel_shuffle",
    "pixel_unshuffle", "prelu", "relu", "relu6", "rms_norm", "scaled_dot_product_attention", "sigmoid", "silu",
    "smooth_l1_loss", "softmax", "softplus", "stochastic_depth", "tanh", "unfold",
]


# -- activations and layers with torch.nn.functional's signatures -----------------------

def _maybe_inplace(x: Tensor, out: Tensor, inplace: bool) -> Tensor:
    return x.assign(out) if inplace else out


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _relu(input), inplace)


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _hardtanh(input, 0.0, 6.0), inplace)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _leaky_relu(input, negative_slope), inplace)


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _elu(input, alpha), inplace)


def silu(input: Tensor, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _silu(input), inplace)


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _hardtanh(input, min_val, max_val), inplace)


def logsigmoid(input: Tensor) -> Tensor:
    return -softplus(-converted("logsigmoid", "input", input))


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _dropout(input, p, training), inplace)


def _softmax_dim(name: str, dim: int | None, ndim: int) -> int:
    if dim is not None:
        return dim
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. "
                  "Change the call to include dim=X as an argument.", stacklevel=3)
    return 0 if ndim in (0, 1, 3) else 1


def softmax(input: Tensor, dim: int | None = None, dtype=None) -> Tensor:
    expect_tensors("softmax", input=input)
    return _softmax(input, _softmax_dim("softmax", dim, input.ndim), dtype=dtype)


def log_softmax(input: Tensor, dim: int | None = None, dtype=None) -> Tensor:
    expect_tensors("log_softmax", input=input)
    return _log_softmax(input, _softmax_dim("log_softmax", dim, input.ndim), dtype=dtype)


def embedding(input: Tensor, weight: Tensor, padding_idx: int | None = None, max_norm: float | None = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError("embedding: max_norm, scale_grad_by_freq and sparse are not supported")
    return _embedding(input, weight, padding_idx)


def pad(input: Tensor, pad: list[int], mode: str = "constant", value: float | None = None) -> Tensor:
    return _pad(input, pad, mode, 0.0 if value is None else value)


# -- normalisation --------------------------------------------------------------------

def _variance(x: Tensor, mean: Tensor, axes: tuple[int, ...]) -> Tensor:
    """The biased variance about `mean`, differentiated as a function of `x` alone.

    The variance's derivative through the mean is a sum of the deviations, zero exactly; leaving
    it out keeps a normalisation's backward at two passes over its input (the sums of the output
    gradient and of its product with the deviations, in one pass, then the input gradient), as
    PyTorch's fused formula, instead of a third reduction of values that cancel.
    """
    deviation = x - mean.detach()
    return (deviation * deviation).mean(axes, keepdim=True)


@amp.autocast_op("layer_norm")
def layer_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Normalise over the trailing `normalized_shape` dims (biased variance), then scale and shift."""
    check_float("layer_norm", input)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(shape)
    if k == 0 or input.shape[input.ndim - k:] != shape:
        raise ShapeError(f"layer_norm: input of shape {input.shape} does not end in normalized_shape {shape}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            expect_tensors("layer_norm", **{name: t})
        if t is not None and t.shape != shape:
            raise ShapeError(f"layer_norm: {name} of shape {t.shape} must have normalized_shape {shape}")
    if all(t is None or t.dtype is input.dtype or (t.dtype is dtypes.float32 and input.dtype.itemsize < 4)
           for t in (weight, bias)):  # the result has the input's dtype: one node until it is compiled
        return apply(Op.LAYER_NORM, input, *(t for t in (weight, bias) if t is not None), dims=k, eps=eps,
                     weight=weight is not None, bias=bias is not None)
    return _layer_norm(input, weight, bias, k, eps)


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """Divide by the root mean square over the trailing `normalized_shape` dims (plus `eps`, by default the machine
    epsilon of the dtype it is computed in: float32 for half-precision inputs), then scale by `weight`."""
    check_float("rms_norm", input)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or input.shape[input.ndim - len(shape):] != shape:
        raise ShapeError(f"rms_norm: input of shape {input.shape} does not end in normalized_shape {shape}")
    if weight is not None:
        expect_tensors("rms_norm", weight=weight)
        if weight.shape != shape:
            raise ShapeError(f"rms_norm: weight of shape {weight.shape} must have normalized_shape {shape}")
    x = opmath(input)
    eps = eps if eps is not None else float(np.finfo(x.dtype.np).eps)
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    out = cast(x * ((x * x).mean(axes, keepdim=True) + eps).rsqrt(), input.dtype)
    return out * weight if weight is not None else out


def _layer_norm(input: Tensor, weight: Tensor | None, bias: Tensor | None, dims: int, eps: float) -> Tensor:
    x = opmath(input)
    axes = tuple(range(input.ndim - dims, input.ndim))
    mean = x.mean(axes, keepdim=True)
    centred = x - mean
    var = _variance(x, mean, axes)
    if any(t is not None and t.dtype is x.dtype is not input.dtype for t in (weight, bias)):
        # half-precision input with float32 parameters (mixed precision), as PyTorch: scaled and shifted in
        # float32, the output rounded once to the input's dtype
        out = centred * (var + eps).rsqrt()
        out = out * cast(weight, x.dtype) if weight is not None else out
        out = out + cast(bias, x.dtype) if bias is not None else out
        return cast(out, input.dtype)
    out = cast(centred * (var + eps).rsqrt(), input.dtype)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def _layer_norm_composite(input: Tensor, *params: Tensor, dims: int, eps: float, weight: bool, bias: bool) -> Tensor:
    given = iter(params)
    return _layer_norm(input, next(given) if weight else None, next(given) if bias else None, dims, eps)


composite(Op.LAYER_NORM, lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype), _layer_norm_composite)


# The batch statistics that pending running-stat updates read, by id of the running_mean they
# feed (Tensors compare elementwise, so they cannot be keys of a WeakKeyDictionary).
_pending_batch_stats: dict[int, tuple[weakref.ref, list[Tensor]]] = {}


def _pending_stats(running_mean: Tensor) -> list[Tensor]:
    entry = _pending_batch_stats.get(id(running_mean))
    return entry[1] if entry is not None and entry[0]() is running_mean else []


def _settle_running_stats(running_mean: Tensor, *others: Tensor) -> None:
    """Compute the previous update of running statistics once the batch statistics it reads exist.

    The update is lazy: it reads the batch mean and variance, which the realize that
    computes the forward pass stores because they are held (see `_update_running_stats`).
    Computing it then costs a few elements and cuts its link to the old graph, so
    neither the chain of updates nor the forward graphs behind them grow over steps.
    """
    if all(s._node.realized for s in _pending_stats(running_mean)):
        realize(running_mean, *others)


def _with_the_step(*buffers: Tensor | None) -> None:
    """Compute these pending buffer updates with the next realization (the optimizer step's, usually),
    in its one plan, rather than each in a realization of its own when the next forward pass settles it."""
    for t in buffers:
        if t is not None:
            realize_with_next(t._node)


def _update_running_stats(running_mean: Tensor | None, running_var: Tensor | None, mean: Tensor, var: Tensor,
                          count: int, momentum) -> None:
    """Fold a batch's statistics into the running estimates, outside autograd (unbiased variance).

    `mean` and `var` must be the very tensors the forward pass uses, so that holding
    them makes the realize of the forward pass store them. The update runs in their
    dtype (float32 for half-precision input) and is rounded once, as PyTorch's.
    """
    if running_mean is None and running_var is None:
        return
    key = running_mean if running_mean is not None else running_var
    _settle_running_stats(*(t for t in (running_mean, running_var) if t is not None))
    mean, var = mean.detach(), var.detach()
    with no_grad():
        if running_mean is not None:
            running_mean.assign(_moved(running_mean, mean.reshape(running_mean.shape), momentum))
        if running_var is not None:
            running_var.assign(_moved(running_var, var.reshape(running_var.shape) * (count / (count - 1)), momentum))
    _with_the_step(running_mean, running_var)
    still_pending = [s for s in _pending_stats(key) if not s._node.realized]
    for stale in [k for k, (ref, _) in list(_pending_batch_stats.items()) if ref() is None]:  # (threads add too)
        _pending_batch_stats.pop(stale, None)
    _pending_batch_stats[id(key)] = (weakref.ref(key), [*still_pending, mean, var])


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
               momentum=0.1, eps: float = 1e-5) -> Tensor:
    """Normalise each channel (dim 1) over the batch and spatial dims.

    In training the batch's statistics are used and, when given, the running
    estimates are updated in place (lazily, outside autograd); otherwise the running
    estimates are used. `momentum` may be a float or a 0-d Tensor.

    As in PyTorch, the statistics, weight and bias have the input's dtype, or float32 for
    float16 and bfloat16 input (mixed precision); the output has the input's dtype.
    """
    check_float("batch_norm", input)
    if input.ndim < 2:
        raise ShapeError(f"batch_norm: expected input of shape (N, C, ...), got {input.shape}")
    c = input.shape[1]
    wide = dtypes.float32 if input.dtype in (dtypes.float16, dtypes.bfloat16) else input.dtype  # see opmath
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        if t is None:
            continue
        expect_tensors("batch_norm", **{name: t})
        if t.shape != (c,):
            raise ShapeError(f"batch_norm: {name} of shape {t.shape} must have shape ({c},) for input {input.shape}")
        if t.dtype is not input.dtype and t.dtype is not wide:
            allowed = input.dtype.name if wide is input.dtype else f"{input.dtype.name} or {wide.name}"
            raise DTypeError(f"batch_norm: {name} of dtype {t.dtype.name} does not go with input of dtype "
                             f"{input.dtype.name}; give it dtype {allowed}")
    count = input.numel() // c if c else 0
    if training and count <= 1:
        raise ValueError(f"batch_norm: expected more than 1 value per channel when training, "
                         f"got input of shape {input.shape}")
    if training and running_mean is not None and running_var is not None and type(momentum) in (int, float):
        # one node per result (the output, the two running statistics) until it is compiled
        settings = dict(momentum=float(momentum), eps=eps, count=count, weight=weight is not None,
                        bias=bias is not None)
        given = (input, running_mean, running_var, *(t for t in (weight, bias) if t is not None))
        out = apply(Op.BATCH_NORM, *given, result=0, **settings)
        with no_grad():
            running_mean.assign(apply(Op.BATCH_NORM, *given, result=1, **settings))
            running_var.assign(apply(Op.BATCH_NORM, *given, result=2, **settings))
        _with_the_step(running_mean, running_var)
        return out
    x = opmath(input)
    if training:
        mean, centred, var = _batch_statistics(x)
        _update_running_stats(running_mean, running_var, mean, var, count, momentum)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: running_mean and running_var are required when training=False")
        stat_shape = (1, c) + (1,) * (input.ndim - 2)
        centred = x - cast(running_mean, x.dtype).reshape(stat_shape)
        var = cast(running_var, x.dtype).reshape(stat_shape)
    return _normalized(input, centred, var, weight, bias, eps)


def _batch_statistics(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per channel (dim 1): the batch's mean, x minus it, and the biased variance, kept as (1, C, 1...)."""
    axes = (0, *range(2, x.ndim))
    mean = x.mean(axes, keepdim=True)
    return mean, x - mean, _variance(x, mean, axes)


def _normalized(input: Tensor, centred: Tensor, var: Tensor, weight: Tensor | None, bias: Tensor | None,
                eps: float) -> Tensor:
    """The centred values over the standard deviation, scaled and shifted per channel before the output is rounded
    to the input's dtype."""
    return _scaled_per_channel(input, centred * (var + eps).rsqrt(), weight, bias)


def _scaled_per_channel(input: Tensor, out: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """Normalised values `out` (in the dtype statistics are computed in) scaled and shifted per channel (dim 1),
    then rounded once to the input's dtype."""
    stat_shape = (1, input.shape[1]) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * cast(weight, out.dtype).reshape(stat_shape)
    if bias is not None:
        out = out + cast(bias, out.dtype).reshape(stat_shape)
    return cast(out, input.dtype)


def _moved(running: Tensor, batch: Tensor, momentum) -> Tensor:
    """A running statistic moved toward the batch's by `momentum`, in the batch statistic's dtype."""
    return cast(running, batch.dtype) * (1 - momentum) + batch * momentum


def _batch_norm_results(input: Tensor, running_mean: Tensor, running_var: Tensor, *params: Tensor, momentum: float,
                        eps: float, count: int, weight: bool, bias: bool, result: int | None = None) -> list[Tensor]:
    """batch_norm in training with running statistics, in primitives: [its output, the new running mean, the new
    running variance], as batch_norm and _update_running_stats compute them."""
    given = iter(params)
    weight, bias = next(given) if weight else None, next(given) if bias else None
    x = opmath(input)
    mean, centred, var = _batch_statistics(x)
    c = input.shape[1]
    new_mean = _moved(running_mean, mean.detach().reshape((c,)), momentum)
    new_var = _moved(running_var, var.detach().reshape((c,)) * (count / (count - 1)), momentum)
    return [_normalized(input, centred, var, weight, bias, eps), cast(new_mean, running_mean.dtype),
            cast(new_var, running_var.dtype)]


def _batch_norm_shape(inputs, attrs) -> tuple:
    made = inputs[attrs["result"]]  # the input, or the running statistic, each result has the shape of
    return made.shape, made.dtype


def _batch_norm_expansion(inputs, attrs) -> list:
    with no_grad():
        return [t._node for t in _batch_norm_results(*(Tensor(n) for n in inputs), **attrs)]


def _batch_norm_vjp(g: Tensor, xs: list[Tensor], out: Tensor, attrs: dict) -> tuple:
    """The output's gradient (the running statistics have none), by the primitives' VJP rules."""
    inputs = [x.detach().requires_grad_(k not in (1, 2)) for k, x in enumerate(xs)]
    with enable_grad():
        value = _batch_norm_results(*inputs, **attrs)[0]
    wanted = [x for x in inputs if x.requires_grad]
    grads = iter(grad(value, wanted, g, allow_unused=True))
    return tuple(next(grads) if x.requires_grad else None for x in inputs)


def _batch_norm_result(attrs) -> tuple:
    return tuple((k, v) for k, v in attrs.items() if k != "result"), attrs["result"]


define_composite(Op.BATCH_NORM, shape=_batch_norm_shape, vjp=composite_vjp(_batch_norm_vjp),
                 expand=_batch_norm_expansion, result=_batch_norm_result)


# -- group and instance normalisation -------------------------------------------------------
# Both normalise rows of the input viewed as (N, G, -1): G groups of channels for group_norm, each channel for
# instance_norm. Row statistics are what the compiler fuses into row kernels.

def _row_normalized(input: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The input normalised over rows of (N, groups, -1), scaled and shifted per channel (dim 1) in float32 for
    half-precision input and rounded once; with each row's mean and biased variance, shaped (N, groups, 1)."""
    x = opmath(input)
    n, c = input.shape[:2]
    rows = x.reshape((n, groups, (c // groups) * math.prod(input.shape[2:])))
    mean = rows.mean(2, keepdim=True)
    var = _variance(rows, mean, (2,))
    out = ((rows - mean) * (var + eps).rsqrt()).reshape(input.shape)
    return _scaled_per_channel(input, out, weight, bias), mean, var


def _check_channel_vectors(fn: str, input: Tensor, **vectors: Tensor | None) -> None:
    c = input.shape[1]
    for name, t in vectors.items():
        if t is not None:
            expect_tensors(fn, **{name: t})
            if t.shape != (c,):
                raise ShapeError(f"{fn}: {name} of shape {t.shape} must have shape ({c},) for input {input.shape}")


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Normalise each group of `num_groups` consecutive channel groups over its channels and spatial dims (biased
    variance), then scale and shift per channel, as torch.nn.functional.group_norm."""
    check_float("group_norm", input)
    if input.ndim < 2:
        raise ShapeError(f"group_norm: expected input of shape (N, C, ...), got {input.shape}")
    c = input.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise ShapeError(f"group_norm: the {c} channels of input {input.shape} must be divisible by "
                         f"num_groups={num_groups}")
    if input.shape[0] * (c // num_groups) * math.prod(input.shape[2:]) == 1:
        raise ValueError(f"group_norm: expected more than 1 value per group when training, got input of shape "
                         f"{input.shape}")
    _check_channel_vectors("group_norm", input, weight=weight, bias=bias)
    return _row_normalized(input, num_groups, weight, bias, eps)[0]


def instance_norm(input: Tensor, running_mean: Tensor | None = None, running_var: Tensor | None = None,
                  weight: Tensor | None = None, bias: Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Normalise each channel of each sample over its spatial dims, as torch.nn.functional.instance_norm.

    With `use_input_stats` the sample's statistics are used and, when given, the running estimates move toward
    their mean over the batch (the variance unbiased, lazily, outside autograd); otherwise the running estimates
    are used, as batch_norm's in eval."""
    check_float("instance_norm", input)
    if input.ndim < 3:
        raise ShapeError(f"instance_norm: expected input of shape (N, C, ...) with spatial dims, got {input.shape}")
    _check_channel_vectors("instance_norm", input, running_mean=running_mean, running_var=running_var,
                           weight=weight, bias=bias)
    if not use_input_stats:
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    count = math.prod(input.shape[2:])
    if count <= 1:
        raise ValueError(f"instance_norm: expected more than 1 spatial element when training, got input of shape "
                         f"{input.shape}")
    out, mean, var = _row_normalized(input, input.shape[1], weight, bias, eps)
    _update_running_stats(running_mean, running_var, mean.mean(0), var.mean(0), count, momentum)
    return out


# -- 1-d convolution and pooling ------------------------------------------------------------
# Each is its 2-d counterpart over the input with a height-1 axis inserted before the last (the kernel, stride,
# padding and dilation of that axis are 1, 1, 0 and 1), so they share its kernels and gradients.

def _single(fn: str, name: str, v) -> int:
    """An int, or a 1-tuple of one (torch's form for 1-d layers)."""
    one = v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v
    if not isinstance(one, int):
        raise ValueError(f"{fn}: {name} must be an int or a 1-tuple of one, got {v!r}")
    return one


def _with_height(fn: str, input: Tensor) -> Tensor:
    """(N, C, L) or (C, L) input as (N, C, 1, L) or (C, 1, L)."""
    expect_tensors(fn, input=input)
    if input.ndim not in (2, 3):
        raise ShapeError(f"{fn}: expects input (N, C, L) or (C, L), got shape {input.shape}")
    return input.unsqueeze(-2)


def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """1-d cross-correlation over (N, C, L) or (C, L) input with weight (O, C / groups, K), as
    torch.nn.functional.conv1d; `padding` may be an int, 'valid' or 'same' (stride 1)."""
    expect_tensors("conv1d", weight=weight)
    if weight.ndim != 3:
        raise ShapeError(f"conv1d: expects weight (O, C/groups, K), got shape {weight.shape}")
    stride, dilation = _single("conv1d", "stride", stride), _single("conv1d", "dilation", dilation)
    if isinstance(padding, str):
        if padding == "same" and stride != 1:
            raise ValueError("conv1d: padding='same' is not supported for strided convolutions")
        padding_2d = padding
    else:
        padding_2d = (0, _single("conv1d", "padding", padding))
    return conv2d(_with_height("conv1d", input), weight.unsqueeze(-2), bias, (1, stride), padding_2d,
                  (1, dilation), groups).squeeze(-2)


def conv_transpose1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1) -> Tensor:
    """1-d transposed convolution over (N, C, L) or (C, L) input with weight (C, O / groups, K), as
    torch.nn.functional.conv_transpose1d: conv_transpose2d over a height of 1."""
    fn = "conv_transpose1d"
    expect_tensors(fn, weight=weight)
    if weight.ndim != 3:
        raise ShapeError(f"{fn}: expects weight (C, O/groups, K), got shape {weight.shape}")
    stride, padding = _single(fn, "stride", stride), _single(fn, "padding", padding)
    output_padding, dilation = _single(fn, "output_padding", output_padding), _single(fn, "dilation", dilation)
    return conv_transpose2d(_with_height(fn, input), weight.unsqueeze(-2), bias, (1, stride), (0, padding),
                            (0, output_padding), groups, (1, dilation)).squeeze(-2)


def max_pool1d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over windows along the last dim of (N, C, L) or (C, L) input, as torch's max_pool1d (the
    indices are positions along L)."""
    k = _single("max_pool1d", "kernel_size", kernel_size)
    s = k if stride is None or stride == () else _single("max_pool1d", "stride", stride)
    p, d = _single("max_pool1d", "padding", padding), _single("max_pool1d", "dilation", dilation)
    if p > k // 2:
        raise ValueError(f"max_pool1d: padding {p} should be at most half of the kernel size {k}")
    return _without_height(max_pool2d(_with_height("max_pool1d", input), (1, k), (1, s), (0, p), (1, d), ceil_mode,
                                      return_indices))


def _without_height(out: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """A 2-d pooling's result (or its values and indices) less the height-1 axis _with_height added."""
    return tuple(t.squeeze(-2) for t in out) if isinstance(out, tuple) else out.squeeze(-2)


def max_unpool1d(input: Tensor, indices: Tensor, kernel_size, stride=None, padding=0, output_size=None) -> Tensor:
    """max_pool1d's partial inverse: each value placed at its position `indices` along L in a row of zeros."""
    k = _single("max_unpool1d", "kernel_size", kernel_size)
    s = k if stride is None else _single("max_unpool1d", "stride", stride)
    p = _single("max_unpool1d", "padding", padding)
    size = None if output_size is None else (1, tuple(output_size)[-1])
    return max_unpool2d(_with_height("max_unpool1d", input), _with_height("max_unpool1d", indices), (1, k), (1, s),
                        (0, p), size).squeeze(-2)


def avg_pool1d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
    """The mean over windows along the last dim of (N, C, L) or (C, L) input, as torch's avg_pool1d."""
    k = _single("avg_pool1d", "kernel_size", kernel_size)
    s = k if stride is None or stride == () else _single("avg_pool1d", "stride", stride)
    p = _single("avg_pool1d", "padding", padding)
    if p > k // 2:
        raise ValueError(f"avg_pool1d: padding {p} should be at most half of the kernel size {k}")
    return avg_pool2d(_with_height("avg_pool1d", input), (1, k), (1, s), (0, p), ceil_mode,
                      count_include_pad).squeeze(-2)


def adaptive_avg_pool1d(input: Tensor, output_size) -> Tensor:
    """The mean over `output_size` bins along the last dim, bin i spanning floor(i L / out) to
    ceil((i + 1) L / out), as torch's adaptive_avg_pool1d."""
    out = _single("adaptive_avg_pool1d", "output_size", output_size)
    return adaptive_avg_pool2d(_with_height("adaptive_avg_pool1d", input), (1, out)).squeeze(-2)


def adaptive_max_pool1d(input: Tensor, output_size, return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over adaptive_avg_pool1d's bins along the last dim (the indices are positions along L)."""
    out = _single("adaptive_max_pool1d", "output_size", output_size)
    return _without_height(adaptive_max_pool2d(_with_height("adaptive_max_pool1d", input), (1, out), return_indices))


# -- more activations, losses, distances and layers as functions -------------------------

def hardswish(input: Tensor, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _hardswish(input), inplace)


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    return _maybe_inplace(input, _hardsigmoid(input), inplace)


def dropout2d(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Zero whole channels (dim 1 of (N, C, H, W)) with probability p, scaling the rest by 1 / (1 - p).

    As in torch, an input of 3 dims is taken as (N, C, L) with a warning, and one of 2 or 5+ dims, also with
    a warning, has its elements of dims 0 and 1 dropped each with the rest of its dims.
    """
    expect_tensors("dropout2d", input=input)
    if not 0 <= p <= 1:
        raise ValueError(f"dropout2d: p must be in [0, 1], got {p}")
    if input.ndim < 2:
        raise ShapeError(f"dropout2d: expected an input of at least 2 dims (N, C, ...), got shape {input.shape}")
    if input.ndim == 3:
        warnings.warn("dropout2d: received a 3-d input and, as torch, takes it as (N, C, L): channel-wise 1-d "
                      "dropout", stacklevel=2)
    elif input.ndim != 4:
        warnings.warn(f"dropout2d: received a {input.ndim}-d input; dropout2d is meant for (N, C, H, W). "
                      "Use dropout for other shapes", stacklevel=2)
    if not training or p == 0:
        return input
    if p == 1:
        return _maybe_inplace(input, input * 0, inplace)
    keep = rand(input.shape[:2] + (1,) * (input.ndim - 2), device=input.device) >= p
    return _maybe_inplace(input, where(keep, input * (1 / (1 - p)), 0), inplace)


def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
    """`input` divided by its p-norm along `dim`, the norm clamped below at `eps` (where it is clamped, the
    norm's gradient is 0)."""
    check_float("normalize", input)
    length = norm(input, p, normalize_dim("normalize", dim, input.ndim), keepdim=True)
    return input / where(length < eps, eps, length)


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision.ops.stochastic_depth: drop a residual branch's whole output with probability p, each
    sample's alone (mode "row") or the batch's at once ("batch"), scaling what is kept by 1 / (1 - p)."""
    expect_tensors("stochastic_depth", input=input)
    if not 0 <= p <= 1:
        raise ValueError(f"stochastic_depth: p must be in [0, 1], got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"stochastic_depth: mode must be 'batch' or 'row', got {mode!r}")
    if not training or p == 0:
        return input
    if p == 1:
        return input * 0
    shape = (input.shape[0],) + (1,) * (input.ndim - 1) if mode == "row" else (1,) * input.ndim
    keep = rand(shape, device=input.device) >= p
    return where(keep, input * (1 / (1 - p)), 0)
