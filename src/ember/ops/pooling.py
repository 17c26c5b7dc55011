"""Pooling as reductions over windows: each kernel offset is a strided slice of the
(padded) input, and the windows are reduced elementwise. No primitive of its own."""

from __future__ import annotations

from ember import dtypes
from ember.autograd import is_grad_enabled
from ember.errors import ShapeError
from ember.ir import Op
from ember.ir.ops import RULES
from ember.ops.contraction import _pair
from ember.ops.creation import full_like, ones
from ember.ops.movement import cat, pad, reshape, slice_axis, unsqueeze
from ember.ops.pointwise import div, maximum, where
from ember.tensor import Tensor, expect_tensors


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window would start in the right padding
    return out


def _windows(x: Tensor, k, s, p, d, ceil_mode: bool, fill: float):
    """Yield, for every kernel offset, the strided slice of the padded input it sees."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = k, s, p, d
    h, w = x.shape[-2:]
    ho, wo = _pool_out(h, kh, sh, ph, dh, ceil_mode), _pool_out(w, kw, sw, pw, dw, ceil_mode)
    if ho <= 0 or wo <= 0:
        raise ShapeError(f"pool2d: input of spatial size {(h, w)} is too small for kernel {k} with padding {p}")
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
               return_indices: bool = False) -> Tensor:
    _check_input("max_pool2d", x)
    if return_indices:
        raise NotImplementedError("max_pool2d: return_indices=True is not supported yet")
    k = _pair("max_pool2d", "kernel_size", kernel_size)
    s = _pair("max_pool2d", "stride", stride if stride is not None else kernel_size)
    p, d = _pair("max_pool2d", "padding", padding), _pair("max_pool2d", "dilation", dilation)
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"max_pool2d: padding {p} should be at most half of the kernel size {k}")
    windows = list(_windows(x, k, s, p, d, ceil_mode, RULES[Op.MAX].identity(x.dtype)))
    best = windows[0]
    for window in windows[1:]:
        best = maximum(best, window)
    if not (x.requires_grad and is_grad_enabled()):
        return best
    # as in torch, a window's gradient goes to its first maximal element, not shared among ties. Which
    # kernel offset that is, per output, is one byte (stored once, read by the forward sum and its
    # gradient), rather than a mask per offset
    target, last = best.detach(), len(windows) - 1
    # the last offset wins where no earlier one holds the maximum (one of them always does)
    which = full_like(target, last, dtype=dtypes.uint8 if last <= 255 else dtypes.int32)
    for k in reversed(range(last)):
        hit = (windows[k] == target) | (windows[k] != windows[k])  # a NaN is the maximum of its window
        which = where(hit, k, which)
    out = None
    for k, window in enumerate(windows):
        picked = where(which == k, window, 0)
        out = picked if out is None else out + picked
    return out


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


def adaptive_max_pool2d(x: Tensor, output_size, return_indices: bool = False) -> Tensor:
    """The maximum over bins of the last two dims, bin i of an axis spanning floor(i n / out) to
    ceil((i + 1) n / out), as torch's adaptive_max_pool2d."""
    _check_input("adaptive_max_pool2d", x)
    if return_indices:
        raise NotImplementedError("adaptive_max_pool2d: return_indices=True is not supported")
    oh, ow = _output_size("adaptive_max_pool2d", output_size, x)
    oh = x.shape[-2] if oh is None else oh
    ow = x.shape[-1] if ow is None else ow
    out = _adaptive_axis(x, x.ndim - 2, oh, lambda t, a: t.amax(a))
    return _adaptive_axis(out, x.ndim - 1, ow, lambda t, a: t.amax(a))

