"""Movement ops: reshape, permute, expand, slicing, padding, concatenation.

They build RESHAPE / PERMUTE / EXPAND / SLICE / FLIP / PAD primitives, which change
how data is viewed and never copy it (Python indexing, `x[...]`, lives in ember/ops/index.py). At the
end, the movement primitives' rules.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from ember import dtypes
from ember.device import check_memory_format, contiguous_format
from ember.errors import ShapeError, describe, not_a_tensor
from ember.ir import Op
from ember.ir.ops import check_shape, define
from ember.ops import creation, pointwise  # modules, not names: both import this one in turn
from ember.tensor import Tensor, apply, expect_tensors


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
    expect_tensors("reshape", input=x)
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


def _shape_of(op: str, other) -> tuple[int, ...]:
    """The shape of `op`'s argument `other`: an ember Tensor, or another library's array."""
    if not hasattr(other, "shape"):
        raise not_a_tensor(op, "other", other)
    return tuple(other.shape)


def view_as(x: Tensor, other: Tensor) -> Tensor:
    expect_tensors("view_as", input=x)
    return reshape(x, _shape_of("view_as", other))


def reshape_as(x: Tensor, other: Tensor) -> Tensor:
    expect_tensors("reshape_as", input=x)
    return reshape(x, _shape_of("reshape_as", other))


def permute(x: Tensor, *dims) -> Tensor:
    expect_tensors("permute", input=x)
    dims = _sizes("permute", dims)
    if len(dims) != x.ndim:
        raise ShapeError(f"permute: {len(dims)} dims {dims} given for a tensor of shape {x.shape}")
    order = normalize_dims("permute", dims, x.ndim)
    return x if order == tuple(range(x.ndim)) else apply(Op.PERMUTE, x, order=order)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    expect_tensors("transpose", input=x)
    if x.ndim == 0:
        return x
    a, b = normalize_dim("transpose", dim0, x.ndim), normalize_dim("transpose", dim1, x.ndim)
    order = list(range(x.ndim))
    order[a], order[b] = order[b], order[a]
    return permute(x, order)


swapaxes = transpose


def t(x: Tensor) -> Tensor:
    expect_tensors("t", input=x)
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
    expect_tensors("expand", input=x)
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
    expect_tensors("expand_as", input=x)
    return expand(x, _shape_of("expand_as", other))


def broadcast_to(x: Tensor, shape, op: str = "broadcast_to") -> Tensor:
    expect_tensors(op, input=x)
    try:
        return expand(x, tuple(shape))
    except ShapeError:
        raise ShapeError(f"{op}: a tensor of shape {x.shape} cannot be broadcast to {tuple(shape)}") from None


def squeeze(x: Tensor, dim=None) -> Tensor:
    expect_tensors("squeeze", input=x)
    dims = normalize_dims("squeeze", dim, x.ndim)
    keep = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return reshape(x, keep)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    expect_tensors("unsqueeze", input=x)
    d = normalize_dim("unsqueeze", dim, x.ndim + 1)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    expect_tensors("flatten", input=x)
    if x.ndim == 0:
        return reshape(x, (1,))
    a, b = normalize_dim("flatten", start_dim, x.ndim), normalize_dim("flatten", end_dim, x.ndim)
    if a > b:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    return reshape(x, x.shape[:a] + (math.prod(x.shape[a:b + 1]),) + x.shape[b + 1:])


def unflatten(x: Tensor, dim: int, sizes) -> Tensor:
    expect_tensors("unflatten", input=x)
    d = normalize_dim("unflatten", dim, x.ndim)
    return reshape(x, x.shape[:d] + tuple(sizes) + x.shape[d + 1:])


def _check_factor(op: str, x: Tensor, name: str, factor: int) -> None:
    expect_tensors(op, input=x)
    if operator.index(factor) <= 0:
        raise ValueError(f"{op}: {name} must be positive, got {factor}")
    if x.ndim < 3:
        raise ShapeError(f"{op}: expected an input of at least 3 dims (*, C, H, W), got shape {x.shape}")


def pixel_shuffle(x: Tensor, upscale_factor: int) -> Tensor:
    """(*, C r², H, W) to (*, C, H r, W r): each channel's r² sub-channels become an r x r block of pixels."""
    _check_factor("pixel_shuffle", x, "upscale_factor", upscale_factor)
    r = upscale_factor
    *batch, c, h, w = x.shape
    if c % (r * r):
        raise ShapeError(f"pixel_shuffle: the channel dim (-3) of shape {x.shape} must be divisible by "
                         f"upscale_factor² = {r * r}")
    n = len(batch)
    x = reshape(x, (*batch, c // (r * r), r, r, h, w))
    x = permute(x, (*range(n), n, n + 3, n + 1, n + 4, n + 2))  # (*, C, H, r, W, r)
    return reshape(x, (*batch, c // (r * r), h * r, w * r))


def pixel_unshuffle(x: Tensor, downscale_factor: int) -> Tensor:
    """The inverse of pixel_shuffle: (*, C, H r, W r) to (*, C r², H, W)."""
    _check_factor("pixel_unshuffle", x, "downscale_factor", downscale_factor)
    r = downscale_factor
    *batch, c, h, w = x.shape
    if h % r or w % r:
        raise ShapeError(f"pixel_unshuffle: the height and width of shape {x.shape} must be divisible by "
                         f"downscale_factor {r}")
    n = len(batch)
    x = reshape(x, (*batch, c, h // r, r, w // r, r))
    x = permute(x, (*range(n), n, n + 2, n + 4, n + 1, n + 3))  # (*, C, r, r, H, W)
    return reshape(x, (*batch, c * r * r, h // r, w // r))


def contiguous(x: Tensor, memory_format=contiguous_format) -> Tensor:
    """Views are folded into index arithmetic, so there is nothing to copy. A `memory_format` (torch's
    names) is accepted: where activations are laid out is the compiler's choice (ember.set_conv_memory_format,
    conv2d's memory_format)."""
    expect_tensors("contiguous", input=x)
    check_memory_format("contiguous", memory_format)
    return x


def clone(x: Tensor) -> Tensor:
    expect_tensors("clone", input=x)
    return x + 0 if x.requires_grad else x.detach()


def slice_axis(x: Tensor, axis: int, start: int, stop: int, step: int = 1) -> Tensor:
    slices = tuple((start, stop, step) if d == axis else (0, s, 1) for d, s in enumerate(x.shape))
    return apply(Op.SLICE, x, slices=slices)


def flip(x: Tensor, *dims) -> Tensor:
    expect_tensors("flip", input=x)
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
    expect_tensors("pad", input=x)
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


def tensor_sequence(op: str, tensors) -> list[Tensor]:
    """The tensors of `op`'s argument `tensors`: a non-empty list or tuple of ember Tensors (or another
    iterable of them, not an array)."""
    if isinstance(tensors, (Tensor, str)) or hasattr(tensors, "shape") or not isinstance(tensors, Iterable):
        raise TypeError(f"{op}: tensors must be a sequence of ember Tensors, got {describe(tensors)}")
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{op}: expects a non-empty sequence of tensors")
    expect_tensors(op, **{f"tensors[{i}]": t for i, t in enumerate(tensors)})
    return tensors


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate along `dim`: each piece is padded to the full length and the pieces summed,
    which a fused kernel turns into a select."""
    tensors = tensor_sequence("cat", tensors)
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
    pointwise._check_devices("cat", pieces)
    common = dtypes.promote_types(*(p.dtype for p in pieces))
    pieces = [pointwise.cast(p, common) for p in pieces]
    if len(pieces) == 1:
        return pieces[0]
    total = sum(p.shape[axis] for p in pieces)
    out, start = None, 0
    for p in pieces:
        n = p.shape[axis]
        placed = apply(Op.PAD, p, pads=tuple((start, total - start - n) if d == axis else (0, 0)
                                             for d in range(ndim)), value=_pad_value(0, common))
        if common is dtypes.bool_:
            out = placed if out is None else pointwise.logical_or(out, placed)
        else:
            out = placed if out is None else out + placed
        start += n
    return out


concat = concatenate = cat


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    tensors = tensor_sequence("stack", tensors)
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ShapeError(f"stack: all tensors must have the same shape, got {', '.join(map(str, shapes))}")
    d = normalize_dim("stack", dim, tensors[0].ndim + 1)
    return cat([unsqueeze(t, d) for t in tensors], d)


def hstack(tensors: Sequence[Tensor]) -> Tensor:
    tensors = tensor_sequence("hstack", tensors)
    return cat(tensors, 0 if tensors[0].ndim == 1 else 1)


def vstack(tensors: Sequence[Tensor]) -> Tensor:
    tensors = tensor_sequence("vstack", tensors)
    return cat([t if t.ndim >= 2 else reshape(t, (1, -1)) for t in tensors], 0)


def split(x: Tensor, split_size_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
    expect_tensors("split", input=x)
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
    expect_tensors("chunk", input=x)
    if chunks <= 0:
        raise ValueError(f"chunk: chunks must be positive, got {chunks}")
    n = x.shape[normalize_dim("chunk", dim, x.ndim)]
    return split(x, max(-(-n // chunks), 1), dim)


def unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    expect_tensors("unbind", input=x)
    axis = normalize_dim("unbind", dim, x.ndim)
    return tuple(squeeze(slice_axis(x, axis, i, i + 1), axis) for i in range(x.shape[axis]))


def repeat(x: Tensor, *sizes) -> Tensor:
    expect_tensors("repeat", input=x)
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
    expect_tensors("tile", input=x)
    dims = tuple(dims)
    return repeat(x, (1,) * (x.ndim - len(dims)) + dims)


def repeat_interleave(x: Tensor, repeats: int, dim: int | None = None) -> Tensor:
    expect_tensors("repeat_interleave", input=x)
    if dim is None:
        x, dim = reshape(x, (-1,)), 0
    axis = normalize_dim("repeat_interleave", dim, x.ndim)
    y = unsqueeze(x, axis + 1)
    y = expand(y, *[repeats if d == axis + 1 else -1 for d in range(y.ndim)])
    return flatten(y, axis, axis + 1)


def roll(x: Tensor, shifts, dims=None) -> Tensor:
    expect_tensors("roll", input=x)
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
    expect_tensors("narrow", input=x)
    axis = normalize_dim("narrow", dim, x.ndim)
    if start < 0:
        start += x.shape[axis]
    if not 0 <= start <= start + length <= x.shape[axis]:
        raise IndexError(f"narrow: start {start} + length {length} exceeds dimension {axis} of size {x.shape[axis]}")
    return slice_axis(x, axis, start, start + length)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    expect_tensors("tril", input=x)
    return _triangle(x, diagonal, lower=True)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    expect_tensors("triu", input=x)
    return _triangle(x, diagonal, lower=False)


def _triangle(x: Tensor, diagonal: int, lower: bool) -> Tensor:
    if x.ndim < 2:
        raise ShapeError(f"{'tril' if lower else 'triu'}: expects at least 2 dims, got shape {x.shape}")
    rows = reshape(creation.arange(x.shape[-2], device=x.device), (-1, 1))
    cols = reshape(creation.arange(x.shape[-1], device=x.device), (1, -1))
    keep = (cols - rows <= diagonal) if lower else (cols - rows >= diagonal)
    return pointwise.where(keep, x, pointwise.scalar(0, x.dtype, x.device))  # a zero of x's dtype: x's dtype kept


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
            return (creation.zeros(x.shape, dtype=g.dtype, device=g.device),)
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
