"""The losses of ember.nn.functional (cross entropy, NLL, MSE, L1, smooth L1, Huber, KL divergence, binary cross
entropy), with torch.nn.functional's signatures and reductions: compositions of ops, so they fuse and differentiate
like any other graph; cross entropy and MSE are composites the compiler expands."""

from __future__ import annotations

import math
import warnings

from ember import amp
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.nn.checks import check_float
from ember.ops import log_softmax as _log_softmax
from ember.ops.index import checked, gather_in_range, select_in_range
from ember.ops.pointwise import abs, broadcast_shapes, cast, exp, log, log1p, maximum, where
from ember.tensor import Tensor, apply, composite, expect_tensors

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
    check_float("nll_loss", input)
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
    check_float("cross_entropy", input)
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
    check_float(fn, input)
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



def kl_div(input: Tensor, target: Tensor, *, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """KL divergence of `target` from the distribution `input` holds as log-probabilities, pointwise:
    `target * (log(target) - input)`, 0 where target is 0 (or `exp(target) * (target - input)` when the target
    holds log-probabilities too).

    reduction 'batchmean' divides the sum by the batch size (dim 0): the true KL divergence per sample.
    'mean' divides by every element and, as in torch, warns so.
    """
    check_float("kl_div", input)
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
