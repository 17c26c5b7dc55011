"""ember.nn.functional: activations, layers as functions, normalisation and losses.

Import as `F`, as with torch.nn.functional. Most entries are ember's ops under their
torch.nn.functional names and signatures; the losses and normalisations are written
here as compositions of ops, so they fuse and differentiate like any other graph.
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
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import define_composite
from ember.nn.attention import scaled_dot_product_attention
from ember.ops import (
    adaptive_avg_pool2d,
    adaptive_max_pool2d,
    avg_pool2d,
    conv2d,
    conv_transpose2d,
    gelu,
    linear,
    max_pool2d,
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
from ember.ops.creation import tensor
from ember.ops.index import checked, gather_in_range, select_in_range
from ember.ops.movement import normalize_dim, pixel_shuffle, pixel_unshuffle
from ember.ops.pointwise import abs, broadcast_shapes, cast, converted, exp, log, log1p, maximum, where
from ember.ops.random import rand
from ember.ops.reduce import cosine_similarity, norm
from ember.runtime.executor import realize_with_next
from ember.tensor import Tensor, apply, composite, expect_tensors, realize

__all__ = [
    "adaptive_avg_pool2d", "adaptive_max_pool2d", "avg_pool2d", "batch_norm", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "conv2d", "conv_transpose2d",
    "cross_entropy", "dropout", "elu", "embedding", "gelu",
    "hardtanh", "l1_loss", "layer_norm", "leaky_relu", "linear", "log_softmax", "logsigmoid",
    "max_pool2d", "mish", "mse_loss", "nll_loss", "one_hot", "pad", "relu", "relu6", "rms_norm",
    "scaled_dot_product_attention", "sigmoid", "silu", "smooth_l1_loss", "softmax", "softplus", "tanh",
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

def _check_float(fn: str, *tensors: Tensor) -> None:
    for t in tensors:
        expect_tensors(fn, input=t)
        if not t.dtype.is_floating_point:
            raise DTypeError(f"{fn}: expected floating-point tensors, got {operands(*tensors)}")


def _opmath(x: Tensor) -> Tensor:
    """Half-precision inputs are normalised in float32, as PyTorch does."""
    return cast(x, dtypes.float32) if x.dtype in (dtypes.float16, dtypes.bfloat16) else x


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
    _check_float("layer_norm", input)
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
    _check_float("rms_norm", input)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or input.shape[input.ndim - len(shape):] != shape:
        raise ShapeError(f"rms_norm: input of shape {input.shape} does not end in normalized_shape {shape}")
    if weight is not None:
        expect_tensors("rms_norm", weight=weight)
        if weight.shape != shape:
            raise ShapeError(f"rms_norm: weight of shape {weight.shape} must have normalized_shape {shape}")
    x = _opmath(input)
    eps = eps if eps is not None else float(np.finfo(x.dtype.np).eps)
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    out = cast(x * ((x * x).mean(axes, keepdim=True) + eps).rsqrt(), input.dtype)
    return out * weight if weight is not None else out


def _layer_norm(input: Tensor, weight: Tensor | None, bias: Tensor | None, dims: int, eps: float) -> Tensor:
    x = _opmath(input)
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
    _check_float("batch_norm", input)
    if input.ndim < 2:
        raise ShapeError(f"batch_norm: expected input of shape (N, C, ...), got {input.shape}")
    c = input.shape[1]
    wide = dtypes.float32 if input.dtype in (dtypes.float16, dtypes.bfloat16) else input.dtype  # see _opmath
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
    x = _opmath(input)
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
    x = _opmath(input)
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


# -- losses ---------------------------------------------------------------------------

def _reduce(fn: str, loss: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"{fn}: reduction must be 'none', 'mean' or 'sum', not {reduction!r}")


def _check_reduction(fn: str, reduction: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{fn}: reduction must be 'none', 'mean' or 'sum', not {reduction!r}")


def _class_dim(fn: str, input: Tensor) -> int:
    if input.ndim == 0:
        raise ShapeError(f"{fn}: input must be (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    return 1 if input.ndim >= 2 else 0


def _check_class_target(fn: str, input: Tensor, target: Tensor, class_dim: int) -> None:
    expected = input.shape[:class_dim] + input.shape[class_dim + 1:]
    if target.shape != expected:
        raise ShapeError(f"{fn}: class-index target of shape {target.shape} does not fit input of shape "
                         f"{input.shape}; expected target shape {expected} ({operands(input, target)})")


def _check_weight(fn: str, weight: Tensor | None, classes: int) -> None:
    if weight is None:
        return
    if not isinstance(weight, Tensor) or not weight.dtype.is_floating_point:
        raise DTypeError(f"{fn}: weight must be a floating-point Tensor, got {operands(weight)}")
    if weight.shape != (classes,):
        raise ShapeError(f"{fn}: weight of shape {weight.shape} must have one entry per class ({classes},)")


def _weight_along(weight: Tensor, class_dim: int, ndim: int) -> Tensor:
    return weight.reshape(tuple(-1 if d == class_dim else 1 for d in range(ndim)))


def _nll(fn: str, logp: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
         class_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The negative log-likelihood per element (0 where ignored), its reduction, and each
    element's class weight (0 where ignored); a target outside [0, C) other than ignore_index is an
    IndexError from `fn`."""
    ignored = target == ignore_index
    # ignore_index may lie outside [0, C)
    safe = checked(fn, where(ignored, 0, target), logp.shape[class_dim], class_dim)
    picked = gather_in_range(logp, class_dim, safe.unsqueeze(class_dim)).squeeze(class_dim)
    if weight is None:
        target_weight = where(ignored, 0.0, 1.0)
        loss = where(ignored, 0.0, -picked)
    else:
        target_weight = where(ignored, 0.0, select_in_range(cast(weight, logp.dtype), 0, safe.reshape(-1))
                              .reshape(safe.shape))
        loss = where(ignored, 0.0, -picked * target_weight)
    target_weight = cast(target_weight, logp.dtype)
    if reduction == "none":
        return loss, loss, target_weight
    if reduction == "sum":
        return loss, loss.sum(), target_weight
    return loss, loss.sum() / target_weight.sum(), target_weight


def _check_index_target(fn: str, target: Tensor) -> None:
    expect_tensors(fn, target=target)
    if not target.dtype.is_integer:
        raise DTypeError(f"{fn}: target must hold class indices (an integer tensor), got {operands(target)}")


@amp.autocast_op("nll_loss")
def nll_loss(input: Tensor, target: Tensor, weight: Tensor | None = None, *, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of class indices given log-probabilities over dim 1 (dim 0 for (C,) input).

    The mean divides by the summed weights of the non-ignored targets, as PyTorch does.
    """
    _check_float("nll_loss", input)
    _check_index_target("nll_loss", target)
    _check_reduction("nll_loss", reduction)
    class_dim = _class_dim("nll_loss", input)
    _check_class_target("nll_loss", input, target, class_dim)
    _check_weight("nll_loss", weight, input.shape[class_dim])
    return _nll("nll_loss", input, target, weight, ignore_index, reduction, class_dim)[1]


@amp.autocast_op("cross_entropy")
def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Cross entropy between logits (class dim 1, or 0 for (C,) input) and a target.

    The target holds either class indices (shape of input without the class dim) or
    class probabilities (same shape as input). `weight` rescales each class;
    `ignore_index` drops index targets; `label_smoothing` mixes the target with the
    uniform distribution. Reductions and the way these combine follow PyTorch exactly.
    """
    _check_float("cross_entropy", input)
    expect_tensors("cross_entropy", target=target)
    _check_reduction("cross_entropy", reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    class_dim = _class_dim("cross_entropy", input)
    classes = input.shape[class_dim]
    _check_weight("cross_entropy", weight, classes)
    if target.dtype.is_floating_point:
        return _cross_entropy_probabilities(_log_softmax(input, class_dim), target, weight, reduction,
                                            label_smoothing, class_dim)
    if not target.dtype.is_integer:
        raise DTypeError(f"cross_entropy: target must hold class indices (integer) or class probabilities "
                         f"(floating point), got {operands(target)}")
    _check_class_target("cross_entropy", input, target, class_dim)
    if weight is None:  # one node until it is compiled
        return apply(Op.CROSS_ENTROPY, input, target, ignore_index=ignore_index, reduction=reduction,
                     label_smoothing=float(label_smoothing))
    return _cross_entropy_indices(input, target, weight, ignore_index, reduction, label_smoothing)


def _cross_entropy_indices(input: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
                           label_smoothing: float) -> Tensor:
    class_dim = _class_dim("cross_entropy", input)
    classes = input.shape[class_dim]
    logp = _log_softmax(input, class_dim)
    _, nll, target_weight = _nll("cross_entropy", logp, target, weight, ignore_index, reduction, class_dim)
    if label_smoothing == 0.0:
        return nll
    ignored = target == ignore_index
    per_class = logp if weight is None else logp * _weight_along(cast(weight, logp.dtype), class_dim, logp.ndim)
    smooth = where(ignored, 0.0, -per_class.sum(class_dim))
    if reduction == "mean":
        smooth = smooth.sum() / target_weight.sum()
    elif reduction == "sum":
        smooth = smooth.sum()
    return nll * (1 - label_smoothing) + smooth * (label_smoothing / classes)


def _cross_entropy_rule(inputs, attrs) -> tuple:
    return (inputs[1].shape if attrs["reduction"] == "none" else ()), inputs[0].dtype


composite(Op.CROSS_ENTROPY, _cross_entropy_rule,
          lambda input, target, **attrs: _cross_entropy_indices(input, target, None, **attrs))


def _cross_entropy_probabilities(logp: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                                 label_smoothing: float, class_dim: int) -> Tensor:
    if target.shape != logp.shape:
        raise ShapeError(f"cross_entropy: a probability target must have the input's shape {logp.shape}, "
                         f"got {target.shape} ({operands(logp, target)})")
    classes = logp.shape[class_dim]
    target = cast(target, logp.dtype)
    if label_smoothing > 0.0:
        target = target * (1 - label_smoothing) + label_smoothing / classes
    terms = logp * target
    if weight is not None:
        terms = terms * _weight_along(cast(weight, logp.dtype), class_dim, logp.ndim)
    if reduction == "none":
        return -terms.sum(class_dim)
    if reduction == "sum":
        return -terms.sum()
    return -terms.sum() / (logp.numel() / classes) if logp.numel() else -terms.sum() * math.nan


def _check_pair(fn: str, input: Tensor, target: Tensor, same_shape: bool) -> None:
    _check_float(fn, input)
    expect_tensors(fn, target=target)
    if same_shape and target.shape != input.shape:
        raise ShapeError(f"{fn}: target of shape {target.shape} must have the input's shape {input.shape} "
                         f"({operands(input, target)})")
    if not same_shape and target.shape != input.shape:
        broadcast_shapes(input.shape, target.shape, op=fn)
        warnings.warn(f"{fn}: using a target size {target.shape} that is different to the input size "
                      f"{input.shape}; they will be broadcast, which is likely not what you want", stacklevel=3)


@amp.autocast_op("mse_loss")
def mse_loss(input: Tensor, target: Tensor, *, reduction: str = "mean") -> Tensor:
    _check_pair("mse_loss", input, target, same_shape=False)
    _check_reduction("mse_loss", reduction)
    if target.shape == input.shape and target.dtype is input.dtype:
        return apply(Op.MSE_LOSS, input, target, reduction=reduction)  # one node until it is compiled
    return _mse_loss(input, target, reduction)


def _mse_loss(input: Tensor, target: Tensor, reduction: str) -> Tensor:
    diff = input - target
    return _reduce("mse_loss", diff * diff, reduction)


def _mse_loss_rule(inputs, attrs) -> tuple:
    return (inputs[0].shape if attrs["reduction"] == "none" else ()), inputs[0].dtype


composite(Op.MSE_LOSS, _mse_loss_rule, _mse_loss)


@amp.autocast_op("l1_loss")
def l1_loss(input: Tensor, target: Tensor, *, reduction: str = "mean") -> Tensor:
    _check_pair("l1_loss", input, target, same_shape=False)
    return _reduce("l1_loss", abs(input - target), reduction)


@amp.autocast_op("smooth_l1_loss")
def smooth_l1_loss(input: Tensor, target: Tensor, *, reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """Squared error below `beta` (scaled by 1 / (2 beta)), absolute error minus beta / 2 above."""
    _check_pair("smooth_l1_loss", input, target, same_shape=False)
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be non-negative, got {beta}")
    diff = abs(input - target)
    if beta == 0:
        return _reduce("smooth_l1_loss", diff, reduction)
    return _reduce("smooth_l1_loss", where(diff < beta, diff * diff * (0.5 / beta), diff - 0.5 * beta), reduction)


@amp.autocast_op("binary_cross_entropy")
def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                         reduction: str = "mean") -> Tensor:
    """Cross entropy of probabilities `input` against targets in [0, 1]; logs are clamped at -100 as in PyTorch."""
    _check_pair("binary_cross_entropy", input, target, same_shape=True)
    target = cast(target, input.dtype)
    log_p = log(input).clamp(min=-100)
    log_not_p = log(1 - input).clamp(min=-100)
    loss = -(target * log_p + (1 - target) * log_not_p)
    if weight is not None:
        loss = loss * weight
    return _reduce("binary_cross_entropy", loss, reduction)


@amp.autocast_op("binary_cross_entropy_with_logits")
def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None, *,
                                     reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
    """Sigmoid and binary cross entropy in one stable formula; `pos_weight` scales the positive term."""
    _check_pair("binary_cross_entropy_with_logits", input, target, same_shape=True)
    target = cast(target, input.dtype)
    # -log(sigmoid(x)) = max(-x, 0) + log1p(exp(-|x|)): no overflow for any x
    neg_log_sigmoid = maximum(-input, 0.0) + log1p(exp(-abs(input)))
    if pos_weight is not None:
        broadcast_shapes(pos_weight.shape, target.shape, op="binary_cross_entropy_with_logits")
        loss = (1 - target) * input + ((pos_weight - 1) * target + 1) * neg_log_sigmoid
    else:
        loss = (1 - target) * input + neg_log_sigmoid
    if weight is not None:
        loss = loss * weight
    return _reduce("binary_cross_entropy_with_logits", loss, reduction)


# -- group and instance normalisation -------------------------------------------------------
# Both normalise rows of the input viewed as (N, G, -1): G groups of channels for group_norm, each channel for
# instance_norm. Row statistics are what the compiler fuses into row kernels.

def _row_normalized(input: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The input normalised over rows of (N, groups, -1), scaled and shifted per channel (dim 1) in float32 for
    half-precision input and rounded once; with each row's mean and biased variance, shaped (N, groups, 1)."""
    x = _opmath(input)
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
    _check_float("group_norm", input)
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
    _check_float("instance_norm", input)
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


def max_pool1d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor:
    """The maximum over windows along the last dim of (N, C, L) or (C, L) input, as torch's max_pool1d."""
    k = _single("max_pool1d", "kernel_size", kernel_size)
    s = k if stride is None or stride == () else _single("max_pool1d", "stride", stride)
    p, d = _single("max_pool1d", "padding", padding), _single("max_pool1d", "dilation", dilation)
    if p > k // 2:
        raise ValueError(f"max_pool1d: padding {p} should be at most half of the kernel size {k}")
    return max_pool2d(_with_height("max_pool1d", input), (1, k), (1, s), (0, p), (1, d), ceil_mode,
                      return_indices).squeeze(-2)


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


def adaptive_max_pool1d(input: Tensor, output_size, return_indices: bool = False) -> Tensor:
    """The maximum over adaptive_avg_pool1d's bins along the last dim."""
    if return_indices:
        raise NotImplementedError("adaptive_max_pool1d: return_indices=True is not supported")
    out = _single("adaptive_max_pool1d", "output_size", output_size)
    return adaptive_max_pool2d(_with_height("adaptive_max_pool1d", input), (1, out)).squeeze(-2)


# -- resampling ----------------------------------------------------------------------------
# interpolate is separable: along each spatial axis every output position reads a few source positions (taps)
# with weights that depend on the sizes alone, so both are computed on the host (in float32, as torch computes
# them) and the resampling is gathers and weighted sums, differentiated as any other graph.

_INTERPOLATING = ("linear", "bilinear", "bicubic", "trilinear")
_CUBIC_A = -0.75  # the Keys cubic convolution coefficient torch uses


def _resampled_sizes(input: Tensor, size, scale_factor, recompute_scale_factor: bool | None) -> tuple[list, list]:
    """The output's spatial sizes, and the scale factor each axis's source positions are computed with (None
    where the sizes' ratio is used)."""
    spatial = input.shape[2:]
    if size is not None and scale_factor is not None:
        raise ValueError("interpolate: only one of size or scale_factor should be defined")
    if size is None and scale_factor is None:
        raise ValueError("interpolate: either size or scale_factor should be defined")
    if size is not None:
        sizes = [size] * len(spatial) if isinstance(size, int) else list(size)
        if len(sizes) != len(spatial):
            raise ValueError(f"interpolate: size {size} must give one size per spatial dim of input {input.shape}")
        scales = [None] * len(spatial)
    else:
        factors = [scale_factor] * len(spatial) if isinstance(scale_factor, (int, float)) else list(scale_factor)
        if len(factors) != len(spatial):
            raise ValueError(f"interpolate: scale_factor {scale_factor} must give one factor per spatial dim of "
                             f"input {input.shape}")
        sizes = [math.floor(n * float(f)) for n, f in zip(spatial, factors)]
        scales = [None] * len(spatial) if recompute_scale_factor else [float(f) for f in factors]
    if any(m <= 0 for m in sizes) or any(n <= 0 for n in spatial):
        raise ShapeError(f"interpolate: input {input.shape} and output sizes {tuple(sizes)} should be greater "
                         f"than 0")
    return sizes, scales


def _source_scale(n: int, m: int, scale: float | None, align_corners: bool) -> np.float32:
    """How far the source position moves per output position."""
    if align_corners:
        return np.float32(n - 1) / np.float32(m - 1) if m > 1 else np.float32(0)
    return np.float32(1.0 / scale) if scale is not None and scale > 0 else np.float32(n) / np.float32(m)


def _taps(n: int, m: int, scale: float | None, mode: str, align_corners: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """For one axis of n source and m output positions: (source index, weight) arrays of length m, one pair per
    tap (the weights None for nearest modes)."""
    step = _source_scale(n, m, scale, align_corners)
    d = np.arange(m, dtype=np.float32)
    if mode == "nearest":  # torch's legacy rounding: the position is floor(d * step)
        return [(np.minimum(np.floor(d * step).astype(np.int64), n - 1), None)]
    if mode == "nearest-exact":  # the source pixel whose centre is nearest: floor((d + 0.5) * step)
        return [(np.minimum(np.floor((d + np.float32(0.5)) * step).astype(np.int64), n - 1), None)]
    half = np.float32(0.5)
    source = d * step if align_corners else step * (d + half) - half
    if mode == "bilinear":
        source = np.maximum(source, np.float32(0))
    first = np.minimum(np.floor(source).astype(np.int64), n - 1)
    t = np.clip(source - first.astype(np.float32), np.float32(0), np.float32(1))
    if mode == "bilinear":
        return [(first, 1 - t), (np.minimum(first + 1, n - 1), t)]
    a = np.float32(_CUBIC_A)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
    return [(np.clip(first + k - 1, 0, n - 1), w) for k, w in enumerate(weights)]


def _taken(x: Tensor, axis: int, index: np.ndarray) -> Tensor:
    """x at the source positions `index` along `axis`: a broadcast where each position repeats a whole number of
    times in order (nearest upsampling by an integer factor), else a gather."""
    n, m = x.shape[axis], len(index)
    if m % n == 0 and np.array_equal(index, np.arange(m) // (m // n)):
        repeats = m // n
        if repeats == 1:
            return x
        spread = x.unsqueeze(axis + 1).expand(x.shape[:axis + 1] + (repeats,) + x.shape[axis + 1:])
        return spread.reshape(x.shape[:axis] + (m,) + x.shape[axis + 1:])
    return select_in_range(x, axis, tensor(index.astype(np.int32), device=x.device))


def _resampled_axis(x: Tensor, axis: int, taps: list[tuple[np.ndarray, np.ndarray]]) -> Tensor:
    """The weighted sum of the taps along `axis` (the one tap of a nearest mode taken as is)."""
    if taps[0][1] is None:
        return _taken(x, axis, taps[0][0])
    along = (-1,) + (1,) * (x.ndim - 1 - axis)
    out = None
    for index, weight in taps:
        term = _taken(x, axis, index) * tensor(weight.astype(x.dtype.np), device=x.device).reshape(along)
        out = term if out is None else out + term
    return out


def interpolate(input: Tensor, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False) -> Tensor:
    """Resample (N, C, H, W) input to `size` or by `scale_factor`, as torch.nn.functional.interpolate.

    Modes: 'nearest' (torch's legacy floor(d * in / out) rounding), 'nearest-exact', 'bilinear', 'bicubic'
    (Keys' cubic with A = -0.75, taps clamped at the border) and 'area' (adaptive average pooling).
    `align_corners` maps the corner pixels' centres onto each other (bilinear and bicubic only). Bilinear and
    bicubic compute float16 and bfloat16 input in float32 and round once."""
    expect_tensors("interpolate", input=input)
    if mode in ("nearest", "nearest-exact", "area"):
        if align_corners is not None:
            raise ValueError("interpolate: align_corners option can only be set with the interpolating modes: "
                             "linear | bilinear | bicubic | trilinear")
    elif mode not in _INTERPOLATING:
        raise NotImplementedError(f"interpolate: mode {mode!r} is not one of nearest, nearest-exact, area, "
                                  f"bilinear or bicubic")
    if input.ndim != 4 or mode in ("linear", "trilinear"):
        raise NotImplementedError(f"interpolate: ember resamples 4-d input (N, C, H, W) in the modes nearest, "
                                  f"nearest-exact, area, bilinear and bicubic; got {input.ndim}-d input and mode "
                                  f"{mode!r}")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported")
    sizes, scales = _resampled_sizes(input, size, scale_factor, recompute_scale_factor)
    if mode == "area":
        return adaptive_avg_pool2d(input, tuple(sizes))
    if mode in _INTERPOLATING:
        _check_float("interpolate", input)
    x = input if mode.startswith("nearest") else _opmath(input)
    for axis, n, m, scale in zip((2, 3), input.shape[2:], sizes, scales):
        x = _resampled_axis(x, axis, _taps(n, m, scale, mode, bool(align_corners)))
    return cast(x, input.dtype)


__all__ += [
    "adaptive_avg_pool1d", "adaptive_max_pool1d", "avg_pool1d", "conv1d", "group_norm", "instance_norm",
    "interpolate", "max_pool1d",
]


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
    _check_float("normalize", input)
    length = norm(input, p, normalize_dim("normalize", dim, input.ndim), keepdim=True)
    return input / where(length < eps, eps, length)


def kl_div(input: Tensor, target: Tensor, *, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """KL divergence of `target` from the distribution `input` holds as log-probabilities, pointwise:
    `target * (log(target) - input)`, 0 where target is 0 (or `exp(target) * (target - input)` when the target
    holds log-probabilities too).

    reduction 'batchmean' divides the sum by the batch size (dim 0): the true KL divergence per sample.
    'mean' divides by every element and, as in torch, warns so.
    """
    _check_float("kl_div", input)
    expect_tensors("kl_div", target=target)
    if reduction not in ("none", "batchmean", "mean", "sum"):
        raise ValueError(f"kl_div: reduction must be 'none', 'batchmean', 'mean' or 'sum', not {reduction!r}")
    if reduction == "mean":
        warnings.warn("kl_div: reduction='mean' divides the total loss by both the batch size and the support "
                      "size; 'batchmean' divides by the batch size only, as the KL divergence's definition does. "
                      "(torch warns that 'mean' will behave as 'batchmean' in a later release.)", stacklevel=2)
    if log_target:
        loss = exp(target) * (target - input)
    else:
        loss = where(target == 0, 0, target * log(target)) - target * input
    if reduction == "batchmean":
        return loss.sum() / input.shape[0] if input.ndim else loss.sum()
    return _reduce("kl_div", loss, reduction)


def huber_loss(input: Tensor, target: Tensor, *, reduction: str = "mean", delta: float = 1.0) -> Tensor:
    """Squared error halved below `delta`, `delta * (|error| - delta / 2)` above: smooth_l1_loss times delta."""
    _check_pair("huber_loss", input, target, same_shape=False)
    _check_reduction("huber_loss", reduction)
    if delta <= 0:
        raise ValueError(f"huber_loss: delta must be positive, got {delta}")
    error = abs(input - target)
    return _reduce("huber_loss", where(error < delta, error * error * 0.5, (error - 0.5 * delta) * delta), reduction)


__all__ += [
    "cosine_similarity", "dropout2d", "glu", "hardsigmoid", "hardswish", "huber_loss", "kl_div", "normalize",
    "pixel_shuffle", "pixel_unshuffle", "prelu",
]
