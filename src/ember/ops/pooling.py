"""Pooling as reductions over windows: each kernel offset is a strided slice of the
(padded) input, and the windows are reduced elementwise; unfold and fold, the windows stacked as columns and
summed back. No primitive of its own."""

from __future__ import annotations

import numpy as np

from ember import dtypes
from ember.autograd import composite_vjp, is_grad_enabled, no_grad
from ember.errors import ShapeError
from ember.ir import Op
from ember.ir.ops import RULES, define_composite
from ember.ops.contraction import _pair
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
    """Yield, for every kernel offset, the strided slice of the padded input it sees."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = k, s, p, d
    h, w = x.shape[-2:]
    ho, wo = _pooled_size((h, w), k, s, p, d, ceil_mode)
    extra_h = max((ho - 1) * sh + dh * (kh - 1) + 1 - (h + 2 * ph), 0)
    extra_w = max((wo - 1) * sw + dw * (kw - 1) + 1 - (w + 2 * pw), 0)
    xp = pad(x, (pw, pw + extra_w, ph, ph + extra_h), value=fill)
    for i in range(kh):
        for j in range(kw):
            rows = slice_axis(xp, xp.ndim - 2, i * dh, i * dh + (ho - 1) * sh + 1, sh)
            yield slice_axis(rows, xp.ndim - 1, j * dw, j * dw + (wo - 1) * sw + 1, sw)


def _check_input(op: str, x: Tensor) -> None:
    expect_tensors(op, input=x)
    if x.ndim not in (3, 4):
        raise ShapeError(f"{op}: expects input (N, C, H, W) or (C, H, W), got shape {x.shape}")


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over windows of the last two dims; with `return_indices`, also where each maximum sits, as
    torch gives it: its flat position in its input plane (row * W + column), int64."""
    _check_input("max_pool2d", x)
    k = _pair("max_pool2d", "kernel_size", kernel_size)
    s = _pair("max_pool2d", "stride", stride if stride is not None else kernel_size)
    p, d = _pair("max_pool2d", "padding", padding), _pair("max_pool2d", "dilation", dilation)
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"max_pool2d: padding {p} should be at most half of the kernel size {k}")
    if not return_indices and d == (1, 1):  # one node, whose gradient reads only the windows holding each input
        _pooled_size(x.shape[-2:], k, s, p, d, ceil_mode)
        return apply(Op.MAX_POOL2D, x, kernel=k, stride=s, padding=p, ceil_mode=ceil_mode)
    windows = list(_windows(x, k, s, p, d, ceil_mode, RULES[Op.MAX].identity(x.dtype)))
    differentiable = x.requires_grad and is_grad_enabled()
    if not return_indices:
        return first_maximum(windows, differentiable)
    (h, w), (ho, wo) = x.shape[-2:], windows[0].shape[-2:]
    rows = [np.arange(ho) * s[0] - p[0] + i * d[0] for i in range(k[0])]
    cols = [np.arange(wo) * s[1] - p[1] + j * d[1] for j in range(k[1])]
    return first_maximum(windows, differentiable, [(r, c, h, w) for r in rows for c in cols])


def first_maximum(windows: list[Tensor], differentiable: bool, positions: list | None = None):
    """The elementwise maximum of `windows`. As in torch, a window's gradient goes to its first maximal element,
    not shared among ties; given each window's input rows and columns (and the input's height and width), also
    the flat input position of that element."""
    best = windows[0]
    for window in windows[1:]:
        best = maximum(best, window)
    if not differentiable and positions is None:
        return best
    which = _first_window(windows, best.detach(), positions)
    out = best
    if differentiable:
        out = None
        for k, window in enumerate(windows):
            picked = where(which == k, window, 0)
            out = picked if out is None else out + picked
    if positions is None:
        return out
    index = None
    for k, (rows, cols, _, w) in enumerate(positions):
        flat = tensor((rows[:, None] * w + cols[None, :]).astype(np.int64), device=best.device)
        index = flat if index is None else where(which == k, flat, index)
    return out, index.expand(best.shape)


def _first_window(windows: list[Tensor], target: Tensor, positions: list | None = None) -> Tensor:
    """Which window holds the first maximum `target`, per output: one byte (stored once, read by the forward sum
    and its gradient) rather than a mask per window. Given the windows' positions, a window's padding is never
    its maximum."""
    last = len(windows) - 1
    # the last window wins where no earlier one holds the maximum (one of them always does)
    which = full_like(target, last, dtype=dtypes.uint8 if last <= 255 else dtypes.int32)
    for k in reversed(range(last)):
        hit = (windows[k] == target) | (windows[k] != windows[k])  # a NaN is the maximum of its window
        if positions is not None:
            hit = hit & _inside(*positions[k], target.device)
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


def _max_pool2d_vjp(g: Tensor, xs: list[Tensor], out: Tensor, attrs: dict) -> tuple:
    x = xs[0].detach()
    which = _first_window(_pool_windows(x, attrs), out.detach())
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    h, w = x.shape[-2:]
    total = None
    # in torch's order of the outputs adding into an element: the output rows, then columns, ascending
    outside = -kh * kw  # an offset past the kernel, along either axis: the sum below stays negative
    for th in reversed(range(-(-kh // sh))):
        rows = _phase_offsets(h, kh, sh, ph, th, outside, x.device)
        for tw in reversed(range(-(-kw // sw))):
            cols = _phase_offsets(w, kw, sw, pw, tw, outside, x.device)
            # the kernel offset of each input element in the window it reads: negative where it lies outside
            offset = reshape(rows, (h, 1)) * kw + reshape(cols, (1, w))
            spread_which = _repeat_windows(_repeat_windows(which, th, sh, ph, h, x.ndim - 2), tw, sw, pw, w,
                                           x.ndim - 1)
            spread_g = _repeat_windows(_repeat_windows(g, th, sh, ph, h, x.ndim - 2), tw, sw, pw, w, x.ndim - 1)
            term = where(spread_which == offset, spread_g, 0)
            total = term if total is None else total + term
    return (total,)


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


def _inside(rows: np.ndarray, cols: np.ndarray, h: int, w: int, device) -> Tensor | bool:
    """Which of a window's positions lie inside the (h, w) input: True (one value) when all do."""
    inside = ((rows >= 0) & (rows < h))[:, None] & ((cols >= 0) & (cols < w))[None, :]
    return True if inside.all() else tensor(inside, device=device)


define_composite(Op.MAX_POOL2D, shape=_max_pool2d_shape, vjp=composite_vjp(_max_pool2d_vjp),
                 expand=_max_pool2d_expansion)


def avg_pool2d(x: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    _check_input("avg_pool2d", x)
    k = _pair("avg_pool2d", "kernel_size", kernel_size)
    s = _pair("avg_pool2d", "stride", stride if stride is not None else kernel_size)
    p = _pair("avg_pool2d", "padding", padding)
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"avg_pool2d: padding {p} should be at most half of the kernel size {k}")
    total = None
    for window in _windows(x, k, s, p, (1, 1), ceil_mode, 0):
        total = window if total is None else total + window
    if divisor_override is not None:
        return _average(total, divisor_override)
    if not ceil_mode and (count_include_pad or p == (0, 0)):
        return _average(total, k[0] * k[1])
    # the divisor varies per window: count the positions each window covers
    h, w = x.shape[-2:]
    counted = ones((1, h, w), dtype=dtypes.float32, device=x.device)
    if count_include_pad:
        counted = pad(counted, (p[1], p[1], p[0], p[0]), value=1.0)
        counted_p = (0, 0)
    else:
        counted_p = p
    count = None
    for window in _windows(counted, k, s, counted_p, (1, 1), ceil_mode, 0):
        count = window if count is None else count + window
    if count_include_pad:  # windows were taken over the already padded ones
        count = _crop_to(count, total.shape[-2:])
    return _average(total, count.to(total.dtype if total.dtype.is_floating_point else dtypes.int64))


def _average(total: Tensor, count) -> Tensor:
    """Integer inputs stay integers, truncated as in torch."""
    return total / count if total.dtype.is_floating_point else div(total, count, rounding_mode="trunc")


def _crop_to(t: Tensor, hw: tuple[int, int]) -> Tensor:
    return slice_axis(slice_axis(t, t.ndim - 2, 0, hw[0]), t.ndim - 1, 0, hw[1])


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


def _output_size(op: str, output_size, x: Tensor) -> tuple:
    """An int, or a pair whose None entries keep the input's size."""
    if output_size is None:
        return x.shape[-2:]
    pair = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    if len(pair) != 2 or not all(v is None or isinstance(v, int) for v in pair):
        raise ValueError(f"{op}: output_size must be an int or a pair of ints (or None), got {output_size!r}")
    return pair


def adaptive_avg_pool2d(x: Tensor, output_size) -> Tensor:
    _check_input("adaptive_avg_pool2d", x)
    oh, ow = _output_size("adaptive_avg_pool2d", output_size, x)
    oh = x.shape[-2] if oh is None else oh
    ow = x.shape[-1] if ow is None else ow
    if (oh, ow) == (1, 1) and x.shape[-2] and x.shape[-1]:  # global pooling: one reduction, keepdim
        return x.mean((-2, -1), keepdim=True)
    out = _adaptive_axis(x, x.ndim - 2, oh, lambda t, a: t.mean(a))
    return _adaptive_axis(out, x.ndim - 1, ow, lambda t, a: t.mean(a))


def adaptive_max_pool2d(x: Tensor, output_size, return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The maximum over bins of the last two dims, bin i of an axis spanning floor(i n / out) to
    ceil((i + 1) n / out), as torch's adaptive_max_pool2d; with `return_indices`, also each maximum's flat
    position in its input plane, as max_pool2d gives it."""
    _check_input("adaptive_max_pool2d", x)
    oh, ow = _output_size("adaptive_max_pool2d", output_size, x)
    oh = x.shape[-2] if oh is None else oh
    ow = x.shape[-1] if ow is None else ow
    if not return_indices:
        out = _adaptive_axis(x, x.ndim - 2, oh, lambda t, a: t.amax(a))
        return _adaptive_axis(out, x.ndim - 1, ow, lambda t, a: t.amax(a))
    h, w = x.shape[-2:]
    if min(h, w, oh, ow) <= 0:
        raise ShapeError(f"adaptive_max_pool2d: input {x.shape} and output size {(oh, ow)} must be non-empty")
    rows, cols = _bin_offsets(h, oh), _bin_offsets(w, ow)
    by_row = [select_in_range(x, x.ndim - 2, tensor(r.astype(np.int32), device=x.device)) for r in rows]
    windows = [select_in_range(t, x.ndim - 1, tensor(c.astype(np.int32), device=x.device)) for t in by_row
               for c in cols]
    return first_maximum(windows, x.requires_grad and is_grad_enabled(), [(r, c, h, w) for r in rows for c in cols])


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
