"""Reductions over one or several dims, with PyTorch's dtype rules and `keepdim`.

The SUM / PROD / MAX / MIN / ARGMAX / ARGMIN primitives keep reduced dims with size
1; these functions drop them unless `keepdim=True`. Mean, var, std, logsumexp,
softmax and log_softmax are compositions. At the end, the reduction primitives' rules.
"""

from __future__ import annotations

import builtins
import math
from collections import namedtuple

import numpy as np

from ember import amp, dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import NOT_DIFFERENTIABLE, check_shape, define
from ember.ops.creation import full, ones
from ember.ops.index import gather_in_range
from ember.ops.movement import normalize_dim, normalize_dims, reshape, transpose, tril
from ember.ops.pointwise import broadcast_shapes, cast, exp, log, maximum, minimum, where
from ember.tensor import Tensor, apply, composite, expect_tensors

MaxMin = namedtuple("MaxMin", ["values", "indices"])


def _dims(op: str, x: Tensor, dim) -> tuple[int, ...]:
    if isinstance(dim, (list, tuple)) and len(dim) == 0:
        dim = None
    return normalize_dims(op, dim, x.ndim)


def _finish(x: Tensor, axes: tuple[int, ...], keepdim: bool) -> Tensor:
    if keepdim:
        return x
    return reshape(x, tuple(s for i, s in enumerate(x.shape) if i not in axes))


def _reduce(prim: Op, x: Tensor, axes: tuple[int, ...], keepdim: bool) -> Tensor:
    out = apply(prim, x, axes=axes) if axes else x
    return _finish(out, axes, keepdim)


def sum(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:  # noqa: A001
    expect_tensors("sum", input=x)
    axes = _dims("sum", x, dim)
    if dtype is not None:
        x = cast(x, dtypes.as_dtype(dtype))
    elif not x.dtype.is_floating_point:
        x = cast(x, dtypes.int64)
    return _reduce(Op.SUM, x, axes, keepdim)


def prod(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    expect_tensors("prod", input=x)
    axes = _dims("prod", x, dim)
    if dtype is not None:
        x = cast(x, dtypes.as_dtype(dtype))
    elif not x.dtype.is_floating_point:
        x = cast(x, dtypes.int64)
    return _reduce(Op.PROD, x, axes, keepdim)


def mean(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    expect_tensors("mean", input=x)
    if dtype is not None:
        x = cast(x, dtypes.as_dtype(dtype))
    if not x.dtype.is_floating_point:
        raise DTypeError(f"mean: input dtype must be floating point, got {operands(x)}; "
                         "use x.float().mean() or pass dtype=")
    axes = _dims("mean", x, dim)
    count = math.prod(x.shape[a] for a in axes)
    total = sum(x, dim=axes, keepdim=keepdim) if axes else x
    return total / count if count else total * math.nan


def _check_nonempty(op: str, x: Tensor, axes: tuple[int, ...]) -> None:
    if 0 in (x.shape[a] for a in axes) or (not axes and x.numel() == 0):
        raise ShapeError(f"{op}: cannot reduce over an empty dimension (shape {x.shape}, dims {axes}); "
                         "there is no identity for this reduction")


def amax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    expect_tensors("amax", input=x)
    axes = _dims("amax", x, dim)
    _check_nonempty("amax", x, axes)
    return _reduce(Op.MAX, x, axes, keepdim)


def amin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    expect_tensors("amin", input=x)
    axes = _dims("amin", x, dim)
    _check_nonempty("amin", x, axes)
    return _reduce(Op.MIN, x, axes, keepdim)


def _arg(prim: Op, op: str, x: Tensor, dim, keepdim: bool) -> Tensor:
    expect_tensors(op, input=x)
    if dim is None:
        flat = reshape(x, (-1,))
        _check_nonempty(op, flat, (0,))
        out = apply(prim, flat, axes=(0,))
        return reshape(out, (1,) * x.ndim) if keepdim else reshape(out, ())
    axis = normalize_dim(op, dim, x.ndim)
    if x.ndim == 0:
        return cast(x, dtypes.int64) * 0
    _check_nonempty(op, x, (axis,))
    return _finish(apply(prim, x, axes=(axis,)), (axis,), keepdim)


def argmax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    return _arg(Op.ARGMAX, "argmax", x, dim, keepdim)


def argmin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    return _arg(Op.ARGMIN, "argmin", x, dim, keepdim)


def max(x: Tensor, dim=None, keepdim: bool = False):  # noqa: A001
    """`max(x)` is the largest value; `max(x, dim)` gives (values, indices); `max(x, y)` is maximum."""
    expect_tensors("max", input=x)
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    if dim is None:
        return amax(x)
    return _selected(x, dim, keepdim, argmax)


def min(x: Tensor, dim=None, keepdim: bool = False):  # noqa: A001
    expect_tensors("min", input=x)
    if isinstance(dim, Tensor):
        return minimum(x, dim)
    if dim is None:
        return amin(x)
    return _selected(x, dim, keepdim, argmin)


def _selected(x: Tensor, dim, keepdim: bool, arg) -> MaxMin:
    """Values read at the chosen indices, so that (as in torch) only the chosen element of a tie
    receives the gradient; amax/amin share it among the ties instead."""
    indices = arg(x, dim, keepdim=True)
    if x.ndim == 0:
        return MaxMin(x, indices)
    axis = normalize_dim("max", dim, x.ndim)
    values = gather_in_range(x, axis, indices)  # argmax's positions are in range
    return MaxMin(_finish(values, (axis,), keepdim), _finish(indices, (axis,), keepdim))


def all(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:  # noqa: A001
    expect_tensors("all", input=x)
    axes = _dims("all", x, dim)
    if not x.numel():
        return _empty_logical(x, axes, keepdim, True)
    return _reduce(Op.MIN, cast(x, dtypes.bool_), axes, keepdim)


def any(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:  # noqa: A001
    expect_tensors("any", input=x)
    axes = _dims("any", x, dim)
    if not x.numel():
        return _empty_logical(x, axes, keepdim, False)
    return _reduce(Op.MAX, cast(x, dtypes.bool_), axes, keepdim)


def _empty_logical(x: Tensor, axes, keepdim: bool, value: bool) -> Tensor:
    shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
    return _finish(full(shape, value, dtype=dtypes.bool_, device=x.device), axes, keepdim)


def count_nonzero(x: Tensor, dim=None) -> Tensor:
    expect_tensors("count_nonzero", input=x)
    return sum(x != 0, dim)


def var(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction=None) -> Tensor:
    expect_tensors("var", input=x)
    if not x.dtype.is_floating_point:
        raise DTypeError(f"var: input dtype must be floating point, got {operands(x)}")
    if correction is None:
        correction = 0 if unbiased is False else 1
    axes = _dims("var", x, dim)
    n = math.prod(x.shape[a] for a in axes)
    centred = x - mean(x, axes, keepdim=True)
    return sum(centred * centred, axes, keepdim=keepdim) / (n - correction if n > correction else 0)


def std(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction=None) -> Tensor:
    expect_tensors("std", input=x)
    v = var(x, dim, unbiased, keepdim, correction=correction)
    # where the variance is 0 the gradient is 0, as in torch, not 0 * inf from sqrt
    flat = v == 0
    return where(flat, 0.0, where(flat, 1.0, v).sqrt())


def var_mean(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction=None):
    expect_tensors("var_mean", input=x)
    return var(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


def std_mean(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction=None):
    expect_tensors("std_mean", input=x)
    return std(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


def _widened(x: Tensor, dtype) -> tuple[Tensor, object]:
    """Half inputs are reduced in float32 and the result rounded back, as PyTorch does."""
    if dtype is not None:
        x = cast(x, dtypes.as_dtype(dtype))
    if not x.dtype.is_floating_point:
        x = cast(x, dtypes.default_float)
    out_dtype = x.dtype
    if x.dtype in (dtypes.float16, dtypes.bfloat16):
        x = cast(x, dtypes.float32)
    return x, out_dtype


def _stable_shift(x: Tensor, axes) -> Tensor:
    m = amax(x.detach(), axes, keepdim=True)
    return where(m.abs() == math.inf, 0.0, m)


@amp.autocast_op("logsumexp")
def logsumexp(x: Tensor, dim, keepdim: bool = False) -> Tensor:
    expect_tensors("logsumexp", input=x)
    x, out_dtype = _widened(x, None)
    axes = _dims("logsumexp", x, dim)
    if x.numel() == 0:
        return cast(log(sum(exp(x), axes, keepdim=keepdim)), out_dtype)
    m = _stable_shift(x, axes)
    out = log(sum(exp(x - m), axes, keepdim=True)) + m
    return cast(_finish(out, axes, keepdim), out_dtype)


def _as_vector(fn, x: Tensor, dim: int, dtype) -> Tensor:
    """A 0-d input is a one-element vector (so its gradient is 0, as in torch)."""
    normalize_dim(fn.__name__, dim, 0)
    return reshape(fn(reshape(x, (1,)), 0, dtype), ())


@amp.autocast_op("softmax")
def softmax(x: Tensor, dim: int, dtype=None) -> Tensor:
    return _normalized(softmax, Op.SOFTMAX, _softmax, x, dim, dtype)


@amp.autocast_op("log_softmax")
def log_softmax(x: Tensor, dim: int, dtype=None) -> Tensor:
    return _normalized(log_softmax, Op.LOG_SOFTMAX, _log_softmax, x, dim, dtype)


def _normalized(fn, op: Op, decomposition, x: Tensor, dim: int, dtype) -> Tensor:
    """softmax or log_softmax of x along dim: one composite node for a float input (see ember.ir.ops)."""
    expect_tensors(fn.__name__, input=x)
    if x.ndim == 0:
        return _as_vector(fn, x, dim, dtype)
    axis = normalize_dim(fn.__name__, dim, x.ndim)
    wide, out_dtype = _widened(x, dtype)
    if x.numel() == 0:
        return cast(wide, out_dtype)
    if x.dtype.is_floating_point:
        return apply(op, x, axis=axis, dtype=out_dtype)  # one node until it is compiled
    return decomposition(x, axis, out_dtype)


def _softmax(x: Tensor, axis: int, dtype) -> Tensor:
    x, out_dtype = _widened(x, dtype)
    # shifted by the plain maximum: a row holding +inf or only -inf gives NaN, as in torch
    e = exp(x - amax(x.detach(), (axis,), keepdim=True))
    return cast(e / sum(e, (axis,), keepdim=True), out_dtype)


def _log_softmax(x: Tensor, axis: int, dtype) -> Tensor:
    x, out_dtype = _widened(x, dtype)
    shifted = x - amax(x.detach(), (axis,), keepdim=True)
    return cast(shifted - log(sum(exp(shifted), (axis,), keepdim=True)), out_dtype)


def norm(x: Tensor, p=2, dim=None, keepdim: bool = False) -> Tensor:
    """The p-norm over `dim` (all dims by default); p = 0 counts the non-zeros, p = inf and -inf are the largest
    and the smallest magnitude. As in torch, the gradient of the norm of an all-zero vector is 0, not the 0/0 of
    the root's derivative."""
    expect_tensors("norm", input=x)
    if p == 1:
        return sum(x.abs(), dim, keepdim)
    if p == math.inf:
        return amax(x.abs(), dim, keepdim)
    if p == -math.inf:
        return amin(x.abs(), dim, keepdim)
    if p == 0:
        return cast(sum(x != 0, dim, keepdim), x.dtype)
    powered = sum(x * x, dim, keepdim) if p == 2 or p == "fro" else sum(x.abs() ** p, dim, keepdim)
    nonzero = powered > 0
    # the root of 1 where the sum is 0: a finite derivative there, which the outer where then zeroes
    safe = where(nonzero, powered, 1)
    root = safe.sqrt() if p == 2 or p == "fro" else safe ** (1 / p)
    return where(nonzero, root, 0)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """The cosine of the angle between x1 and x2 (broadcast together) along `dim`.

    As in torch, each vector is divided by its norm clamped below at `eps` before the dot product, which keeps
    the result in [-1, 1]; the clamp changes the values only, not the gradient, which flows through the
    unclamped norm.
    """
    expect_tensors("cosine_similarity", x1=x1, x2=x2)
    dtype = dtypes.result_type(x1, x2)
    if not dtype.is_floating_point:
        raise DTypeError(f"cosine_similarity: expected floating-point inputs, got {operands(x1, x2)}")
    shape = broadcast_shapes(x1.shape, x2.shape, op="cosine_similarity")
    axis = normalize_dim("cosine_similarity", dim, len(shape))
    unit = []
    for x in (x1, x2):
        x = cast(x, dtype).expand(shape)
        length = norm(x, 2, axis, keepdim=True)
        unit.append(x / (length + (maximum(length, eps) - length).detach()))
    return sum(unit[0] * unit[1], axis)


def cumsum(x: Tensor, dim: int, dtype: dtypes.DType | str | None = None) -> Tensor:
    """Cumulative sum as a product with a triangular matrix of ones, for integers a masked sum (fine for modest
    lengths); `dtype`: what x is cast to first (as torch's; without it, integers and booleans sum in int64)."""
    expect_tensors("cumsum", input=x)
    axis = normalize_dim("cumsum", dim, x.ndim)
    n = x.shape[axis] if x.ndim else 1
    if dtype is not None:
        x = cast(x, dtypes.as_dtype(dtype))
    elif not x.dtype.is_floating_point:
        x = cast(x, dtypes.int64)
    moved = transpose(x, axis, -1) if x.ndim else reshape(x, (1,))
    if x.dtype.is_floating_point:
        out = moved @ transpose(tril(ones((n, n), dtype=x.dtype, device=x.device)), 0, 1)
    else:  # a masked sum, one fused reduction: GEMMs (cuBLAS) take no integers
        before = tril(ones((n, n), dtype=dtypes.bool_, device=x.device))  # [i, j]: j <= i
        out = sum(where(before, reshape(moved, (*moved.shape[:-1], 1, n)), 0), -1, dtype=x.dtype)
    return transpose(out, axis, -1) if x.ndim else reshape(out, ())


# -- the reduction primitives -------------------------------------------------------------------------
# Each primitive's rules side by side: shape and dtype (reduced dims kept with size 1), VJP, reference
# implementation (NumPy, half types computed in float32, the `axes` attribute as a keyword), and identity:
# the neutral element, as a Python number of the dtype's kind, that padding and accumulators start from.

def _number(dtype: dtypes.DType, value) -> bool | int | float:
    return bool(value) if dtype is dtypes.bool_ else (float(value) if dtype.is_floating_point else int(value))


def _lowest(dtype: dtypes.DType) -> bool | int | float:
    """The identity of max and argmax: -inf, or the dtype's smallest value."""
    if dtype.is_floating_point:
        return -math.inf
    return False if dtype is dtypes.bool_ else int(np.iinfo(dtype.np).min)


def _highest(dtype: dtypes.DType) -> bool | int | float:
    """The identity of min and argmin: +inf, or the dtype's largest value."""
    if dtype.is_floating_point:
        return math.inf
    return True if dtype is dtypes.bool_ else int(np.iinfo(dtype.np).max)


def _reduce_rule(op: Op, indices: bool = False):
    def rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
        (x,) = inputs
        axes = attrs["axes"]
        check_shape(builtins.all(0 <= a < len(x.shape) for a in axes), op, f"axes {axes} out of range for {x.shape}")
        shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        return shape, (dtypes.int64 if indices else x.dtype)
    return rule


def _sum_vjp(g, xs, out, a):
    return (g.expand(xs[0].shape),)


def _prod_vjp(g, xs, out, a):
    """The product of the other elements, without dividing by a zero: one zero in a row gets the product of
    the rest, the others nothing."""
    (x,) = xs
    axes = a["axes"]
    nonzero = x != 0
    prod_nonzero = apply(Op.PROD, where(nonzero, x, 1.0), axes=axes).expand(x.shape)
    zeros = apply(Op.SUM, (~nonzero).to(g.dtype), axes=axes).expand(x.shape)
    others = where(zeros == 0, prod_nonzero / where(nonzero, x, 1.0),
                   where((zeros == 1) & ~nonzero, prod_nonzero, 0.0))
    return (g.expand(x.shape) * others,)


def _extremum_vjp(g, xs, out, a):
    """Ties share the gradient equally."""
    (x,) = xs
    hit = (x == out.expand(x.shape)).to(g.dtype)
    count = apply(Op.SUM, hit, axes=a["axes"])
    return ((g / count).expand(x.shape) * hit,)


def _np_accumulate(fn):
    """Sums and products keep the input's type: small integers wrap around as they do in torch."""
    return lambda x, axes: fn(x, axis=axes, keepdims=True, dtype=x.dtype)


def _np_arg(fn):
    def reference(x, axes):
        (axis,) = axes
        return fn(x, axis=axis, keepdims=True)
    return reference


define(Op.SUM, shape=_reduce_rule(Op.SUM), vjp=_sum_vjp, reference=_np_accumulate(np.sum),
       identity=lambda dtype: _number(dtype, 0))
define(Op.PROD, shape=_reduce_rule(Op.PROD), vjp=_prod_vjp, reference=_np_accumulate(np.prod),
       identity=lambda dtype: _number(dtype, 1))
define(Op.MAX, shape=_reduce_rule(Op.MAX), vjp=_extremum_vjp,
       reference=lambda x, axes: np.max(x, axis=axes, keepdims=True), identity=_lowest)
define(Op.MIN, shape=_reduce_rule(Op.MIN), vjp=_extremum_vjp,
       reference=lambda x, axes: np.min(x, axis=axes, keepdims=True), identity=_highest)
define(Op.ARGMAX, shape=_reduce_rule(Op.ARGMAX, indices=True), vjp=NOT_DIFFERENTIABLE, reference=_np_arg(np.argmax),
       identity=_lowest)
define(Op.ARGMIN, shape=_reduce_rule(Op.ARGMIN, indices=True), vjp=NOT_DIFFERENTIABLE, reference=_np_arg(np.argmin),
       identity=_highest)


def _normalized_rule(inputs, attrs) -> tuple:
    return inputs[0].shape, attrs["dtype"]


composite(Op.SOFTMAX, _normalized_rule, _softmax)
composite(Op.LOG_SOFTMAX, _normalized_rule, _log_softmax)
