"""ONNX's reductions, arg-extrema, softmaxes, cumulative sums and products, and Det as ember ops.

A reduction's axes are an attribute before opset 18 (ReduceSum: 13) and an input after; an empty axis list
reduces everything unless `noop_with_empty_axes`. A reduction over no elements gives the operation's identity
(0 for a sum, -inf for a max ...), as ONNX's reference does.
"""

from __future__ import annotations

import math

import numpy as np

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext
from ember.frontends.onnx.tensors import slice_axis


def _reduction(fn, empty, since_input: int = 18):
    """An ONNX reduction from `fn(x, dims, keepdim)`; `empty(dtype)` is its value over no elements."""
    def reduce(n: NodeContext, x, axes=None):
        axes = n.attr("axes") if n.opset < since_input else n.ints(axes)
        keep = bool(n.attr("keepdims", 1))
        if not axes:
            if n.attr("noop_with_empty_axes", 0):
                return x
            axes = list(range(x.ndim))
        dims = tuple(sorted(a % x.ndim for a in axes)) if x.ndim else ()
        if any(x.shape[d] == 0 for d in dims):
            shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape) if keep or i not in dims)
            return ember.full(shape, empty(x.dtype), dtype=x.dtype, device=x.device)
        return fn(x, dims, keep) if dims else x
    return reduce


def _lowest(dtype):
    if dtype is dtypes.bool_:
        return False
    return -math.inf if dtype.is_floating_point else np.iinfo(dtype.np).min


def _highest(dtype):
    if dtype is dtypes.bool_:
        return True
    return math.inf if dtype.is_floating_point else np.iinfo(dtype.np).max


def _log_sum_exp(x, dims, keep):
    peak = x.amax(dims, keepdim=True)
    peak = ember.where(ember.isinf(peak), ember.zeros_like(peak), peak)
    out = ember.log(ember.exp(x - peak).sum(dims, keepdim=True)) + peak
    return out if keep else out.reshape(tuple(s for i, s in enumerate(x.shape) if i not in dims))


_REDUCTIONS = {
    "ReduceSum": _reduction(lambda x, d, k: x.sum(d, keepdim=k), lambda t: 0, since_input=13),
    "ReduceMean": _reduction(lambda x, d, k: x.mean(d, keepdim=k), lambda t: math.nan),
    "ReduceMax": _reduction(lambda x, d, k: x.amax(d, keepdim=k), _lowest),
    "ReduceMin": _reduction(lambda x, d, k: x.amin(d, keepdim=k), _highest),
    "ReduceProd": _reduction(lambda x, d, k: _prod(x, d, k), lambda t: 1),
    "ReduceL1": _reduction(lambda x, d, k: ember.abs(x).sum(d, keepdim=k), lambda t: 0),
    "ReduceL2": _reduction(lambda x, d, k: _root((x * x).sum(d, keepdim=k)), lambda t: 0),
    "ReduceSumSquare": _reduction(lambda x, d, k: (x * x).sum(d, keepdim=k), lambda t: 0),
    "ReduceLogSum": _reduction(lambda x, d, k: ember.log(x.sum(d, keepdim=k)), lambda t: -math.inf),
    "ReduceLogSumExp": _reduction(_log_sum_exp, lambda t: -math.inf),
}


def _prod(x, dims, keep: bool):
    for d in reversed(dims):  # the last first, so that the others keep their positions
        x = x.prod(d, keepdim=keep)
    return x


def _root(x):
    return ember.sqrt(x) if x.dtype.is_floating_point else ember.sqrt(x.to(dtypes.float64)).round().to(x.dtype)


def _arg(largest: bool):
    def arg(n: NodeContext, x):
        axis = n.attr("axis", 0) % max(x.ndim, 1)
        keep = bool(n.attr("keepdims", 1))
        last = n.attr("select_last_index", 0)
        source = x.flip((axis,)) if last else x
        index = source.argmax(axis, keepdim=keep) if largest else source.argmin(axis, keepdim=keep)
        return x.shape[axis] - 1 - index if last else index
    return arg


def _softmax(kind: str):
    def softmax(n: NodeContext, x):
        if n.opset < 13:  # the input seen as a matrix [prod(shape[:axis]), prod(shape[axis:])]
            axis = n.attr("axis", 1) % max(x.ndim, 1)
            rows = x.reshape(math.prod(x.shape[:axis]), -1)
            return _normalize(kind, rows, 1).reshape(x.shape)
        return _normalize(kind, x, n.attr("axis", -1) % max(x.ndim, 1))
    return softmax


def _normalize(kind: str, x, axis: int):
    if kind == "softmax":
        return ember.softmax(x, axis)
    if kind == "log_softmax":
        return ember.log_softmax(x, axis)
    first = x.argmax(axis, keepdim=True)
    positions = ember.arange(x.shape[axis], dtype=dtypes.int64, device=x.device)
    positions = positions.reshape(tuple(x.shape[axis] if i == axis else 1 for i in range(x.ndim)))
    return (positions == first).to(x.dtype)


def _cumulative(product: bool):
    def cumulative(n: NodeContext, x, axis):
        axis = n.ints(axis)[0] % x.ndim
        if n.attr("reverse", 0):
            x = x.flip((axis,))
        out = _cumprod(x, axis) if product else x.cumsum(axis).to(x.dtype)  # ember sums integers in int64
        if n.attr("exclusive", 0):
            identity = ember.ones_like(slice_axis(x, axis, 0, 1, 1)) if product else \
                ember.zeros_like(slice_axis(x, axis, 0, 1, 1))
            out = ember.cat([identity, slice_axis(out, axis, 0, x.shape[axis] - 1, 1)], axis)
        return out.flip((axis,)) if n.attr("reverse", 0) else out
    return cumulative


def _cumprod(x, axis: int):
    """A running product, one step per position (ember has a cumulative sum, and a product through logarithms
    would lose signs and zeros)."""
    running = slice_axis(x, axis, 0, 1, 1)
    steps = [running]
    for i in range(1, x.shape[axis]):
        running = running * slice_axis(x, axis, i, i + 1, 1)
        steps.append(running)
    return ember.cat(steps, axis) if len(steps) > 1 else running


def _det(n: NodeContext, x):
    """Det of (a batch of) square matrices: Gaussian elimination with partial pivoting, unrolled over the columns;
    the determinant is the pivots' product, its sign flipped per row swap."""
    size = x.shape[-1]
    a = x.reshape(-1, size, size)
    rows = ember.arange(size, dtype=dtypes.int64, device=x.device).reshape(1, size, 1)
    sign = ember.ones((a.shape[0],), dtype=x.dtype, device=x.device)
    for k in range(size):
        below = ember.abs(a[:, k:, k])
        pivot = (below.argmax(1) + k).reshape(-1, 1, 1)
        order = ember.where(rows == k, pivot, ember.where(rows == pivot, ember.full_like(pivot, k), rows))
        a = ember.gather(a, 1, order.expand(*a.shape))
        sign = ember.where(pivot.reshape(-1) != k, -sign, sign)
        head = a[:, k:k + 1, k:k + 1]
        safe = ember.where(head == 0, ember.ones_like(head), head)
        factors = ember.where((rows > k) & (head != 0), a[:, :, k:k + 1] / safe, ember.zeros_like(a[:, :, k:k + 1]))
        a = a - factors * a[:, k:k + 1, :]
    diagonal = ember.stack([a[:, i, i] for i in range(size)], 1)
    return (sign * diagonal.prod(1)).reshape(x.shape[:-2])


def _tfidf(n: NodeContext, x):
    """TfIdfVectorizer over integers: each pool n-gram's count in each row (at every skip distance up to
    max_skip_count + 1; a unigram once), as matches of shifted slices summed, then weighed by the mode."""
    if n.attr("pool_strings"):
        raise n.unsupported("a pool of strings (ember tensors hold numbers)")
    pool, starts = n.attr("pool_int64s"), list(n.attr("ngram_counts"))
    indexes, weights = n.attr("ngram_indexes"), n.attr("weights")
    low, high, skips = n.attr("min_gram_length"), n.attr("max_gram_length"), n.attr("max_skip_count")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    length = rows.shape[1]
    grams = []
    for size, (start, end) in enumerate(zip(starts, [*starts[1:], len(pool)]), 1):
        grams += [pool[i:i + size] for i in range(start, end, size)]
    counts = [None] * (max(indexes) + 1)
    for p, gram in enumerate(grams):
        count = ember.zeros((rows.shape[0],), dtype=dtypes.float32, device=x.device)
        if low <= len(gram) <= high:
            for distance in range(1, (skips + 1 if len(gram) > 1 else 1) + 1):
                span = length - (len(gram) - 1) * distance
                if span <= 0:
                    continue
                match = None
                for j, token in enumerate(gram):
                    hit = rows[:, j * distance:j * distance + span] == n.const(token, rows)
                    match = hit if match is None else match & hit
                count = count + match.to(dtypes.float32).sum(1)
        weight = weights[p] if weights else 1.0
        mode = n.attr("mode")
        counts[indexes[p]] = count if mode == "TF" else (count > 0).to(dtypes.float32) * weight if mode == "IDF" \
            else count * weight
    zero = ember.zeros((rows.shape[0],), dtype=dtypes.float32, device=x.device)
    out = ember.stack([zero if c is None else c for c in counts], 1)
    return out.reshape(-1) if x.ndim == 1 else out


OPS = {
    **_REDUCTIONS, "ArgMax": _arg(True), "ArgMin": _arg(False), "Softmax": _softmax("softmax"),
    "LogSoftmax": _softmax("log_softmax"), "Hardmax": _softmax("hardmax"), "CumSum": _cumulative(False),
    "CumProd": _cumulative(True), "Det": _det, "TfIdfVectorizer": _tfidf,
}
