"""Gather and scatter: embeddings, index_select, one_hot, and the core of integer indexing; at the end,
the GATHER, SCATTER_ADD and CHECK_INDEX primitives' rules.

An index that comes from data is checked against the dimension it picks along, naming the op the user called:
at the call where its values are known (data given on the cpu), else where it is computed (`checked`: a
CHECK_INDEX node, which the reference backend raises from and a generated kernel records for the next host
read). Negative indices wrap where torch wraps them (indexing, take_along_dim). The gathers and scatters below
`checked` read in-range indices only, or indices made in range by construction (vision's sample positions,
argmax's), and still clamp what they read."""

from __future__ import annotations

import math
import operator

import numpy as np

from ember import dtypes
from ember.errors import DTypeError, ShapeError, device_mismatch, index_out_of_bounds, operands
from ember.ir import Op
from ember.ir.ops import define
from ember.ops.creation import arange, tensor, zeros
from ember.ops.movement import broadcast_to, expand, normalize_dim, permute, reshape, slice_axis
from ember.ops.pointwise import _check_devices, broadcast_shapes, cast, converted, expand_to, where
from ember.tensor import Tensor, apply, expect_tensors


def _check_index(op: str, x: Tensor, index: Tensor) -> None:
    expect_tensors(op, input=x, index=index)
    if not index.dtype.is_integer:
        raise DTypeError(f"{op}: index must be an integer tensor (int64 or int32), got {operands(index)}")
    _check_devices(op, [x, index])


def checked(op: str, index: Tensor, size: int, dim: int, negative: bool = False) -> Tensor:
    """`index`, its values in [0, size) ([-size, size) with `negative`) or an IndexError from `op` naming the
    index, `dim` and `size`: at once when the values are known here (data given on the cpu), else when they
    are computed (the CHECK_INDEX node returned)."""
    buffer = index._node.buffer
    if isinstance(buffer, np.ndarray):
        _np_check_index(buffer, op, dim, size, negative)
        return index
    return apply(Op.CHECK_INDEX, index, op_name=op, dim=dim, size=size, negative=negative)


def wrapped(index: Tensor, size: int) -> Tensor:
    """A checked index in [-size, size) as a position in [0, size), as torch's indexing reads one."""
    return where(index < 0, index + size, index)


def _check_gather_shapes(op: str, x: Tensor, dim: int, axis: int, index: Tensor) -> None:
    if index.ndim != x.ndim or any(i > s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != axis):
        raise ShapeError(f"{op}: index of shape {index.shape} does not fit input of shape {x.shape} along "
                         f"dim {dim} (same number of dims, no larger outside dim {axis})")


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """out[i][j] = x[index[i][j]][j] for dim 0 (torch.gather)."""
    _check_index("gather", x, index)
    axis = normalize_dim("gather", dim, x.ndim)
    _check_gather_shapes("gather", x, dim, axis, index)
    return gather_in_range(x, axis, checked("gather", index, x.shape[axis], axis))


def gather_in_range(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """gather along `axis` of an index checked already, or in range by construction."""
    # int32 positions stay int32 (cheaper index arithmetic on the GPU) where every offset into x fits in int32;
    # other integer types, or a larger x, are widened
    small = index.dtype is dtypes.int32 and x.numel() < 2**31
    return apply(Op.GATHER, x, index if small else cast(index, dtypes.int64), axis=axis)


def take_along_dim(x: Tensor, indices: Tensor, dim: int) -> Tensor:
    """gather, with negative indices counted from the end, as torch.take_along_dim counts them."""
    _check_index("take_along_dim", x, indices)
    axis = normalize_dim("take_along_dim", dim, x.ndim)
    _check_gather_shapes("take_along_dim", x, dim, axis, indices)
    size = x.shape[axis]
    return gather_in_range(x, axis, wrapped(checked("take_along_dim", indices, size, axis, negative=True), size))


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """out = x, then out[index[i][j]][j] += src[i][j] for dim 0 (torch.scatter_add)."""
    _check_index("scatter_add", x, index)
    expect_tensors("scatter_add", src=src)
    _check_devices("scatter_add", [x, src])
    axis = normalize_dim("scatter_add", dim, x.ndim)
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
    return scatter_add_in_range(x, axis, checked("scatter_add", index, x.shape[axis], axis), src)


def scatter_add_in_range(x: Tensor, axis: int, index: Tensor, src: Tensor) -> Tensor:
    """scatter_add along `axis` of an index checked already, or in range by construction. One position per row
    (cross entropy's backward, one-hot codes) is a pointwise select, which fuses with what reads it: no buffer of
    x's size is written and read again."""
    if one_per_row(x, axis, index) and x.dtype is not dtypes.bool_:
        return where(picked(x, axis, index), x + src.expand(x.shape), x)
    return apply(Op.SCATTER_ADD, x, cast(index, dtypes.int64), src, axis=axis)


def one_per_row(x: Tensor, axis: int, index: Tensor) -> bool:
    """Whether `index` names one position of x per row along `axis`: of size 1 there, as large as x elsewhere."""
    return index.ndim == x.ndim > 0 and index.shape[axis] == 1 and all(
        i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != axis)


def picked(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """For an index of one position per row (`one_per_row`), whether each position of x is the one its row names."""
    positions = arange(x.shape[axis], device=x.device).reshape(
        tuple(x.shape[axis] if d == axis else 1 for d in range(x.ndim)))
    return positions == index.expand(x.shape)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    _check_index("index_select", x, index)
    if index.ndim > 1:
        raise ShapeError(f"index_select: index must be 1-d, got shape {index.shape}")
    axis = normalize_dim("index_select", dim, x.ndim)
    return select_in_range(x, axis, checked("index_select", index, x.shape[axis], axis))


def select_in_range(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """index_select along `axis` of an index checked already, or in range by construction."""
    index = reshape(index, (-1,))
    shape = list(x.shape)
    shape[axis] = index.shape[0]
    view = [1] * x.ndim
    view[axis] = index.shape[0]
    return gather_in_range(x, axis, expand(reshape(index, tuple(view)), tuple(shape)))


def embedding(index: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of `weight` picked by `index`; the output has shape index.shape + (embedding_dim,)."""
    expect_tensors("embedding", input=index, weight=weight)
    if not index.dtype.is_integer:
        raise DTypeError(f"embedding: indices must be an integer tensor, got {operands(index)}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-d (num_embeddings, dim), got shape {weight.shape}")
    rows = select_in_range(weight, 0, reshape(checked("embedding", index, weight.shape[0], 0), (-1,)))
    if padding_idx is not None:
        keep = reshape(reshape(index, (-1,)) != padding_idx % weight.shape[0], (-1, 1))
        rows = where(keep, rows, rows.detach())  # torch reads the padding row as is; only its gradient stops
    return reshape(rows, index.shape + (weight.shape[1],))


def one_hot(index: Tensor, num_classes: int = -1) -> Tensor:
    """int64 one-hot encoding; num_classes=-1 reads the largest index (a sync point)."""
    expect_tensors("one_hot", input=index)
    if not index.dtype.is_integer:
        raise DTypeError(f"one_hot: expects an integer tensor, got {operands(index)}")
    if num_classes == -1:
        num_classes = int(index.max().item()) + 1 if index.numel() else 0
    index = checked("one_hot", index, num_classes, index.ndim)
    classes = arange(num_classes, device=index.device)
    return cast(reshape(index, index.shape + (1,)) == classes, dtypes.int64)


# -- indexing -------------------------------------------------------------------------

def getitem(x: Tensor, index) -> Tensor:
    """NumPy/PyTorch indexing: ints, slices (any step), None, Ellipsis, bool and integer tensors."""
    if isinstance(index, Tensor) and index.dtype is dtypes.bool_ and index.ndim == 0:
        # a 0-d mask selects along a new dim of size 1: x[True] has shape (1, ...), x[False] (0, ...)
        return getitem(reshape(x, (1,) + x.shape), reshape(index, (1,)))
    items = _index_items(x, index)
    basic, advanced = [], []  # advanced: (position in the basic result, index tensor)
    dim = 0
    out_shape_pos = 0
    for item in items:
        if item is None:
            basic.append(None)
            out_shape_pos += 1
        elif isinstance(item, slice):
            basic.append(item)
            dim += 1
            out_shape_pos += 1
        elif isinstance(item, int):
            size = x.shape[dim]
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of bounds for dimension {dim} with size {size} "
                                 f"(tensor shape {x.shape})")
            basic.append(item % size)
            dim += 1
        else:  # an integer tensor
            basic.append(slice(None))
            advanced.append((out_shape_pos, item, x.shape[dim], dim))
            dim += 1
            out_shape_pos += 1
    x = _basic_index(x, basic)
    if advanced:
        x = _advanced_index(x, advanced)
    return x


def _index_items(x: Tensor, index) -> list:
    if not isinstance(index, tuple):
        index = (index,)
    items: list = []
    for item in index:
        if isinstance(item, bool):
            raise IndexError("indexing with a Python bool is not supported; use a bool tensor")
        if isinstance(item, (list,)) or (hasattr(item, "__array__") and not isinstance(item, Tensor)):
            item = tensor(item, device=x.device)
        if isinstance(item, Tensor):
            if item.dtype is dtypes.bool_:
                dim = sum(1 for i in items if i is not None)
                if Ellipsis not in items and item.shape != x.shape[dim:dim + item.ndim]:
                    raise IndexError(f"index: the shape {item.shape} of the bool mask at dim {dim} does not match "
                                     f"the indexed tensor's shape {x.shape}")
                items.extend(_bool_mask_indices(item))
                continue
            if not item.dtype.is_integer:
                raise IndexError(f"index: tensors used as indices must be integer or bool, got {operands(item)} "
                                 f"to index a tensor of shape {x.shape}")
            if item.device != x.device:
                raise device_mismatch("index", x, item)
        elif item is not None and item is not Ellipsis and not isinstance(item, slice):
            try:
                item = operator.index(item)
            except TypeError:
                raise IndexError(f"unsupported index {item!r} of type {type(item).__name__}") from None
        items.append(item)
    ellipses = sum(1 for i in items if i is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    if used > x.ndim:
        raise IndexError(f"too many indices for a tensor of shape {x.shape}: {used} indices given")
    if ellipses:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (x.ndim - used)
    else:
        items += [slice(None)] * (x.ndim - used)
    return items


def _bool_mask_indices(mask: Tensor) -> list[Tensor]:
    """A bool mask selects by value, so its positions are read now (a sync point, as in PyTorch)."""
    if mask.ndim == 0:
        raise IndexError("a 0-d bool tensor is supported only as the whole index, as in x[mask]")
    positions = np.nonzero(mask.numpy())
    return [tensor(p.astype(np.int64), device=mask.device) for p in positions]


def _basic_index(x: Tensor, basic: list) -> Tensor:
    slices, shape_after, dim = [], [], 0
    flips = []
    for item in basic:
        if item is None:
            shape_after.append(1)
            continue
        size = x.shape[dim]
        if isinstance(item, int):
            slices.append((item, item + 1, 1))
        else:
            start, stop, step = item.indices(size)
            if step < 0:
                # walk backwards: flip the axis and slice it forwards
                length = len(range(start, stop, step))
                first = size - 1 - start
                slices.append((first, first + (length - 1) * -step + 1 if length else first, -step))
                flips.append(dim)
            else:
                slices.append((start, max(stop, start), step))
            n = len(range(*item.indices(size)))
            shape_after.append(n)
        dim += 1
    if flips:
        x = apply(Op.FLIP, x, axes=tuple(flips))
    if any(s != (0, n, 1) for s, n in zip(slices, x.shape)):
        x = apply(Op.SLICE, x, slices=tuple(slices))
    return reshape(x, tuple(shape_after))


def _advanced_index(x: Tensor, advanced: list) -> Tensor:
    """Integer-tensor indices (broadcast together) become one gather over their dims."""
    positions = [p for p, _, _, _ in advanced]
    index_shape = broadcast_shapes(*(t.shape for _, t, _, _ in advanced), op="index")
    # bring the indexed dims to the front, in order, and flatten them into one
    rest = [d for d in range(x.ndim) if d not in positions]
    x = permute(x, positions + rest)
    sizes = [x.shape[i] for i in range(len(positions))]
    flat = reshape(x, (math.prod(sizes),) + x.shape[len(positions):])
    linear = None
    for (_, idx, size, dim), stride in zip(advanced, _strides(sizes)):
        idx = wrapped(checked("index", idx, size, dim, negative=True), size).to(dtypes.int64)
        idx = expand_to(idx, index_shape)
        linear = idx * stride if linear is None else linear + idx * stride
    n = math.prod(index_shape)
    tail = flat.shape[1:]
    gather_index = expand(reshape(linear, (n,) + (1,) * len(tail)), (n,) + tail)
    out = reshape(gather_in_range(flat, 0, gather_index), index_shape + tail)
    adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
    if adjacent and positions[0] > 0:
        k = len(index_shape)
        order = list(range(k, k + positions[0])) + list(range(k)) + list(range(k + positions[0], out.ndim))
        out = permute(out, order)
    return out


def _strides(sizes: list[int]) -> list[int]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return out[::-1]


def _has_tensor_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, (Tensor, list)) or hasattr(i, "__array__") for i in items)


def _last_writes(flat_pos: Tensor, flat_value: Tensor) -> tuple[Tensor, Tensor]:
    """Only the last write to each position, as torch's sequential CPU loop leaves it; summing
    repeated writes would be wrong. Reading the positions is a sync point, as bool masks are."""
    pos = flat_pos.numpy()
    _, first_from_end = np.unique(pos[::-1], return_index=True)
    if len(first_from_end) == len(pos):
        return flat_pos, flat_value
    keep = tensor(np.sort(len(pos) - 1 - first_from_end), device=flat_pos.device)
    return select_in_range(flat_pos, 0, keep), select_in_range(flat_value, 0, keep)


def setitem(x: Tensor, index, value) -> None:
    """`x[index] = value`: the positions the index selects are scattered back into x, lazily."""
    positions = getitem(reshape(arange(x.numel(), device=x.device), x.shape), index)
    value = converted("setitem", "value", value, like=x)
    if value.shape != positions.shape:
        value = broadcast_to(value, positions.shape, op="setitem")
    carrier = x.dtype if x.dtype is not dtypes.bool_ else dtypes.uint8
    flat_pos = reshape(positions, (-1,))
    if _has_tensor_index(index):
        flat_pos, value = _last_writes(flat_pos, reshape(value, (-1,)))
    n = x.numel()
    # the positions are checked where the index was read (getitem)
    hit = scatter_add_in_range(zeros(n, dtype=dtypes.int32, device=x.device), 0, flat_pos,
                               zeros(flat_pos.shape, dtype=dtypes.int32, device=x.device) + 1)
    placed = scatter_add_in_range(zeros(n, dtype=carrier, device=x.device), 0, flat_pos,
                                  reshape(cast(value, carrier), (-1,)))
    updated = where(hit > 0, cast(placed, x.dtype), reshape(x, (-1,)))
    x.assign(reshape(updated, x.shape))


# -- the index primitives -----------------------------------------------------------------------------
# Each primitive's rules side by side: shape and dtype, VJP, and reference implementation (NumPy, half
# types computed in float32, the attributes as keywords). CHECK_INDEX's lowering is the kernel's own
# (compiler/emit.py: it records an index out of range in the plan's flags).

def _gather_vjp(g, xs, out, a):
    x, index = xs
    axis = a["axis"]
    if one_per_row(x, axis, index):  # one pick per row (cross entropy, max with indices): a select, no scatter
        return where(picked(x, axis, index), g.expand(x.shape), 0), None
    base = zeros(x.shape, dtype=g.dtype, device=g.device)
    return apply(Op.SCATTER_ADD, base, index, g, axis=axis), None


def _scatter_add_vjp(g, xs, out, a):
    _, index, _ = xs
    return g, None, apply(Op.GATHER, g, index, axis=a["axis"])


def _np_gather(x: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    # torch.gather lets the index be smaller than the input along the other axes
    x = x[tuple(slice(0, s) if d != axis else slice(None) for d, s in enumerate(index.shape))]
    _np_check_index(index, "gather", axis, x.shape[axis])
    return np.take_along_axis(x, index, axis)


def _np_scatter_add(base: np.ndarray, index: np.ndarray, src: np.ndarray, axis: int) -> np.ndarray:
    _np_check_index(index, "scatter_add", axis, base.shape[axis])
    out = base.copy()
    where = list(np.indices(index.shape, sparse=True))
    where[axis] = index
    src = src[tuple(slice(0, s) for s in index.shape)]
    np.add.at(out, tuple(where), src)
    return out


def _np_check_index(index: np.ndarray, op: str, dim: int, size: int, negative: bool = False) -> None:
    """IndexError from `op` naming the first index outside [0, size) ([-size, size) with `negative`)."""
    low = -size if negative else 0
    if index.size and (index.min() < low or index.max() >= size):
        bad = index[(index < low) | (index >= size)].flat[0]
        raise index_out_of_bounds(op, int(bad), dim, size)


def _np_checked(index: np.ndarray, op_name: str, dim: int, size: int, negative: bool) -> np.ndarray:
    _np_check_index(index, op_name, dim, size, negative)
    return index


define(Op.GATHER, shape=lambda inputs, attrs: (inputs[1].shape, inputs[0].dtype), vjp=_gather_vjp,
       reference=_np_gather)
define(Op.SCATTER_ADD, shape=lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype), vjp=_scatter_add_vjp,
       reference=_np_scatter_add)
define(Op.CHECK_INDEX, shape=lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
       vjp=lambda g, xs, out, a: (None,),  # an integer index carries no gradient
       reference=_np_checked)
