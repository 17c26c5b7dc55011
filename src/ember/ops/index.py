"""Gather and scatter: embeddings, index_select, one_hot, and the core of integer indexing; at the end,
the GATHER and SCATTER_ADD primitives' rules."""

from __future__ import annotations

import numpy as np

from ember import dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import define
from ember.ops.creation import arange, zeros
from ember.ops.movement import expand, normalize_dim, reshape, slice_axis
from ember.ops.pointwise import _check_devices, cast, where
from ember.tensor import Tensor, apply


def _check_index(op: str, x: Tensor, index: Tensor) -> None:
    if not isinstance(index, Tensor) or not index.dtype.is_integer:
        raise DTypeError(f"{op}: index must be an integer tensor (int64 or int32), got {operands(index)}")
    _check_devices(op, [x, index])


def check_bounds(op: str, index: Tensor, size: int, dim: int, negative: bool = False) -> None:
    """Out-of-range indices fail at the call when the index values are already known (data the
    user gave); an index still pending is checked when the gather runs."""
    buffer = index._node.buffer
    if not isinstance(buffer, np.ndarray) or buffer.size == 0:
        return
    low = -size if negative else 0
    lo, hi = int(buffer.min()), int(buffer.max())
    if lo < low or hi >= size:
        raise IndexError(f"{op}: index {lo if lo < low else hi} is out of bounds for dimension {dim} with size "
                         f"{size} (index of shape {index.shape})")


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """out[i][j] = x[index[i][j]][j] for dim 0 (torch.gather)."""
    _check_index("gather", x, index)
    axis = normalize_dim("gather", dim, x.ndim)
    check_bounds("gather", index, x.shape[axis], axis)
    if index.ndim != x.ndim or any(i > s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != axis):
        raise ShapeError(f"gather: index of shape {index.shape} does not fit input of shape {x.shape} along "
                         f"dim {dim} (same number of dims, no larger outside dim {axis})")
    return apply(Op.GATHER, x, cast(index, dtypes.int64), axis=axis)


def take_along_dim(x: Tensor, indices: Tensor, dim: int) -> Tensor:
    return gather(x, dim, indices)


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """out = x, then out[index[i][j]][j] += src[i][j] for dim 0 (torch.scatter_add)."""
    _check_index("scatter_add", x, index)
    _check_devices("scatter_add", [x, src])
    axis = normalize_dim("scatter_add", dim, x.ndim)
    check_bounds("scatter_add", index, x.shape[axis], axis)
    if index.ndim != x.ndim or src.ndim != x.ndim or any(
            i > s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != axis) or any(
            i > s for i, s in zip(index.shape, src.shape)):
        raise ShapeError(f"scatter_add: index {index.shape} and src {src.shape} do not fit input {x.shape} "
                         f"along dim {dim}")
    if src.dtype is not x.dtype:
        raise DTypeError(f"scatter_add: src dtype {src.dtype.name} must match input dtype {x.dtype.name}")
    if src.shape != index.shape:
        for d, n in enumerate(index.shape):
            if src.shape[d] != n:
                src = slice_axis(src, d, 0, n)
    return apply(Op.SCATTER_ADD, x, cast(index, dtypes.int64), src, axis=axis)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    _check_index("index_select", x, index)
    if index.ndim > 1:
        raise ShapeError(f"index_select: index must be 1-d, got shape {index.shape}")
    axis = normalize_dim("index_select", dim, x.ndim)
    check_bounds("index_select", index, x.shape[axis], axis)
    index = reshape(index, (-1,))
    shape = list(x.shape)
    shape[axis] = index.shape[0]
    view = [1] * x.ndim
    view[axis] = index.shape[0]
    return gather(x, axis, expand(reshape(index, tuple(view)), tuple(shape)))


def embedding(index: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of `weight` picked by `index`; the output has shape index.shape + (embedding_dim,)."""
    if not isinstance(index, Tensor) or not index.dtype.is_integer:
        raise DTypeError(f"embedding: indices must be an integer tensor, got {operands(index)}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-d (num_embeddings, dim), got shape {weight.shape}")
    check_bounds("embedding", index, weight.shape[0], 0)
    rows = index_select(weight, 0, reshape(index, (-1,)))
    if padding_idx is not None:
        keep = reshape(reshape(index, (-1,)) != padding_idx % weight.shape[0], (-1, 1))
        rows = where(keep, rows, rows.detach())  # torch reads the padding row as is; only its gradient stops
    return reshape(rows, index.shape + (weight.shape[1],))


def one_hot(index: Tensor, num_classes: int = -1) -> Tensor:
    """int64 one-hot encoding; num_classes=-1 reads the largest index (a sync point)."""
    if not isinstance(index, Tensor) or not index.dtype.is_integer:
        raise DTypeError(f"one_hot: expects an integer tensor, got {operands(index)}")
    if num_classes == -1:
        num_classes = int(index.max().item()) + 1 if index.numel() else 0
    classes = arange(num_classes, device=index.device)
    return cast(reshape(index, index.shape + (1,)) == classes, dtypes.int64)


# -- the index primitives -----------------------------------------------------------------------------
# Each primitive's rules side by side: shape and dtype, VJP, and reference implementation (NumPy, half
# types computed in float32, the `axis` attribute as a keyword).

def _gather_vjp(g, xs, out, a):
    x, index = xs
    axis = a["axis"]
    same_elsewhere = all(i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != axis)
    if index.shape[axis] == 1 and same_elsewhere:
        # one pick per row (cross entropy, max with indices): a pointwise select, no scatter
        positions = arange(x.shape[axis], device=g.device).reshape(
            tuple(x.shape[axis] if d == axis else 1 for d in range(x.ndim)))
        return where(positions == index.expand(x.shape), g.expand(x.shape), 0), None
    base = zeros(x.shape, dtype=g.dtype, device=g.device)
    return apply(Op.SCATTER_ADD, base, index, g, axis=axis), None


def _scatter_add_vjp(g, xs, out, a):
    _, index, _ = xs
    return g, None, apply(Op.GATHER, g, index, axis=a["axis"])


def _np_gather(x: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    # torch.gather lets the index be smaller than the input along the other axes
    x = x[tuple(slice(0, s) if d != axis else slice(None) for d, s in enumerate(index.shape))]
    _np_check_bounds(index, x.shape[axis], "gather")
    return np.take_along_axis(x, index, axis)


def _np_scatter_add(base: np.ndarray, index: np.ndarray, src: np.ndarray, axis: int) -> np.ndarray:
    _np_check_bounds(index, base.shape[axis], "scatter_add")
    out = base.copy()
    where = list(np.indices(index.shape, sparse=True))
    where[axis] = index
    src = src[tuple(slice(0, s) for s in index.shape)]
    np.add.at(out, tuple(where), src)
    return out


def _np_check_bounds(index: np.ndarray, size: int, op: str) -> None:
    """An index computed in the graph is checked when it is used."""
    if index.size and (index.min() < 0 or index.max() >= size):
        bad = index[(index < 0) | (index >= size)].flat[0]
        raise IndexError(f"{op}: index {bad} is out of bounds for a dimension of size {size}")


define(Op.GATHER, shape=lambda inputs, attrs: (inputs[1].shape, inputs[0].dtype), vjp=_gather_vjp,
       reference=_np_gather)
define(Op.SCATTER_ADD, shape=lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype), vjp=_scatter_add_vjp,
       reference=_np_scatter_add)
