"""Movement ops: reshape, permute, expand, slicing, padding, concatenation, indexing.

They build RESHAPE / PERMUTE / EXPAND / SLICE / FLIP / PAD primitives, which change
how data is viewed and never copy it; integer-tensor indexing becomes a GATHER. At the end, the
movement primitives' rules.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from ember import dtypes
from ember.errors import ShapeError, operands
from ember.ir import Op
from ember.ir.ops import check_shape, define
from ember.tensor import Tensor, apply


def normalize_dim(op: str, dim: int, ndim: int) -> int:
    """A dim in [-ndim, ndim) as a non-negative index (0-d tensors accept -1 and 0)."""
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{op}: dim must be an integer, not {type(dim).__name__}") from None
    bound = max(ndim, 1)
    if not -bound <= dim < bound:
        raise IndexError(f"{op}: dimension {dim} is out of range for a tensor of {ndim} dims "
                         f"(expected a value in [{-bound}, {bound - 1}])")
    return dim % bound


def normalize_dims(op: str, dims, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    if not isinstance(dims, (list, tuple)):
        dims = (dims,)  # one dim; normalize_dim rejects what is not an integer
    out = tuple(normalize_dim(op, d, ndim) for d in dims)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: dim {tuple(dims)} names a dimension twice")
    return out if ndim else ()


def _sizes(op: str, args) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    try:
        sizes = tuple(operator.index(s) for s in args)
    except TypeError:
        raise TypeError(f"{op}: sizes must be integers, got {args}") from None
    return sizes


def reshape(x: Tensor, *shape) -> Tensor:
    shape = _sizes("reshape", shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape: only one dimension can be -1, got {shape}")
    if any(s < -1 for s in shape):
        raise ShapeError(f"reshape: invalid size in {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or x.numel() % known:
            raise ShapeError(f"reshape: shape {shape} is invalid for a tensor of shape {x.shape} "
                             f"({x.numel()} elements)")
        shape = tuple(x.numel() // known if s == -1 else s for s in shape)
    if math.prod(shape) != x.numel():
        raise ShapeError(f"reshape: shape {shape} is invalid for a tensor of shape {x.shape} "
                         f"({x.numel()} elements)")
    return x if shape == x.shape else apply(Op.RESHAPE, x, shape=shape)


view = reshape


def view_as(x: Tensor, other: Tensor) -> Tensor:
    return reshape(x, other.shape)


def reshape_as(x: Tensor, other: Tensor) -> Tensor:
    return reshape(x, other.shape)


def permute(x: Tensor, *dims) -> Tensor:
    dims = _sizes("permute", dims)
    if len(dims) != x.ndim:
        raise ShapeError(f"permute: {len(dims)} dims {dims} given for a tensor of shape {x.shape}")
    order = normalize_dims("permute", dims, x.ndim)
    return x if order == tuple(range(x.ndim)) else apply(Op.PERMUTE, x, order=order)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    if x.ndim == 0:
        return x
    a, b = normalize_dim("transpose", dim0, x.ndim), normalize_dim("transpose", dim1, x.ndim)
    order = list(range(x.ndim))
    order[a], order[b] = order[b], order[a]
    return permute(x, order)


swapaxes = transpose


def t(x: Tensor) -> Tensor:
    if x.ndim > 2:
        raise ShapeError(f"t: expects a tensor of at most 2 dims, got shape {x.shape}; use transpose or .mT")
    return transpose(x, 0, 1) if x.ndim == 2 else x


def T(x: Tensor) -> Tensor:  # noqa: N802
    return permute(x, tuple(reversed(range(x.ndim))))


def mT(x: Tensor) -> Tensor:  # noqa: N802
    if x.ndim < 2:
        raise ShapeError(f"mT: expects a tensor of at least 2 dims, got shape {x.shape}")
    return transpose(x, -2, -1)


def expand(x: Tensor, *sizes) -> Tensor:
    sizes = _sizes("expand", sizes)
    if len(sizes) < x.ndim:
        raise ShapeError(f"expand: the number of sizes {sizes} must be at least the tensor's dims {x.shape}")
    lead = len(sizes) - x.ndim
    target = []
    for i, s in enumerate(sizes):
        own = x.shape[i - lead] if i >= lead else None
        if s == -1:
            if own is None:
                raise ShapeError(f"expand: -1 is not allowed for a new leading dimension in {sizes}")
            s = own
        if own is not None and own != 1 and own != s:
            raise ShapeError(f"expand: the size {own} of dimension {i - lead} of shape {x.shape} cannot be "
                             f"expanded to {s} (target {sizes}); only size-1 dimensions expand")
        if s < 0:
            raise ShapeError(f"expand: invalid size {s} in {sizes}")
        target.append(s)
    target = tuple(target)
    if math.prod(target) >= 2**63:
        raise ShapeError(f"expand: target {target} of a tensor of shape {x.shape} has too many elements "
                         f"({math.prod(target)}) for an int64 count")
    if target == x.shape:
        return x
    if lead:
        x = apply(Op.RESHAPE, x, shape=(1,) * lead + x.shape)
    return apply(Op.EXPAND, x, shape=target)


def expand_as(x: Tensor, other: Tensor) -> Tensor:
    return expand(x, other.shape)


def broadcast_to(x: Tensor, shape, op: str = "broadcast_to") -> Tensor:
    try:
        return expand(x, tuple(shape))
    except ShapeError:
        raise ShapeError(f"{op}: a tensor of shape {x.shape} cannot be broadcast to {tuple(shape)}") from None


def squeeze(x: Tensor, dim=None) -> Tensor:
    dims = normalize_dims("squeeze", dim, x.ndim)
    keep = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return reshape(x, keep)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    d = normalize_dim("unsqueeze", dim, x.ndim + 1)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    if x.ndim == 0:
        return reshape(x, (1,))
    a, b = normalize_dim("flatten", start_dim, x.ndim), normalize_dim("flatten", end_dim, x.ndim)
    if a > b:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    return reshape(x, x.shape[:a] + (math.prod(x.shape[a:b + 1]),) + x.shape[b + 1:])


def unflatten(x: Tensor, dim: int, sizes) -> Tensor:
    d = normalize_dim("unflatten", dim, x.ndim)
    return reshape(x, x.shape[:d] + tuple(sizes) + x.shape[d + 1:])


def contiguous(x: Tensor) -> Tensor:
    """Views are folded into index arithmetic, so there is nothing to copy."""
    return x


def clone(x: Tensor) -> Tensor:
    return x + 0 if x.requires_grad else x.detach()


def slice_axis(x: Tensor, axis: int, start: int, stop: int, step: int = 1) -> Tensor:
    slices = tuple((start, stop, step) if d == axis else (0, s, 1) for d, s in enumerate(x.shape))
    return apply(Op.SLICE, x, slices=slices)


def flip(x: Tensor, *dims) -> Tensor:
    dims = _sizes("flip", dims)
    axes = normalize_dims("flip", dims, x.ndim)
    axes = tuple(a for a in axes if x.shape[a] > 1)
    return apply(Op.FLIP, x, axes=axes) if axes else x


def fliplr(x: Tensor) -> Tensor:
    return flip(x, 1)


def flipud(x: Tensor) -> Tensor:
    return flip(x, 0)


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> Tensor:
    """torch.nn.functional.pad: pairs (before, after) from the last dimension backwards.

    Negative amounts crop. Modes: constant, reflect, replicate, circular.
    """
    pad = tuple(pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ShapeError(f"pad: padding {pad} must have an even length of at most 2 * ndim for shape {x.shape}")
    amounts = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        amounts[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    if mode != "constant":
        return _pad_by_copy(x, amounts, mode)
    for axis, (lo, hi) in enumerate(amounts):
        if lo < 0 or hi < 0:
            n = x.shape[axis]
            start, stop = max(-lo, 0), n - max(-hi, 0)
            if stop < start:
                raise ShapeError(f"pad: cropping {(lo, hi)} removes more than the {n} elements of dim {axis}")
            x = slice_axis(x, axis, start, stop)
    amounts = tuple((max(lo, 0), max(hi, 0)) for lo, hi in amounts)
    if not any(lo or hi for lo, hi in amounts):
        return x
    return apply(Op.PAD, x, pads=amounts, value=_pad_value(value, x.dtype))


def _pad_value(value, dtype):
    return bool(value) if dtype is dtypes.bool_ else (int(value) if dtype.is_integer else float(value))


def _pad_by_copy(x: Tensor, amounts, mode: str) -> Tensor:
    for axis, (lo, hi) in enumerate(amounts):
        if not (lo or hi):
            continue
        n = x.shape[axis]
        if lo < 0 or hi < 0:
            raise ShapeError(f"pad: negative padding is only supported in constant mode, got {(lo, hi)}")
        if mode == "reflect":
            if lo >= n or hi >= n:
                raise ShapeError(f"pad: reflect padding {(lo, hi)} must be smaller than the size {n} of dim {axis}")
            before = flip(slice_axis(x, axis, 1, lo + 1), axis)
            after = flip(slice_axis(x, axis, n - 1 - hi, n - 1), axis)
        elif mode == "replicate":
            before = expand(slice_axis(x, axis, 0, 1), *[lo if d == axis else -1 for d in range(x.ndim)])
            after = expand(slice_axis(x, axis, n - 1, n), *[hi if d == axis else -1 for d in range(x.ndim)])
        elif mode == "circular":
            if lo > n or hi > n:
                raise ShapeError(f"pad: circular padding {(lo, hi)} is larger than the size {n} of dim {axis}")
            before = slice_axis(x, axis, n - lo, n)
            after = slice_axis(x, axis, 0, hi)
        else:
            raise ValueError(f"pad: unknown mode {mode!r}; expected constant, reflect, replicate or circular")
        x = cat([before, x, after], axis)
    return x


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate along `dim`: each piece is padded to the full length and the pieces summed,
    which a fused kernel turns into a select."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expects a non-empty sequence of tensors")
    from ember.ops.pointwise import _check_devices, cast

    # PyTorch skips 1-d empty tensors in cat, a legacy convenience
    pieces = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or tensors[:1]
    ndim = pieces[0].ndim
    if ndim == 0:
        raise ShapeError("cat: zero-dimensional tensors cannot be concatenated; use stack")
    axis = normalize_dim("cat", dim, ndim)
    for p in pieces:
        if p.ndim != ndim or any(a != b for i, (a, b) in enumerate(zip(p.shape, pieces[0].shape)) if i != axis):
            raise ShapeError(f"cat: shapes {', '.join(str(q.shape) for q in pieces)} must match except in "
                             f"dimension {axis}")
    _check_devices("cat", pieces)
    common = dtypes.promote_types(*(p.dtype for p in pieces))
    pieces = [cast(p, common) for p in pieces]
    if len(pieces) == 1:
        return pieces[0]
    total = sum(p.shape[axis] for p in pieces)
    out, start = None, 0
    for p in pieces:
        n = p.shape[axis]
        placed = apply(Op.PAD, p, pads=tuple((start, total - start - n) if d == axis else (0, 0)
                                             for d in range(ndim)), value=_pad_value(0, common))
        if common is dtypes.bool_:
            from ember.ops.pointwise import logical_or

            out = placed if out is None else logical_or(out, placed)
        else:
            out = placed if out is None else out + placed
        start += n
    return out


concat = concatenate = cat


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expects a non-empty sequence of tensors")
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ShapeError(f"stack: all tensors must have the same shape, got {', '.join(map(str, shapes))}")
    d = normalize_dim("stack", dim, tensors[0].ndim + 1)
    return cat([unsqueeze(t, d) for t in tensors], d)


def hstack(tensors: Sequence[Tensor]) -> Tensor:
    tensors = list(tensors)
    return cat(tensors, 0 if tensors[0].ndim == 1 else 1)


def vstack(tensors: Sequence[Tensor]) -> Tensor:
    return cat([t if t.ndim >= 2 else reshape(t, (1, -1)) for t in tensors], 0)


def split(x: Tensor, split_size_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
    axis = normalize_dim("split", dim, x.ndim)
    n = x.shape[axis]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        if size <= 0 and n > 0:
            raise ValueError(f"split: split_size must be positive, got {size}")
        sizes = [min(size, n - i) for i in range(0, n, size)] if n else [0]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise ShapeError(f"split: sections {sizes} do not add up to the size {n} of dimension {axis}")
    out, start = [], 0
    for s in sizes:
        out.append(slice_axis(x, axis, start, start + s))
        start += s
    return tuple(out)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    if chunks <= 0:
        raise ValueError(f"chunk: chunks must be positive, got {chunks}")
    n = x.shape[normalize_dim("chunk", dim, x.ndim)]
    return split(x, max(-(-n // chunks), 1), dim)


def unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    axis = normalize_dim("unbind", dim, x.ndim)
    return tuple(squeeze(slice_axis(x, axis, i, i + 1), axis) for i in range(x.shape[axis]))


def repeat(x: Tensor, *sizes) -> Tensor:
    sizes = _sizes("repeat", sizes)
    if len(sizes) < x.ndim:
        raise ShapeError(f"repeat: the number of repeats {sizes} must be at least the tensor's dims {x.shape}")
    shape = (1,) * (len(sizes) - x.ndim) + x.shape
    x = reshape(x, shape)
    interleaved = tuple(v for s in shape for v in (1, s))
    x = reshape(x, interleaved)
    x = expand(x, tuple(v for r, s in zip(sizes, shape) for v in (r, s)))
    return reshape(x, tuple(r * s for r, s in zip(sizes, shape)))


def tile(x: Tensor, dims) -> Tensor:
    dims = tuple(dims)
    return repeat(x, (1,) * (x.ndim - len(dims)) + dims)


def repeat_interleave(x: Tensor, repeats: int, dim: int | None = None) -> Tensor:
    if dim is None:
        x, dim = reshape(x, (-1,)), 0
    axis = normalize_dim("repeat_interleave", dim, x.ndim)
    y = unsqueeze(x, axis + 1)
    y = expand(y, *[repeats if d == axis + 1 else -1 for d in range(y.ndim)])
    return flatten(y, axis, axis + 1)


def roll(x: Tensor, shifts, dims=None) -> Tensor:
    if dims is None:
        return reshape(roll(reshape(x, (-1,)), shifts, 0), x.shape)
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    for s, d in zip(shifts, dims):
        axis = normalize_dim("roll", d, x.ndim)
        n = x.shape[axis]
        if n == 0:
            continue
        s %= n
        if s:
            x = cat([slice_axis(x, axis, n - s, n), slice_axis(x, axis, 0, n - s)], axis)
    return x


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    axis = normalize_dim("narrow", dim, x.ndim)
    if start < 0:
        start += x.shape[axis]
    if not 0 <= start <= start + length <= x.shape[axis]:
        raise IndexError(f"narrow: start {start} + length {length} exceeds dimension {axis} of size {x.shape[axis]}")
    return slice_axis(x, axis, start, start + length)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    return _triangle(x, diagonal, lower=True)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    return _triangle(x, diagonal, lower=False)


def _triangle(x: Tensor, diagonal: int, lower: bool) -> Tensor:
    from ember.ops.creation import arange
    from ember.ops.pointwise import where

    if x.ndim < 2:
        raise ShapeError(f"{'tril' if lower else 'triu'}: expects at least 2 dims, got shape {x.shape}")
    rows = reshape(arange(x.shape[-2], device=x.device), (-1, 1))
    cols = reshape(arange(x.shape[-1], device=x.device), (1, -1))
    keep = (cols - rows <= diagonal) if lower else (cols - rows >= diagonal)
    return where(keep, x, 0)


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
    from ember.ops.creation import tensor as make_tensor

    if not isinstance(index, tuple):
        index = (index,)
    items: list = []
    for item in index:
        if isinstance(item, bool):
            raise IndexError("indexing with a Python bool is not supported; use a bool tensor")
        if isinstance(item, (list,)) or (hasattr(item, "__array__") and not isinstance(item, Tensor)):
            item = make_tensor(item, device=x.device)
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
                from ember.errors import device_mismatch

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
    from ember.ops.creation import tensor as make_tensor

    if mask.ndim == 0:
        raise IndexError("a 0-d bool tensor is supported only as the whole index, as in x[mask]")
    positions = np.nonzero(mask.numpy())
    return [make_tensor(p.astype(np.int64), device=mask.device) for p in positions]


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
    from ember.ops.index import check_bounds, gather
    from ember.ops.pointwise import broadcast_shapes, expand_to, where

    positions = [p for p, _, _, _ in advanced]
    index_shape = broadcast_shapes(*(t.shape for _, t, _, _ in advanced), op="index")
    # bring the indexed dims to the front, in order, and flatten them into one
    rest = [d for d in range(x.ndim) if d not in positions]
    x = permute(x, positions + rest)
    sizes = [x.shape[i] for i in range(len(positions))]
    flat = reshape(x, (math.prod(sizes),) + x.shape[len(positions):])
    linear = None
    for (_, idx, size, dim), stride in zip(advanced, _strides(sizes)):
        check_bounds("index", idx, size, dim, negative=True)
        idx = where(idx < 0, idx + size, idx).to(dtypes.int64)
        idx = expand_to(idx, index_shape)
        linear = idx * stride if linear is None else linear + idx * stride
    n = math.prod(index_shape)
    tail = flat.shape[1:]
    gather_index = expand(reshape(linear, (n,) + (1,) * len(tail)), (n,) + tail)
    out = reshape(gather(flat, 0, gather_index), index_shape + tail)
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
    from ember.ops.creation import tensor as make_tensor
    from ember.ops.index import index_select

    pos = flat_pos.numpy()
    _, first_from_end = np.unique(pos[::-1], return_index=True)
    if len(first_from_end) == len(pos):
        return flat_pos, flat_value
    keep = make_tensor(np.sort(len(pos) - 1 - first_from_end), device=flat_pos.device)
    return index_select(flat_pos, 0, keep), index_select(flat_value, 0, keep)


def setitem(x: Tensor, index, value) -> None:
    """`x[index] = value`: the positions the index selects are scattered back into x, lazily."""
    from ember.ops.creation import arange, zeros
    from ember.ops.index import scatter_add
    from ember.ops.pointwise import as_tensor, cast, where

    positions = getitem(reshape(arange(x.numel(), device=x.device), x.shape), index)
    value = as_tensor(value, like=x)
    if value.shape != positions.shape:
        value = broadcast_to(value, positions.shape, op="setitem")
    carrier = x.dtype if x.dtype is not dtypes.bool_ else dtypes.uint8
    flat_pos = reshape(positions, (-1,))
    if _has_tensor_index(index):
        flat_pos, value = _last_writes(flat_pos, reshape(value, (-1,)))
    n = x.numel()
    hit = scatter_add(zeros(n, dtype=dtypes.int32, device=x.device), 0, flat_pos,
                      zeros(flat_pos.shape, dtype=dtypes.int32, device=x.device) + 1)
    placed = scatter_add(zeros(n, dtype=carrier, device=x.device), 0, flat_pos,
                         reshape(cast(value, carrier), (-1,)))
    updated = where(hit > 0, cast(placed, x.dtype), reshape(x, (-1,)))
    x.assign(reshape(updated, x.shape))


# -- the movement primitives --------------------------------------------------------------------------
# Each primitive's rules side by side: shape (the dtype is the input's), VJP, and reference implementation
# (a NumPy view where there is one; the values are moved as stored, never widened). The VJPs use the
# helpers below, which the convolution's VJP shares.

def pad_axis(x: Tensor, axis: int, lo: int, hi: int) -> Tensor:
    """Pad (or, for negative amounts, crop) one axis with zeros."""
    if lo < 0 or hi < 0:
        x = slice_axis(x, axis, max(-lo, 0), x.shape[axis] - max(-hi, 0))
        lo, hi = max(lo, 0), max(hi, 0)
    if lo or hi:
        x = apply(Op.PAD, x, pads=tuple((lo, hi) if d == axis else (0, 0) for d in range(x.ndim)), value=0)
    return x


def dilate_axis(x: Tensor, axis: int, step: int) -> Tensor:
    """Put step - 1 zeros between the elements of one axis (the gradient of a strided slice)."""
    length = x.shape[axis]
    spread = list(x.shape)
    spread[axis] = length * step
    x = apply(Op.PAD, x.unsqueeze(axis + 1),
              pads=tuple((0, step - 1) if d == axis + 1 else (0, 0) for d in range(x.ndim + 1)), value=0)
    return slice_axis(x.reshape(spread), axis, 0, (length - 1) * step + 1)


def _view_rule(op: Op, shape_of):
    """A movement primitive's rule: its result shape from the input's shape; the dtype is kept."""
    def rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
        (x,) = inputs
        return shape_of(op, x.shape, attrs), x.dtype
    return rule


def _reshape_shape(op: Op, shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    new = tuple(attrs["shape"])
    check_shape(math.prod(new) == math.prod(shape), op, f"cannot reshape {shape} to {new}")
    return new


def _permute_shape(op: Op, shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    order = attrs["order"]
    check_shape(sorted(order) == list(range(len(shape))), op, f"bad order {order} for {shape}")
    return tuple(shape[i] for i in order)


def _expand_shape(op: Op, shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    new = tuple(attrs["shape"])
    check_shape(len(new) == len(shape) and all(s in (1, n) for s, n in zip(shape, new)), op,
                f"cannot expand {shape} to {new}")
    return new


def _slice_shape(op: Op, shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    return tuple(max(0, -(-(stop - start) // step)) for start, stop, step in attrs["slices"])


def _pad_shape(op: Op, shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    pads = attrs["pads"]
    check_shape(len(pads) == len(shape) and all(lo >= 0 and hi >= 0 for lo, hi in pads), op,
                f"bad pads {pads} for {shape}")
    return tuple(s + lo + hi for s, (lo, hi) in zip(shape, pads))


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


def _expand_vjp(g, xs, out, a):
    (x,) = xs
    axes = tuple(i for i, (s, n) in enumerate(zip(x.shape, out.shape)) if s == 1 and n != 1)
    return (apply(Op.SUM, g, axes=axes) if axes else g,)


def _slice_vjp(g, xs, out, a):
    """The gradient is spread back by the step and padded with zeros to the input's extent."""
    (x,) = xs
    for axis, ((start, _, step), n) in enumerate(zip(a["slices"], x.shape)):
        if g.shape[axis] == 0:
            from ember.ops.creation import zeros

            return (zeros(x.shape, dtype=g.dtype, device=g.device),)
        if step > 1:
            g = dilate_axis(g, axis, step)
        g = pad_axis(g, axis, start, n - start - g.shape[axis])
    return (g,)


def _pad_vjp(g, xs, out, a):
    slices = tuple((lo, lo + s, 1) for (lo, _), s in zip(a["pads"], xs[0].shape))
    return (apply(Op.SLICE, g, slices=slices),)


def _np_pad(x, pads, value):
    return np.pad(x, pads, constant_values=np.asarray(value).astype(x.dtype))


define(Op.RESHAPE, shape=_view_rule(Op.RESHAPE, _reshape_shape), vjp=lambda g, xs, out, a: (g.reshape(xs[0].shape),),
       reference=lambda x, shape: x.reshape(shape))
define(Op.PERMUTE, shape=_view_rule(Op.PERMUTE, _permute_shape),
       vjp=lambda g, xs, out, a: (g.permute(*_inverse(a["order"])),), reference=lambda x, order: x.transpose(order))
define(Op.EXPAND, shape=_view_rule(Op.EXPAND, _expand_shape), vjp=_expand_vjp,
       reference=lambda x, shape: np.broadcast_to(x, shape))
define(Op.SLICE, shape=_view_rule(Op.SLICE, _slice_shape), vjp=_slice_vjp,
       reference=lambda x, slices: x[tuple(slice(*s) for s in slices)])
define(Op.FLIP, shape=_view_rule(Op.FLIP, lambda op, shape, attrs: shape),
       vjp=lambda g, xs, out, a: (apply(Op.FLIP, g, axes=a["axes"]),), reference=lambda x, axes: np.flip(x, axes))
define(Op.PAD, shape=_view_rule(Op.PAD, _pad_shape), vjp=_pad_vjp, reference=_np_pad)
