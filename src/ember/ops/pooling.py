"""Pooling (1-d forms live in nn.functional as views of the 2-d ones; 2-d and 3-d here) as reductions over
windows: each kernel offset is a strided slice of the (padded) input, and the windows are reduced elementwise;
unfold and fold, the windows stacked as columns and summed back. No primitive of its own."""

from __future__ import annotations

import itertools

import numpy as np

from ember import dtypes
from ember.autograd import composite_vjp, is_grad_enabled, no_grad
from ember.errors import ShapeError
from ember.ir import Op
from ember.ir.ops import RULES, define_composite
from ember.ops.contraction import _pair
from ember.ops.conv3d import triple
from ember.ops.creation import arange, full_like, ones, tensor, zeros
from ember.ops.index import checked, scatter_add_in_range, select_in_range
from ember.ops.movement import (
    cat,
    dilate_axis,
    pad,
    pad_axis,
    reshape,
    slice_axis,
    squeeze,
    stack,
    unsqueeze,
)
from ember.ops.pointwise import div, maximum, where
from ember.tensor import Tensor, apply, expect_tensors

_SPATIAL = {2: _pair, 3: triple}  # a pooling's spatial rank: how its int-or-tuple arguments are read


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window would start in the right padding
    return out


def _pooled_size(size: tuple[int, int], k, s, p, d, ceil_mode: bool) -> tuple[int, int]:
    """The output's height and width of pooling a plane of `size`."""
    pooled = tuple(_pool_out(n, ki, si, pi, di, ceil_mode) for n, ki, si, pi, di in zip(size, k, s, p, d))
    if min(pooled) <= 0:
        raise ShapeError(f"pool2d: input of spatial size {tuple(size)} is too small for kernel {k} with padding {p}")
    return pooled


def _windows(x: Tensor, k, s, p, d, ceil_mode: bool, fill: float):
    """Yield, for every kernel offset (in row-major order), the strided slice of the padded input it sees; the
    kernel's rank says how many trailing axes are spatial."""
    rank = len(k)
    spatial = x.shape[-rank:]
    out = tuple(_pool_out(n, *geometry, ceil_mode) for n, geometry in zip(spatial, zip(k, s, p, d)))
    if min(out) <= 0:
        raise ShapeError(f"pool{rank}d: input of spatial size {spatial} is too small for kernel {k} with padding {p}")
    extra = [max((o - 1) * si + di * (ki - 1) + 1 - (n + 2 * pi), 0)
             for n, o, ki, si, pi, di in zip(spatial, out, k, s, p, d)]
    xp = pad(x, [a for pi, e in zip(reversed(p), reversed(extra)) for a in (pi, pi + e)], value=fill)
    for offset in itertools.product(*(range(ki) for ki in k)):
        window = xp
        for axis, t, o, si, di in zip(range(x.ndim - rank, x.ndim), offset, out, s, d):
            window = slice_axis(window, axis, t * di, t * di + (o - 1) * si + 1, si)
        yield window


def _check_input(op: str, x: Tensor, rank: int = 2) -> None:
    expect_tensors(op, input=x)
    if x.ndim not in (rank + 1, rank + 2):
        spatial = "D, H, W" if rank == 3 else "H, W"
        raise ShapeError(f"{op}: expects input (N, C, {spatial}) or (C, {spatial}), got shape {x.shape}")


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over windows of the last two dims; with `return_indices`, also where each maximum sits, as
    torch gives it: its flat position in its input plane (row * W + column), int64."""
    return _max_pool("max_pool2d", 2, x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def max_pool3d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over windows of the last three dims; the indices (with `return_indices`) are flat positions
    in each input volume ((depth * H + row) * W + column)."""
    return _max_pool("max_pool3d", 3, x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def _max_pool(op: str, rank: int, x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool,
              return_indices: bool) -> Tensor | tuple[Tensor, Tensor]:
    _check_input(op, x, rank)
    spatial = _SPATIAL[rank]
    k = spatial(op, "kernel_size", kernel_size)
    s = spatial(op, "stride", stride if stride is not None and stride != () else kernel_size)
    p, d = spatial(op, "padding", padding), spatial(op, "dilation", dilation)
    if any(pi > ki // 2 for pi, ki in zip(p, k)):
        raise ValueError(f"{op}: padding {p} should be at most half of the kernel size {k}")
    if rank == 2 and not return_indices and d == (1, 1):
        # one node, whose gradient reads only the windows that hold each input element (_max_pool2d_vjp)
        _pooled_size(x.shape[-2:], k, s, p, d, ceil_mode)
        return apply(Op.MAX_POOL2D, x, kernel=k, stride=s, padding=p, ceil_mode=ceil_mode)
    windows = list(_windows(x, k, s, p, d, ceil_mode, RULES[Op.MAX].identity(x.dtype)))
    differentiable = x.requires_grad and is_grad_enabled()
    if not return_indices:
        return first_maximum(windows, differentiable)
    sizes, out = x.shape[-rank:], windows[0].shape[-rank:]
    reads = [[np.arange(o) * si - pi + t * di for t in range(ki)] for o, si, pi, di, ki in zip(out, s, p, d, k)]
    return first_maximum(windows, differentiable, [(coords, sizes) for coords in itertools.product(*reads)])


def first_maximum(windows: list[Tensor], differentiable: bool, positions: list | None = None):
    """The elementwise maximum of `windows`. As in torch, a window's gradient goes to its first maximal element,
    not shared among ties; given, for each window, the input position it reads along each spatial axis and the
    input's spatial sizes, also the flat input position of that element."""
    best = windows[0]
    for window in windows[1:]:
        best = maximum(best, window)
    if not differentiable and positions is None:
        return best
    target = best.detach()
    located = [_flat_positions(*position) for position in positions] if positions is not None else None
    which = _first_window(windows, target, [inside for _, inside in located] if located is not None else None)
    out = best
    if differentiable:
        out = None
        for k, window in enumerate(windows):
            picked = where(which == k, window, 0)
            out = picked if out is None else out + picked
    if located is None:
        return out
    index = None
    for k, (flat, _) in enumerate(located):
        flat = tensor(flat, device=target.device)
        index = flat if index is None else where(which == k, flat, index)
    return out, index.expand(best.shape)


def _first_window(windows: list[Tensor], target: Tensor, inside: list[np.ndarray] | None = None) -> Tensor:
    """Which window holds the first maximum `target`, per output: one byte (stored once, read by the forward sum
    and its gradient) rather than a mask per window. Given which of each window's positions lie inside the input,
    a window's padding is never its maximum."""
    last = len(windows) - 1
    # the last window wins where no earlier one holds the maximum (one of them always does)
    which = full_like(target, last, dtype=dtypes.uint8 if last <= 255 else dtypes.int32)
    for k in reversed(range(last)):
        hit = (windows[k] == target) | (windows[k] != windows[k])  # a NaN is the maximum of its window
        if inside is not None and not inside[k].all():
            hit = hit & tensor(inside[k], device=target.device)
        which = where(hit, k, which)
    return which


# -- max_pool2d as one node: its expansion, and its gradient by stride phase ---------------------------------------
# An input element at padded row r + p = q * s + a lies in the windows of output rows q - t (t < ceil(k / s)), at
# offset a + t * s of each (an offset past the kernel: not in that window). So its gradient is a sum of at most
# ceil(kh / sh) * ceil(kw / sw) terms (4 for kernel 3, stride 2; 1 where windows do not overlap), each reading the
# output gradient and the first maximum's window where the output row q - t repeats s times (a view), instead of
# one term per kernel offset.

def _max_pool2d_shape(inputs, attrs) -> tuple:
    (x,) = inputs
    size = _pooled_size(x.shape[-2:], attrs["kernel"], attrs["stride"], attrs["padding"], (1, 1), attrs["ceil_mode"])
    return x.shape[:-2] + size, x.dtype


def _pool_windows(x: Tensor, attrs: dict) -> list[Tensor]:
    return list(_windows(x, attrs["kernel"], attrs["stride"], attrs["padding"], (1, 1), attrs["ceil_mode"],
                         RULES[Op.MAX].identity(x.dtype)))


def _max_pool2d_expansion(inputs, attrs):
    with no_grad():
        return first_maximum(_pool_windows(Tensor(inputs[0]), attrs), False)._node


def max_pool2d_windows(x: Tensor, out: Tensor) -> Tensor:
    """For each output of the MAX_POOL2D node `out` over `x`, the offset in its window of its first maximum (one
    byte): what its gradient reads (`max_pool2d_grad`), computed beside the forward where that saves the backward
    reading every window again."""
    return _first_window(_pool_windows(x.detach(), out._node.attrs), out.detach())


def max_pool2d_grad(g: Tensor, which: Tensor, shape: tuple[int, ...], attrs: dict) -> Tensor:
    """The gradient to a MAX_POOL2D node's input of `shape` (`attrs`: the node's), given the output gradient `g`
    and the offsets `which` of the windows' first maxima (`max_pool2d_windows`)."""
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    h, w = shape[-2:]
    total = None
    # in torch's order of the outputs adding into an element: the output rows, then columns, ascending
    outside = -kh * kw  # an offset past the kernel, along either axis: the sum below stays negative
    for th in reversed(range(-(-kh // sh))):
        rows = _phase_offsets(h, kh, sh, ph, th, outside, g.device)
        for tw in reversed(range(-(-kw // sw))):
            cols = _phase_offsets(w, kw, sw, pw, tw, outside, g.device)
            # the kernel offset of each input element in the window it reads: negative where it lies outside
            offset = reshape(rows, (h, 1)) * kw + reshape(cols, (1, w))
            spread_which = _repeat_windows(_repeat_windows(which, th, sh, ph, h, len(shape) - 2), tw, sw, pw, w,
                                           len(shape) - 1)
            spread_g = _repeat_windows(_repeat_windows(g, th, sh, ph, h, len(shape) - 2), tw, sw, pw, w,
                                       len(shape) - 1)
            term = where(spread_which == offset, spread_g, 0)
            total = term if total is None else total + term
    return total


def _max_pool2d_vjp(g: Tensor, xs: list[Tensor], out: Tensor, attrs: dict) -> tuple:
    x = xs[0].detach()
    which = _first_window(_pool_windows(x, attrs), out.detach())
    return (max_pool2d_grad(g, which, x.shape, attrs),)


def _phase_offsets(n: int, k: int, s: int, p: int, t: int, outside: int, device) -> Tensor:
    """For each of the n input positions of an axis, its offset in the window t before its own ((r + p) // s - t):
    (r + p) % s + t * s, or `outside` where that is past the kernel."""
    offset = (arange(n, dtype=dtypes.int32, device=device) + p) % s + t * s
    return where(offset < k, offset, outside)


def _repeat_windows(t: Tensor, shift: int, s: int, p: int, n: int, axis: int) -> Tensor:
    """Along `axis`, the value of window (r + p) // s - shift at each of n input positions r: each window's value
    repeated s times (a view), shifted; zero before the first window and past the last."""
    rows = -(-(n + p) // s)
    shifted = pad_axis(t, axis, shift, rows - t.shape[axis] - shift)
    spread = list(shifted.shape)
    spread[axis] = rows * s
    repeated = unsqueeze(shifted, axis + 1).expand(*shifted.shape[:axis + 1], s, *shifted.shape[axis + 1:])
    return slice_axis(reshape(repeated, tuple(spread)), axis, p, p + n)


def _flat_positions(coords: tuple[np.ndarray, ...], sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """For a window reading input positions `coords` (one array per spatial axis) of an input of spatial `sizes`:
    each output's flat input position (int64) and whether it lies inside the input."""
    grids = np.meshgrid(*coords, indexing="ij")
    flat, inside = np.zeros(grids[0].shape, dtype=np.int64), np.ones(grids[0].shape, dtype=bool)
    for grid, n in zip(grids, sizes):
        flat = flat * n + grid
        inside &= (grid >= 0) & (grid < n)
    return flat, inside


define_composite(Op.MAX_POOL2D, shape=_max_pool2d_shape, vjp=composite_vjp(_max_pool2d_vjp),
                 expand=_max_pool2d_expansion)


def avg_pool2d(x: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    return _avg_pool("avg_pool2d", 2, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def avg_pool3d(x: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    return _avg_pool("avg_pool3d", 3, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def _avg_pool(op: str, rank: int, x: Tensor, kernel_size, stride, padding, ceil_mode: bool, count_include_pad: bool,
              divisor_override: int | None) -> Tensor:
    _check_input(op, x, rank)
    spatial = _SPATIAL[rank]
    k = spatial(op, "kernel_size", kernel_size)
    s = spatial(op, "stride", stride if stride is not None and stride != () else kernel_size)
    p, ones_ = spatial(op, "padding", padding), (1,) * rank
    if any(pi > ki // 2 for pi, ki in zip(p, k)):
        raise ValueError(f"{op}: padding {p} should be at most half of the kernel size {k}")
    total = None
    for window in _windows(x, k, s, p, ones_, ceil_mode, 0):
        total = window if total is None else total + window
    if divisor_override is not None:
        return _average(total, divisor_override)
    if not ceil_mode and (count_include_pad or not any(p)):
        return _average(total, int(np.prod(k)))
    # the divisor varies per window: count the positions each window covers
    counted = ones((1,) + x.shape[-rank:], dtype=dtypes.float32, device=x.device)
    counted_p = p
    if count_include_pad:  # windows taken over the already padded ones, cropped to the output
        counted = pad(counted, [a for pi in reversed(p) for a in (pi, pi)], value=1.0)
        counted_p = (0,) * rank
    count = None
    for window in _windows(counted, k, s, counted_p, ones_, ceil_mode, 0):
        count = window if count is None else count + window
    if count_include_pad:
        for axis, n in zip(range(1, rank + 1), total.shape[-rank:]):
            count = slice_axis(count, axis, 0, n)
    return _average(total, count.to(total.dtype if total.dtype.is_floating_point else dtypes.int64))


def _average(total: Tensor, count) -> Tensor:
    """Integer inputs stay integers, truncated as in torch."""
    return total / count if total.dtype.is_floating_point else div(total, count, rounding_mode="trunc")


def _adaptive_axis(x: Tensor, axis: int, out: int, reduce) -> Tensor:
    n = x.shape[axis]
    if n % out == 0:
        shape = x.shape[:axis] + (out, n // out) + x.shape[axis + 1:]
        return reduce(reshape(x, shape), axis + 1)
    pieces = []
    for i in range(out):
        start, end = (i * n) // out, -(-((i + 1) * n) // out)
        pieces.append(unsqueeze(reduce(slice_axis(x, axis, start, end), axis), axis))
    return cat(pieces, axis)


def _output_size(op: str, output_size, x: Tensor, rank: int) -> tuple[int, ...]:
    """An int, or one size per spatial axis whose None entries keep the input's size."""
    sizes = (output_size,) * rank if isinstance(output_size, int) or output_size is None else tuple(output_size)
    if len(sizes) != rank or not all(v is None or isinstance(v, int) for v in sizes):
        raise ValueError(f"{op}: output_size must be an int or a {'pair' if rank == 2 else 'triple'} of ints (or "
                         f"None), got {output_size!r}")
    return tuple(n if v is None else v for n, v in zip(x.shape[-rank:], sizes))


def adaptive_avg_pool2d(x: Tensor, output_size) -> Tensor:
    return _adaptive_avg_pool("adaptive_avg_pool2d", 2, x, output_size)


def adaptive_avg_pool3d(x: Tensor, output_size) -> Tensor:
    """The mean over adaptive_avg_pool2d's bins along each of the last three dims."""
    return _adaptive_avg_pool("adaptive_avg_pool3d", 3, x, output_size)


def _adaptive_avg_pool(op: str, rank: int, x: Tensor, output_size) -> Tensor:
    _check_input(op, x, rank)
    sizes = _output_size(op, output_size, x, rank)
    axes = tuple(range(x.ndim - rank, x.ndim))
    if set(sizes) == {1} and all(x.shape[axes[0]:]):  # global pooling: one reduction, keepdim
        return x.mean(axes, keepdim=True)
    for axis, out in zip(axes, sizes):
        x = _adaptive_axis(x, axis, out, lambda t, a: t.mean(a))
    return x


def adaptive_max_pool2d(x: Tensor, output_size, return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over bins of the last two dims, bin i of an axis spanning floor(i n / out) to
    ceil((i + 1) n / out), as torch's adaptive_max_pool2d; with `return_indices`, also each maximum's flat
    position in its input plane, as max_pool2d gives it."""
    return _adaptive_max_pool("adaptive_max_pool2d", 2, x, output_size, return_indices)


def adaptive_max_pool3d(x: Tensor, output_size, return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """adaptive_max_pool2d's bins along each of the last three dims (the indices flat in each input volume)."""
    return _adaptive_max_pool("adaptive_max_pool3d", 3, x, output_size, return_indices)


def _adaptive_max_pool(op: str, rank: int, x: Tensor, output_size, return_indices: bool):
    _check_input(op, x, rank)
    sizes = _output_size(op, output_size, x, rank)
    axes = tuple(range(x.ndim - rank, x.ndim))
    if not return_indices:
        for axis, out in zip(axes, sizes):
            x = _adaptive_axis(x, axis, out, lambda t, a: t.amax(a))
        return x
    spatial = x.shape[-rank:]
    if min(spatial + sizes) <= 0:
        raise ShapeError(f"{op}: input {x.shape} and output size {sizes} must be non-empty")
    reads = [_bin_offsets(n, out) for n, out in zip(spatial, sizes)]
    windows = [x]
    for axis, offsets in zip(axes, reads):
        windows = [select_in_range(t, axis, tensor(r.astype(np.int32), device=x.device)) for t in windows
                   for r in offsets]
    return first_maximum(windows, x.requires_grad and is_grad_enabled(),
                         [(coords, spatial) for coords in itertools.product(*reads)])


def _bin_offsets(n: int, out: int) -> list[np.ndarray]:
    """For each offset into the adaptive bins of an axis (n in, out bins), the position each bin reads there; a
    bin shorter than the longest repeats its last position, which changes neither its maximum nor which element
    holds it first."""
    start = np.arange(out) * n // out
    end = -(-(np.arange(out) + 1) * n // out)
    return [np.minimum(start + t, end - 1) for t in range(int((end - start).max()))]


# -- sliding blocks: unfold (im2col), its adjoint fold (col2im), and max_unpool2d --------------------------------
# unfold stacks max_pool2d's windows (one strided slice of the padded input per kernel offset) along a new
# channel axis; fold places each offset's block back with the slice's adjoint (zeros between the elements, then
# padding to its offset) and sums the offsets, so overlapping blocks add up. Both are differentiated through the
# movement ops they are made of.

def _sliding(op: str, kernel_size, dilation, padding, stride) -> tuple:
    k, d = _pair(op, "kernel_size", kernel_size), _pair(op, "dilation", dilation)
    p, s = _pair(op, "padding", padding), _pair(op, "stride", stride)
    for name, pair, least in (("kernel_size", k, 1), ("dilation", d, 1), ("padding", p, 0), ("stride", s, 1)):
        if min(pair) < least:
            raise ValueError(f"{op}: {name} must be {'non-negative' if least == 0 else 'positive'}, got {pair}")
    return k, d, p, s


def _block_counts(op: str, size: tuple[int, int], k, d, p, s) -> tuple[int, int]:
    """How many blocks fit along each spatial axis of a (padded) plane of `size`."""
    counts = tuple((n + 2 * pi - di * (ki - 1) - 1) // si + 1 for n, ki, di, pi, si in zip(size, k, d, p, s))
    if min(counts) < 1:
        raise ShapeError(f"{op}: a plane of spatial size {tuple(size)} with kernel_size={k}, dilation={d}, "
                         f"padding={p} and stride={s} holds {counts} sliding blocks; each count must be at least 1")
    return counts


def unfold(x: Tensor, kernel_size, dilation=1, padding=0, stride=1) -> Tensor:
    """The sliding blocks of (N, C, H, W) input as columns (N, C * kh * kw, L) — L blocks in row-major order,
    each column's entries channel-major then kernel row and column — as torch.nn.functional.unfold. (C, H, W)
    input gives (C * kh * kw, L)."""
    expect_tensors("unfold", input=x)
    if x.ndim not in (3, 4):
        raise ShapeError(f"unfold: expects input (N, C, H, W) or (C, H, W), got shape {x.shape}")
    k, d, p, s = _sliding("unfold", kernel_size, dilation, padding, stride)
    blocks = _block_counts("unfold", x.shape[-2:], k, d, p, s)
    columns = stack(list(_windows(x, k, s, p, d, False, 0)), x.ndim - 2)  # (..., C, kh * kw, Lh, Lw)
    return reshape(columns, x.shape[:-3] + (x.shape[-3] * k[0] * k[1], blocks[0] * blocks[1]))


def fold(x: Tensor, output_size, kernel_size, dilation=1, padding=0, stride=1) -> Tensor:
    """The adjoint of unfold: columns (N, C * kh * kw, L) summed into an (N, C, H, W) plane of `output_size`,
    overlapping entries adding up, as torch.nn.functional.fold. (C * kh * kw, L) input gives (C, H, W)."""
    expect_tensors("fold", input=x)
    if x.ndim not in (2, 3):
        raise ShapeError(f"fold: expects input (N, C * kh * kw, L) or (C * kh * kw, L), got shape {x.shape}")
    size = _pair("fold", "output_size", output_size)
    k, d, p, s = _sliding("fold", kernel_size, dilation, padding, stride)
    rows, length = x.shape[-2:]
    if rows % (k[0] * k[1]):
        raise ShapeError(f"fold: input's dim {x.ndim - 2} (size {rows}) must be divisible by the product of "
                         f"kernel_size {k}")
    blocks = _block_counts("fold", size, k, d, p, s)
    if length != blocks[0] * blocks[1]:
        raise ShapeError(f"fold: output_size={size}, kernel_size={k}, dilation={d}, padding={p} and stride={s} "
                         f"give {blocks[0]} * {blocks[1]} sliding blocks, but input's last dim has size {length}")
    lead = x.shape[:-2] + (rows // (k[0] * k[1]),)
    columns = reshape(x, lead + (k[0] * k[1],) + blocks)
    h_axis, w_axis = len(lead), len(lead) + 1
    out = None
    for offset in range(k[0] * k[1]):
        i, j = divmod(offset, k[1])
        block = squeeze(slice_axis(columns, len(lead), offset, offset + 1), len(lead))
        for axis, at, n, count, step in ((h_axis, i * d[0] - p[0], size[0], blocks[0], s[0]),
                                         (w_axis, j * d[1] - p[1], size[1], blocks[1], s[1])):
            spread = dilate_axis(block, axis, step)  # the block's elements `step` apart
            block = pad_axis(spread, axis, at, n - at - (count - 1) * step - 1)
        out = block if out is None else out + block
    return out


def max_unpool2d(x: Tensor, indices: Tensor, kernel_size, stride=None, padding=0, output_size=None) -> Tensor:
    """max_pool2d's partial inverse: each value of (N, C, H, W) input placed at its flat position `indices`
    (as max_pool2d's return_indices gives them) in a plane of zeros, as torch.nn.functional.max_unpool2d. Values
    sent to one position (by overlapping windows) should agree, as max_pool2d's do: the position takes their
    mean."""
    expect_tensors("max_unpool2d", input=x, indices=indices)
    _check_input("max_unpool2d", x)
    if indices.shape != x.shape or indices.dtype is not dtypes.int64:
        raise ShapeError(f"max_unpool2d: indices must be int64 of the input's shape {x.shape}, got "
                         f"{indices.dtype.name} {indices.shape}")
    k = _pair("max_unpool2d", "kernel_size", kernel_size)
    s = _pair("max_unpool2d", "stride", stride if stride is not None else kernel_size)
    p = _pair("max_unpool2d", "padding", padding)
    default = tuple((n - 1) * si - 2 * pi + ki for n, ki, si, pi in zip(x.shape[-2:], k, s, p))
    size = default if output_size is None else tuple(output_size)[-2:]
    if len(size) != 2 or any(not default_n - si < n < default_n + si for n, default_n, si in zip(size, default, s)):
        raise ValueError(f"max_unpool2d: output_size {output_size} must give a height and width each within its "
                         f"stride {s} of {default}")
    plane = size[0] * size[1]
    lead = x.shape[:-2]
    flat_index = checked("max_unpool2d", reshape(indices, lead + (-1,)), plane, x.ndim - 2)
    values = reshape(x, lead + (-1,))
    total = scatter_add_in_range(zeros(lead + (plane,), dtype=x.dtype, device=x.device), x.ndim - 2, flat_index,
                                 values)
    count = scatter_add_in_range(zeros(lead + (plane,), dtype=x.dtype, device=x.device), x.ndim - 2, flat_index,
                                 ones(values.shape, dtype=x.dtype, device=x.device))
    # overlapping windows put one element at its position several times: its value is kept once (the mean of the
    # copies), and each copy's gradient is its position's, as torch's backward gathers it
    kept = where(count > 1, total / where(count > 1, count, 1), total).detach()
    return reshape(kept + (total - total.detach()), lead + size)
