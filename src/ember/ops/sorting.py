"""Sorting: sort, argsort and topk, as torch's; at the end, the ARGSORT primitive's rules.

One primitive computes the order (ARGSORT: int64 positions along an axis, never differentiated); the values are
read at those positions with GATHER, so their gradient is gather's (a scatter back to where each value came
from), and topk is the first k positions of the order. ARGSORT is always stable: equal keys keep their order,
which is one of the orders torch's `stable=False` allows. NaN sorts as the largest value, as in torch. On the
cpu device the reference backend sorts with NumPy; on cuda the vendor's sort (torch.sort) runs it, as the
convolutions run through cuDNN.
"""

from __future__ import annotations

import operator
from collections import namedtuple

import numpy as np

from ember import dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import NOT_DIFFERENTIABLE, define
from ember.ops.creation import zeros
from ember.ops.index import gather_in_range
from ember.ops.movement import normalize_dim, slice_axis
from ember.tensor import Tensor, apply, expect_tensors

Sorted = namedtuple("Sorted", ["values", "indices"])  # torch.return_types.sort and .topk


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    """The int64 positions that sort `x` along `dim`; ties keep their order whether or not `stable` is asked."""
    expect_tensors("argsort", input=x)
    axis = normalize_dim("argsort", dim, x.ndim)
    if x.ndim == 0:
        return zeros((), dtype=dtypes.int64, device=x.device)
    return apply(Op.ARGSORT, x, axis=axis, descending=bool(descending))


def sort(x: Tensor, dim: int = -1, descending: bool = False, *, stable: bool = False) -> Sorted:
    """(values, indices): `x` sorted along `dim`, and where each value came from."""
    expect_tensors("sort", input=x)
    indices = argsort(x, dim, descending, stable)
    if x.ndim == 0:
        return Sorted(x, indices)
    return Sorted(gather_in_range(x, normalize_dim("sort", dim, x.ndim), indices), indices)


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Sorted:  # noqa: A002
    """(values, indices) of the k largest (`largest=False`: smallest) elements along `dim`, in sorted order
    (`sorted=False` leaves the order to the implementation, as in torch: ember's is sorted too). Which of equal
    elements are chosen is unspecified in torch; ember chooses the first."""
    expect_tensors("topk", input=x)
    axis = normalize_dim("topk", dim, x.ndim)
    k = operator.index(k)
    size = x.shape[axis] if x.ndim else 1
    if not 0 <= k <= size:
        raise ShapeError(f"topk: selected index k out of range: k={k} for dim {dim} of size {size} "
                         f"(input {operands(x)}); k must be in [0, {size}]")
    if x.dtype is dtypes.bool_:
        raise DTypeError(f"topk: does not support bool tensors, got {operands(x)}; convert it with .to(ember.uint8)")
    if x.ndim == 0:  # torch gives the scalar itself, for k 0 and 1 alike
        return Sorted(x, zeros((), dtype=dtypes.int64, device=x.device))
    indices = slice_axis(apply(Op.ARGSORT, x, axis=axis, descending=bool(largest)), axis, 0, k)
    return Sorted(gather_in_range(x, axis, indices), indices)


# -- the ARGSORT primitive ----------------------------------------------------------------------------
# Its rules side by side: shape and dtype (the input's shape, int64), VJP (none: positions), and reference
# implementation (NumPy's stable sort, half types compared in float32). Its lowering for cuda is the vendor's
# sort (runtime/launcher.py), which the planner runs as a call of its own, like a convolution.

def _np_argsort(x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """NumPy sorts NaN last and keeps equal keys in order. Descending is the ascending order of the reversed
    keys, reversed: NaN first, equal keys still in order (negating the keys would keep NaN last, and
    overflow the smallest integer)."""
    if not descending:
        return np.argsort(x, axis=axis, kind="stable")
    reversed_order = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
    return x.shape[axis] - 1 - np.flip(reversed_order, axis)


define(Op.ARGSORT, shape=lambda inputs, attrs: (inputs[0].shape, dtypes.int64), vjp=NOT_DIFFERENTIABLE,
       reference=_np_argsort)
