"""ONNX's shape, movement, creation and indexing operators as ember ops.

Shapes, axes, sizes and counts that ONNX passes as tensors are read as numbers (`NodeContext.ints`); the data
stays lazy. The operators whose output shape depends on data (NonZero, Unique, NonMaxSuppression, Compress's
condition, Range) compute that part now, as ONNX graphs that use them compute it on the host too; so do the
reductions of ScatterElements/ScatterND other than none and add, which read their indices to schedule rounds.
"""

from __future__ import annotations

import math

import numpy as np

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext
from ember.tensor import Tensor


def axis_index(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def axes_of(n: NodeContext, axes_input: Tensor | None, since_input: int) -> list[int] | None:
    """The `axes` of an op that took them as an attribute before opset `since_input`, as an input from then on."""
    return n.attr("axes") if n.opset < since_input else n.ints(axes_input)


def _constant(n: NodeContext):
    for name in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if name in n.attrs:
            value = n.attrs[name]
            kind = np.float32 if name.startswith("value_float") else np.int64 if name.startswith("value_int") \
                else None
            return n.const(np.asarray(value, dtype=kind))
    raise n.unsupported(f"a constant given as {sorted(n.attrs)} (strings and sparse values are not held)")


def _shape(n: NodeContext, x):
    dims = x.shape[slice(n.attr("start", 0), n.attr("end"))]
    return n.const(np.array(dims, dtype=np.int64))


def _reshape(n: NodeContext, x, shape=None):
    target = n.attr("shape") if n.opset < 5 else n.ints(shape)
    if not n.attr("allowzero", 0):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(tuple(target))


def _flatten(n: NodeContext, x):
    axis = axis_index(n.attr("axis", 1), x.ndim)
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _squeeze(n: NodeContext, x, axes=None):
    axes = axes_of(n, axes, 13)
    axes = [i for i, d in enumerate(x.shape) if d == 1] if axes is None else [axis_index(a, x.ndim) for a in axes]
    return x.reshape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _unsqueeze(n: NodeContext, x, axes=None):
    axes = axes_of(n, axes, 13)
    rank = x.ndim + len(axes)
    axes = sorted(axis_index(a, rank) for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return x.reshape(tuple(shape))


def _transpose(n: NodeContext, x):
    perm = n.attr("perm") or list(reversed(range(x.ndim)))
    return x.permute(*perm)


def _concat(n: NodeContext, *xs):
    axis = axis_index(n.attr("axis", 0), xs[0].ndim)
    kept = [x for x in xs if x.shape[axis] > 0] or list(xs[:1])
    return ember.cat(kept, axis) if len(kept) > 1 else kept[0]


def _split(n: NodeContext, x, split=None):
    axis = axis_index(n.attr("axis", 0), x.ndim)
    sizes = n.attr("split") if n.opset < 13 else n.ints(split)
    count = n.attr("num_outputs") or len(n.node.output)
    if not sizes:
        size = x.shape[axis]
        each = -(-size // count)
        sizes = [min(each, size - i * each) for i in range(count)]
    return tuple(_narrow(x, axis, start, size) for start, size in zip(np.cumsum([0, *sizes[:-1]]), sizes))


def _narrow(x, axis: int, start: int, size: int):
    index = [slice(None)] * x.ndim
    index[axis] = slice(int(start), int(start) + int(size))
    return x[tuple(index)]


def _slice(n: NodeContext, x, starts=None, ends=None, axes=None, steps=None):
    if n.opset < 10:
        starts, ends, axes, steps = n.attr("starts"), n.attr("ends"), n.attr("axes"), None
    else:
        starts, ends, axes, steps = n.ints(starts), n.ints(ends), n.ints(axes), n.ints(steps)
    axes = list(range(len(starts))) if axes is None else [axis_index(a, x.ndim) for a in axes]
    steps = steps or [1] * len(starts)
    for axis, start, end, step in zip(axes, starts, ends, steps):
        x = slice_axis(x, axis, start, end, step)
    return x


def slice_axis(x, axis: int, start: int, end: int, step: int):
    """x[start:end:step] along `axis`, with Python's clamping of out-of-range bounds (ONNX's too)."""
    size = x.shape[axis]
    picked = range(size)[slice(max(min(start, 2**62), -2**62), max(min(end, 2**62), -2**62), step)]
    index = [slice(None)] * x.ndim
    if len(picked) == 0:
        index[axis] = slice(0, 0)
        return x[tuple(index)]
    if step < 0:
        x = x.flip((axis,))
        index[axis] = slice(size - 1 - picked[0], size - picked[-1], -step)
    else:
        index[axis] = slice(picked[0], picked[-1] + 1, step)
    return x[tuple(index)]


def _positive(index: Tensor, size: int) -> Tensor:
    """ONNX's negative indices count from the end."""
    return ember.where(index < 0, index + size, index)


def _gather(n: NodeContext, x, index):
    axis = axis_index(n.attr("axis", 0), x.ndim)
    index = _positive(index.to(dtypes.int64), x.shape[axis])
    flat = x.index_select(axis, index.reshape(-1))
    return flat.reshape(x.shape[:axis] + index.shape + x.shape[axis + 1:])


def _gather_elements(n: NodeContext, x, index):
    axis = axis_index(n.attr("axis", 0), x.ndim)
    return ember.gather(x, axis, _positive(index.to(dtypes.int64), x.shape[axis]))


def _nd_positions(x, index, batch_dims: int):
    """GatherND/ScatterND: each index row's linear position in `x`'s indexed dimensions (flattened with the batch
    dimensions), and the shape of the slices it names."""
    k = index.shape[-1]
    indexed = x.shape[batch_dims:batch_dims + k]
    strides = [math.prod(indexed[i + 1:]) for i in range(k)]
    index = index.to(dtypes.int64)
    linear = None
    for i, (size, stride) in enumerate(zip(indexed, strides)):
        term = _positive(index[..., i], size) * stride
        linear = term if linear is None else linear + term
    batch = math.prod(x.shape[:batch_dims])
    linear = linear.reshape(batch, -1)
    offsets = ember.arange(batch, dtype=dtypes.int64, device=x.device).reshape(batch, 1) * math.prod(indexed)
    return (linear + offsets).reshape(-1), x.shape[batch_dims + k:]


def _gather_nd(n: NodeContext, x, index):
    batch_dims = n.attr("batch_dims", 0)
    positions, rest = _nd_positions(x, index, batch_dims)
    rows = x.reshape(-1, *rest).index_select(0, positions)
    return rows.reshape(*index.shape[:-1], *rest)


def _scattered(base, axis: int, index, updates, reduction: str, n: NodeContext):
    if reduction == "add":
        return ember.scatter_add(base, axis, index, updates)
    if reduction == "none":
        return _placed(base, axis, index, updates)
    combine = {"mul": ember.mul, "max": ember.maximum, "min": ember.minimum}.get(reduction)
    if combine is None:
        raise n.unsupported(f"reduction={reduction!r}")
    # ember scatters by adding: each round scatters at most one update per position (the k-th of those aimed at
    # it, found from the index's values now) and combines it where one landed
    positions = np.indices(index.shape)
    positions[axis] = n.static(index)
    targets = np.ravel_multi_index(tuple(positions), base.shape).reshape(-1)
    order = np.argsort(targets, kind="stable")
    first = np.searchsorted(targets[order], targets[order])
    rank = np.empty_like(targets)
    rank[order] = np.arange(len(targets)) - first
    out = base
    for k in range(int(rank.max()) + 1 if rank.size else 0):
        chosen = n.const((rank == k).reshape(index.shape))
        landed = ember.scatter_add(ember.zeros(base.shape, dtype=dtypes.int32, device=base.device), axis, index,
                                   chosen.to(dtypes.int32)) > 0
        value = ember.scatter_add(ember.zeros(base.shape, dtype=base.dtype, device=base.device), axis, index,
                                  ember.where(chosen, updates, ember.zeros_like(updates)))
        out = ember.where(landed, combine(out, value), out)
    return out


def _placed(base, axis: int, index, updates):
    """base with the updates at the positions the index names (ONNX leaves repeated positions undefined)."""
    zeros = ember.zeros(base.shape, dtype=base.dtype, device=base.device)
    hit = ember.scatter_add(ember.zeros(base.shape, dtype=dtypes.int32, device=base.device), axis, index,
                            ember.ones(index.shape, dtype=dtypes.int32, device=base.device)) > 0
    return ember.where(hit, ember.scatter_add(zeros, axis, index, updates), base)


def _scatter_elements(n: NodeContext, x, index, updates):
    axis = axis_index(n.attr("axis", 0), x.ndim)
    index = _positive(index.to(dtypes.int64), x.shape[axis])
    return _scattered(x, axis, index, updates, n.attr("reduction", "none"), n)


def _scatter_nd(n: NodeContext, x, index, updates):
    positions, rest = _nd_positions(x, index, 0)
    rows = x.reshape(-1, *rest)
    updates = updates.reshape(-1, *rest)
    spread = positions.reshape(-1, *([1] * len(rest))).expand(*updates.shape)
    return _scattered(rows, 0, spread, updates, n.attr("reduction", "none"), n).reshape(x.shape)


def _expand(n: NodeContext, x, shape):
    target = n.ints(shape)
    return x.expand(*ember.broadcast_shapes(x.shape, tuple(target)))


def _tile(n: NodeContext, x, repeats):
    return x.repeat(*n.ints(repeats)) if x.ndim else x


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _pad(n: NodeContext, x, pads=None, value=None, axes=None):
    mode = n.attr("mode", "constant")
    if n.opset < 11:
        pads, fill, axes = n.attr("pads", n.attr("paddings")), n.attr("value", 0.0), None
    else:
        pads, axes = n.ints(pads), n.ints(axes)
        fill = 0 if value is None else np.asarray(n.static(value)).reshape(-1)[0].item()
    axes = list(range(x.ndim)) if axes is None else [axis_index(a, x.ndim) for a in axes]
    before, after = [0] * x.ndim, [0] * x.ndim
    for i, axis in enumerate(axes):
        before[axis], after[axis] = pads[i], pads[i + len(axes)]
    for axis in range(x.ndim):  # negative pads crop
        if before[axis] < 0 or after[axis] < 0:
            x = slice_axis(x, axis, max(-before[axis], 0), x.shape[axis] - max(-after[axis], 0), 1)
    torch_pads = []
    for axis in reversed(range(x.ndim)):
        torch_pads += [max(before[axis], 0), max(after[axis], 0)]
    if not any(torch_pads):
        return x
    if mode == "constant":
        return ember.pad(x, torch_pads, value=fill)
    return _pad_by_axis(x, before, after, _PAD_MODES[mode])


def _pad_by_axis(x, before, after, mode: str):
    """reflect / edge / wrap padding, one axis at a time by gathering (ember's pad modes take the last 3 axes)."""
    for axis in range(x.ndim):
        lo, hi = max(before[axis], 0), max(after[axis], 0)
        if not lo and not hi:
            continue
        size = x.shape[axis]
        positions = np.arange(-lo, size + hi)
        if mode == "replicate":
            positions = np.clip(positions, 0, size - 1)
        elif mode == "circular":
            positions = positions % size
        else:
            period = 2 * (size - 1)
            positions = np.abs(positions) % period if period else np.zeros_like(positions)
            positions = np.where(positions >= size, period - positions, positions)
        x = x.index_select(axis, ember.tensor(positions.astype(np.int64), device=x.device))
    return x


def _constant_of_shape(n: NodeContext, shape):
    value = n.attr("value", np.zeros(1, np.float32))
    dims = tuple(n.ints(shape))
    return n.const(np.full(dims, np.asarray(value).reshape(-1)[0], dtype=np.asarray(value).dtype))


def _range(n: NodeContext, start, limit, delta):
    values = [np.asarray(n.static(v)).reshape(-1)[0] for v in (start, limit, delta)]
    return n.const(np.arange(*values, dtype=values[0].dtype))


def _eye_like(n: NodeContext, x):
    dtype = x.dtype.np if n.attr("dtype") is None else n.dtype_of(n.attr("dtype")).np
    return n.const(np.eye(x.shape[0], x.shape[1], k=n.attr("k", 0), dtype=dtype))


def _one_hot(n: NodeContext, index, depth, values):
    depth = int(np.asarray(n.static(depth)).reshape(-1)[0])
    index = index if index.dtype.is_integer else index.to(dtypes.int64)
    index = _positive(index.to(dtypes.int64), depth)
    axis = axis_index(n.attr("axis", -1), index.ndim + 1)
    shape = [1] * (index.ndim + 1)
    shape[axis] = depth
    positions = ember.arange(depth, dtype=dtypes.int64, device=index.device).reshape(tuple(shape))
    hot = index.unsqueeze(axis) == positions
    return ember.where(hot, values[1], values[0])


def _non_zero(n: NodeContext, x):
    return n.const(np.array(np.nonzero(n.static(x)), dtype=np.int64).reshape(x.ndim, -1))


def _unique(n: NodeContext, x):
    axis = n.attr("axis")
    array = n.static(x)
    values, first, inverse, counts = np.unique(array, return_index=True, return_inverse=True, return_counts=True,
                                               axis=axis, equal_nan=False)
    if not n.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        rank = np.argsort(order)
        values = np.take(values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
    return (n.const(values), n.const(first.astype(np.int64)), n.const(inverse.reshape(-1).astype(np.int64)),
            n.const(counts.astype(np.int64)))


def _non_max_suppression(n: NodeContext, boxes, scores, max_boxes=None, iou_threshold=None, score_threshold=None):
    """The boxes kept by greedy non-maximum suppression, per batch and class, as [batch, class, box] rows: computed
    now, as the output's length depends on the data."""
    boxes, scores = np.asarray(n.static(boxes), np.float64), np.asarray(n.static(scores), np.float64)
    limit = 0 if max_boxes is None else int(np.asarray(n.static(max_boxes)).reshape(-1)[0])
    overlap = 0.0 if iou_threshold is None else float(np.asarray(n.static(iou_threshold)).reshape(-1)[0])
    floor = None if score_threshold is None else float(np.asarray(n.static(score_threshold)).reshape(-1)[0])
    if n.attr("center_point_box", 0):
        centre, size = boxes[..., :2], boxes[..., 2:]
        low, high = centre - size / 2, centre + size / 2
    else:
        low, high = np.minimum(boxes[..., :2], boxes[..., 2:]), np.maximum(boxes[..., :2], boxes[..., 2:])
    area = np.prod(high - low, -1)
    kept = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            chosen: list[int] = []
            for i in np.argsort(-scores[b, c], kind="stable"):
                if len(chosen) >= limit or (floor is not None and scores[b, c, i] <= floor):
                    break
                inner = np.clip(np.minimum(high[b, i], high[b, chosen]) - np.maximum(low[b, i], low[b, chosen]),
                                0, None).prod(-1)
                union = area[b, i] + area[b, chosen] - inner
                if not np.any(inner > overlap * union):
                    chosen.append(int(i))
            kept += [(b, c, i) for i in chosen]
    return n.const(np.array(kept, dtype=np.int64).reshape(-1, 3))


def _compress(n: NodeContext, x, condition):
    kept = np.nonzero(np.asarray(n.static(condition)).reshape(-1))[0]
    axis = n.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = axis_index(axis, x.ndim)
    kept = kept[kept < x.shape[axis]]
    return x.index_select(axis, n.const(kept.astype(np.int64)))


def _trilu(n: NodeContext, x, k=None):
    k = 0 if k is None else n.ints(k)[0]
    return x.triu(k) if n.attr("upper", 1) else x.tril(k)


def _depth_to_space(n: NodeContext, x):
    b, c, h, w = x.shape
    s = n.attr("blocksize")
    if n.attr("mode", "DCR") == "DCR":
        y = x.reshape(b, s, s, c // (s * s), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(b, c // (s * s), s, s, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(b, c // (s * s), h * s, w * s)


def _space_to_depth(n: NodeContext, x):
    b, c, h, w = x.shape
    s = n.attr("blocksize")
    y = x.reshape(b, c, h // s, s, w // s, s)
    y = y.permute(0, 1, 3, 5, 2, 4) if n.attr("mode", "DCR") == "CRD" else y.permute(0, 3, 5, 1, 2, 4)
    return y.reshape(b, c * s * s, h // s, w // s)


def _reverse_sequence(n: NodeContext, x, lengths):
    time, batch = n.attr("time_axis", 0), n.attr("batch_axis", 1)
    lengths = np.asarray(n.static(lengths))
    steps = np.arange(x.shape[time])[:, None]
    source = np.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)  # [time, batch]
    shape = [1] * x.ndim
    shape[time], shape[batch] = x.shape[time], x.shape[batch]
    order = source if time < batch else source.T
    index = n.const(order.reshape(shape).astype(np.int64)).expand(*x.shape)
    return ember.gather(x, time, index)


def _gemm(n: NodeContext, a, b, c=None):
    a = a.transpose(0, 1) if n.attr("transA", 0) else a
    b = b.transpose(0, 1) if n.attr("transB", 0) else b
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    out = a @ b
    out = out * alpha if alpha != 1 else out
    if c is None:
        return out
    return out + (c * beta if beta != 1 else c)


def _top_k(n: NodeContext, x, k=None):
    k = n.attr("k") if n.opset < 10 else n.ints(k)[0]
    axis = axis_index(n.attr("axis", -1), x.ndim)
    order = ember.argsort(x, axis, descending=bool(n.attr("largest", 1)))  # ties: the lower index first
    index = slice_axis(order, axis, 0, k, 1)
    return ember.gather(x, axis, index), index


def _size(n: NodeContext, x):
    return n.const(np.array(x.numel(), dtype=np.int64))


def _tensor_scatter(n: NodeContext, cache, update, write=None):
    """TensorScatter: the update written into the cache along `axis` from each batch's write index (wrapping
    around in circular mode)."""
    axis = axis_index(n.attr("axis", -2), cache.ndim)
    batch, length = cache.shape[0], update.shape[axis]
    start = ember.zeros((batch,), dtype=dtypes.int64, device=cache.device) if write is None else write.to(dtypes.int64)
    shape = [1] * cache.ndim
    shape[0], shape[axis] = batch, length
    steps = [1] * cache.ndim
    steps[axis] = length
    positions = start.reshape(batch, *([1] * (cache.ndim - 1))) + n.const(np.arange(length).reshape(steps))
    if n.attr("mode", "linear") == "circular":
        positions = ember.remainder(positions, cache.shape[axis])
    return _placed(cache, axis, positions.expand(*update.shape), update)


OPS = {
    "Constant": _constant, "Shape": _shape, "Size": _size, "Reshape": _reshape, "Flatten": _flatten,
    "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Transpose": _transpose, "Concat": _concat, "Split": _split,
    "Slice": _slice, "Gather": _gather, "GatherElements": _gather_elements, "GatherND": _gather_nd,
    "ScatterElements": _scatter_elements, "Scatter": _scatter_elements, "ScatterND": _scatter_nd,
    "Expand": _expand, "Tile": _tile, "Pad": _pad, "ConstantOfShape": _constant_of_shape, "Range": _range,
    "EyeLike": _eye_like, "OneHot": _one_hot, "NonZero": _non_zero, "NonMaxSuppression": _non_max_suppression,
    "Unique": _unique, "Compress": _compress,
    "Trilu": _trilu, "DepthToSpace": _depth_to_space, "SpaceToDepth": _space_to_depth,
    "ReverseSequence": _reverse_sequence, "Gemm": _gemm, "TopK": _top_k,
    "MatMul": lambda n, a, b: ember.matmul(a, b),
    "Einsum": lambda n, *xs: ember.einsum(n.attr("equation"), *xs), "TensorScatter": _tensor_scatter,
}
