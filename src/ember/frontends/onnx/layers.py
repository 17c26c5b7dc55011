"""ONNX's neural-network operators (convolution, pooling, normalization, dropout, the integer and quantized
convolutions and matmuls) as ember ops.

Convolutions of 1-d and 2-d images run on ember's conv2d (a 1-d image is one row high); ONNX's asymmetric and
automatic (SAME_UPPER / SAME_LOWER) paddings become an explicit pad first. Pooling of any rank is a pointwise
maximum or sum of the window's strided views of the padded input: one expression the compiler fuses, with ONNX's
ceil_mode, dilations and count_include_pad rules taken literally.
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext
from ember.frontends.onnx.tensors import slice_axis
from ember.frontends.onnx.values import numpy_type
from ember.nn import functional as F
from ember.ops.pooling import first_maximum


def _spatial(n: NodeContext, x, kernel: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads before, pads after) of a conv or pool node over `x`'s spatial dimensions."""
    rank = len(kernel)
    strides = n.attr("strides") or [1] * rank
    dilations = n.attr("dilations") or [1] * rank
    pads = n.attr("pads") or [0] * (2 * rank)
    auto = n.attr("auto_pad", "NOTSET")
    before, after = list(pads[:rank]), list(pads[rank:])
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        for i, size in enumerate(x.shape[2:]):
            out = -(-size // strides[i])
            total = max((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size, 0)
            small, large = total // 2, total - total // 2
            before[i], after[i] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        before, after = [0] * rank, [0] * rank
    return strides, dilations, before, after


def _pad_spatial(x, before, after, value=0.0):
    pads = []
    for lo, hi in zip(reversed(before), reversed(after)):
        pads += [lo, hi]
    return ember.pad(x, pads, value=value) if any(pads) else x


def _as_2d(x, rank: int):
    if rank == 1:
        return x.unsqueeze(2)
    if rank != 2:
        raise ValueError(rank)
    return x


def _conv(n: NodeContext, x, weight, bias=None):
    kernel = list(weight.shape[2:])
    rank = len(kernel)
    if rank not in (1, 2, 3):
        raise n.unsupported(f"a {rank}-d convolution (ember convolves 1-d, 2-d and 3-d images)")
    strides, dilations, before, after = _spatial(n, x, kernel)
    symmetric = before == after
    if not symmetric:
        x = _pad_spatial(x, before, after)
    if rank == 3:
        return ember.conv3d(x, weight, bias, tuple(strides), tuple(before) if symmetric else 0, tuple(dilations),
                            n.attr("group", 1))
    pair = (lambda v, one=1: (one, *v)) if rank == 1 else (lambda v, one=1: tuple(v))
    out = ember.conv2d(_as_2d(x, rank), _as_2d(weight, rank), bias, pair(strides),
                       pair(before if symmetric else [0] * rank, 0), pair(dilations), n.attr("group", 1))
    return out.squeeze(2) if rank == 1 else out


def _conv_transpose(n: NodeContext, x, weight, bias=None):
    kernel = list(weight.shape[2:])
    rank = len(kernel)
    if rank not in (1, 2, 3):
        raise n.unsupported(f"a {rank}-d transposed convolution (ember convolves 1-d, 2-d and 3-d images)")
    strides = n.attr("strides") or [1] * rank
    dilations = n.attr("dilations") or [1] * rank
    extra = list(n.attr("output_padding") or [0] * rank)
    pads = n.attr("pads") or [0] * (2 * rank)
    before, after = list(pads[:rank]), list(pads[rank:])
    full = [(s - 1) * st + (k - 1) * d + 1 + e for s, st, k, d, e in
            zip(x.shape[2:], strides, kernel, dilations, extra)]
    wanted = n.attr("output_shape")
    auto = n.attr("auto_pad", "NOTSET")
    if wanted or auto in ("SAME_UPPER", "SAME_LOWER"):
        wanted = list(wanted)[-rank:] if wanted else [s * st for s, st in zip(x.shape[2:], strides)]
        for i in range(rank):
            total = full[i] - wanted[i]
            if total < 0:  # a larger output than the convolution reaches: zeros after it (and the bias)
                extra[i], full[i], total = extra[i] - total, wanted[i], 0
            small, large = total // 2, total - total // 2
            before[i], after[i] = (small, large) if auto != "SAME_LOWER" else (large, small)
    if rank == 3:
        out = ember.conv_transpose3d(x, weight, None, tuple(strides), 0, 0, n.attr("group", 1), tuple(dilations))
    else:
        pair = (lambda v: (1, *v)) if rank == 1 else tuple
        out = ember.conv_transpose2d(_as_2d(x, rank), _as_2d(weight, rank), None, pair(strides), 0,
                                     (0, 0), n.attr("group", 1), pair(dilations))
        out = out.squeeze(2) if rank == 1 else out
    for i in range(rank):  # output_padding's rows get no contribution: zeros (and the bias)
        if extra[i]:
            pad = [0, 0] * (rank - 1 - i) + [0, extra[i]]
            out = ember.pad(out, pad)
        out = slice_axis(out, 2 + i, before[i], full[i] - after[i], 1)
    return out if bias is None else out + bias.reshape(1, -1, *([1] * rank))


class _Windows:
    """A pooling node's windows over `x`: the output's spatial size and each window offset's index (strided slices)
    into the input padded by `before` and `after` (ONNX's pads, and as much more after as ceil_mode's last
    windows overhang)."""

    def __init__(self, n: NodeContext, x, kernel: list[int]):
        self.strides, self.dilations, self.before, pads_after = _spatial(n, x, kernel)
        sizes = x.shape[2:]
        ceil = n.attr("ceil_mode", 0)
        self.out = []
        for i, size in enumerate(sizes):
            span = (kernel[i] - 1) * self.dilations[i] + 1
            count = (size + self.before[i] + pads_after[i] - span) / self.strides[i] + 1
            count = math.ceil(count) if ceil else math.floor(count)
            if ceil and (count - 1) * self.strides[i] >= size + self.before[i]:
                count -= 1  # the last window would start in the padding after the input
            self.out.append(max(count, 0))
        self.pads_after = pads_after
        self.after = [max((o - 1) * st + (k - 1) * d + 1 - s - b, a) for o, st, k, d, s, b, a in
                      zip(self.out, self.strides, kernel, self.dilations, sizes, self.before, pads_after)]
        self.indices = []
        for offset in np.ndindex(*kernel):
            starts = [k * d for k, d in zip(offset, self.dilations)]
            self.indices.append((slice(None), slice(None), *(
                slice(start, start + (o - 1) * st + 1, st) for start, o, st in zip(starts, self.out, self.strides))))

    def views(self, x, fill) -> list:
        padded = _pad_spatial(x, self.before, self.after, fill)
        return [padded[index] for index in self.indices]

    def counts(self, sizes, include_pad: bool) -> np.ndarray:
        """How many elements each window averages: the input's, and the explicit pads' where `include_pad` (never
        the overhang of ceil_mode)."""
        mask = np.pad(np.ones((1, 1, *sizes)), [(0, 0), (0, 0), *zip(self.before, self.pads_after)],
                      constant_values=float(include_pad))
        mask = np.pad(mask, [(0, 0), (0, 0), *((0, a - p) for a, p in zip(self.after, self.pads_after))])
        return sum(mask[index] for index in self.indices)


def _lowest(dtype):
    return -math.inf if dtype.is_floating_point else int(np.iinfo(dtype.np).min)


def _max_pool(n: NodeContext, x):
    kernel = n.attr("kernel_shape")
    windows = _Windows(n, x, kernel)
    views = windows.views(x, _lowest(x.dtype))
    if len(n.node.output) < 2 or not n.node.output[1]:  # a pointwise maximum of the views: one fused kernel
        return first_maximum(views, x.requires_grad and ember.is_grad_enabled())
    stacked = ember.stack(views, 0)
    return stacked.amax(0), _pool_indices(n, x, stacked.argmax(0), kernel, windows)


def _pool_indices(n: NodeContext, x, offset, kernel, windows: _Windows):
    """MaxPool's second output: each maximum's position in the flattened input (row-major, or column-major over
    the spatial dimensions with storage_order 1)."""
    rank = len(kernel)
    sizes = x.shape[2:]
    spatial_strides = [math.prod(sizes[i + 1:]) for i in range(rank)]
    if n.attr("storage_order", 0):
        spatial_strides = [math.prod(sizes[:i]) for i in range(rank)]
    flat = None
    for i in range(rank):
        k = ember.remainder(ember.div(offset, math.prod(kernel[i + 1:]), rounding_mode="floor"), kernel[i])
        shape = [1] * (2 + rank)
        shape[2 + i] = windows.out[i]
        start = np.arange(windows.out[i]) * windows.strides[i] - windows.before[i]
        term = (n.const(start.reshape(shape).astype(np.int64)) + k * windows.dilations[i]) * spatial_strides[i]
        flat = term if flat is None else flat + term
    planes = np.arange(x.shape[0] * x.shape[1]).reshape(x.shape[0], x.shape[1], *([1] * rank)) * math.prod(sizes)
    return flat + n.const(planes.astype(np.int64))


def _average_pool(n: NodeContext, x):
    windows = _Windows(n, x, n.attr("kernel_shape"))
    total = reduce(ember.add, windows.views(x, 0.0))
    counts = windows.counts(x.shape[2:], bool(n.attr("count_include_pad", 0)))
    return total / n.const(counts, x)


def _lp_pool(n: NodeContext, x):
    p = float(n.attr("p", 2))
    views = _Windows(n, x, n.attr("kernel_shape")).views(x, 0.0)
    return ember.pow(reduce(ember.add, [ember.pow(ember.abs(v), p) for v in views]), 1.0 / p)


def _max_unpool(n: NodeContext, x, indices, output_shape=None):
    """Each value placed at its (flattened) index in a zero tensor of the unpooled shape."""
    kernel = n.attr("kernel_shape")
    strides = n.attr("strides") or [1] * len(kernel)
    pads = n.attr("pads") or [0] * (2 * len(kernel))
    rank = len(kernel)
    pooled_from = (*x.shape[:2], *((s - 1) * st + k - pads[i] - pads[i + rank] for i, (s, st, k) in
                                   enumerate(zip(x.shape[2:], strides, kernel))))
    shape = pooled_from if output_shape is None else tuple(n.ints(output_shape))
    indices = indices.reshape(-1).to(dtypes.int64)
    if shape != pooled_from:  # the indices count positions of the unpadded shape: the same positions in `shape`
        rest, moved = indices, None
        strides_out = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        for size, stride in zip(reversed(pooled_from), reversed(strides_out)):
            term = ember.remainder(rest, size) * stride
            moved, rest = term if moved is None else moved + term, ember.div(rest, size, rounding_mode="floor")
        indices = moved
    flat = ember.zeros((math.prod(shape),), dtype=x.dtype, device=x.device)
    return ember.scatter_add(flat, 0, indices, x.reshape(-1)).reshape(shape)


def _col2im(n: NodeContext, x, image_shape, block_shape):
    """Col2Im: the columns summed back into the image (ember's fold), over the image padded by `pads`, then cropped."""
    image, block = n.ints(image_shape), n.ints(block_shape)
    if len(image) != 2:
        raise n.unsupported(f"a {len(image)}-d image (ember folds 2-d images)")
    pads = n.attr("pads") or [0, 0, 0, 0]
    padded = (image[0] + pads[0] + pads[2], image[1] + pads[1] + pads[3])
    out = F.fold(x, padded, tuple(block), tuple(n.attr("dilations") or (1, 1)), 0,
                     tuple(n.attr("strides") or (1, 1)))
    return out[..., pads[0]:pads[0] + image[0], pads[1]:pads[1] + image[1]]


def _deform_conv(n: NodeContext, x, weight, offset, bias=None, mask=None):
    """DeformConv (2-d): each kernel tap samples the input bilinearly (zero outside) at its place moved by the
    offsets, scaled by the mask; the samples are then contracted with the weights, group by group, as columns."""
    if x.ndim != 4:
        raise n.unsupported(f"a {x.ndim - 2}-d deformable convolution (ember's is 2-d)")
    batch, channels, height, width = x.shape
    kh, kw = n.attr("kernel_shape") or weight.shape[2:]
    sh, sw = n.attr("strides") or (1, 1)
    dh, dw = n.attr("dilations") or (1, 1)
    pads = n.attr("pads") or (0, 0, 0, 0)
    groups, offset_groups = n.attr("group", 1), n.attr("offset_group", 1)
    out_h, out_w = offset.shape[2:]
    taps, points = kh * kw, out_h * out_w
    moves = offset.reshape(batch, offset_groups, kh, kw, 2, out_h, out_w)
    rows = (np.arange(kh)[:, None, None, None] * dh + np.arange(out_h)[None, None, :, None] * sh - pads[0])
    cols = (np.arange(kw)[None, :, None, None] * dw + np.arange(out_w)[None, None, None, :] * sw - pads[1])
    y = moves[:, :, :, :, 0] + n.const(rows.astype(np.float64), x)
    xs = moves[:, :, :, :, 1] + n.const(cols.astype(np.float64), x)
    y0, x0 = ember.floor(y), ember.floor(xs)
    image = x.reshape(batch, offset_groups, channels // offset_groups, height * width)
    sampled = None
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        ty, tx = y0 + dy, x0 + dx
        w = (1 - ember.abs(y - ty)) * (1 - ember.abs(xs - tx))
        inside = (ty >= 0) & (ty <= height - 1) & (tx >= 0) & (tx <= width - 1)
        flat = (ember.clamp(ty, 0.0, height - 1.0) * width + ember.clamp(tx, 0.0, width - 1.0)).to(dtypes.int64)
        index = flat.reshape(batch, offset_groups, 1, taps * points).expand(*image.shape[:3], taps * points)
        term = ember.gather(image, 3, index) * ember.where(inside, w, ember.zeros_like(w)).reshape(
            batch, offset_groups, 1, taps * points)
        sampled = term if sampled is None else sampled + term
    if mask is not None:
        sampled = sampled * mask.reshape(batch, offset_groups, 1, taps * points)
    columns = sampled.reshape(batch, channels, taps, points)
    per_in, per_out = channels // groups, weight.shape[0] // groups
    outs = [weight[g * per_out:(g + 1) * per_out].reshape(per_out, per_in * taps) @
            columns[:, g * per_in:(g + 1) * per_in].reshape(batch, per_in * taps, points) for g in range(groups)]
    out = (ember.cat(outs, 1) if groups > 1 else outs[0]).reshape(batch, -1, out_h, out_w)
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


def _global(fn):
    return lambda n, x: fn(x, tuple(range(2, x.ndim)), keepdim=True)


def _batch_norm(n: NodeContext, x, scale, bias, mean, var):
    eps = n.attr("epsilon", 1e-5)
    shape = (1, -1, *([1] * (x.ndim - 2)))
    training = n.attr("training_mode", 0) or (n.opset < 9 and not n.attr("is_test", 1) and len(n.node.output) > 1)
    if training:
        dims = (0, *range(2, x.ndim))
        batch_mean = x.mean(dims)
        batch_var = ((x - batch_mean.reshape(shape)) ** 2).mean(dims)
        momentum = n.attr("momentum", 0.9)
        y = (x - batch_mean.reshape(shape)) / ember.sqrt(batch_var.reshape(shape) + eps) * scale.reshape(shape) \
            + bias.reshape(shape)
        return y, mean * momentum + batch_mean * (1 - momentum), var * momentum + batch_var * (1 - momentum)
    return (x - mean.reshape(shape)) / ember.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) \
        + bias.reshape(shape)


def _instance_norm(n: NodeContext, x, scale, bias):
    dims = tuple(range(2, x.ndim))
    shape = (1, -1, *([1] * (x.ndim - 2)))
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    return (x - mean) / ember.sqrt(var + n.attr("epsilon", 1e-5)) * scale.reshape(shape) + bias.reshape(shape)


def _lrn(n: NodeContext, x):
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    squares = x * x
    lo, hi = (size - 1) // 2, size // 2
    padded = ember.pad(squares, [0, 0] * (x.ndim - 2) + [lo, hi])
    window = sum(slice_axis(padded, 1, i, i + x.shape[1], 1) for i in range(size))
    return x / ember.pow(window * (alpha / size) + bias, beta)


def _lp_normalization(n: NodeContext, x):
    axis = n.attr("axis", -1) % x.ndim
    if n.attr("p", 2) == 1:
        norm = ember.abs(x).sum(axis, keepdim=True)
    else:
        norm = ember.sqrt((x * x).sum(axis, keepdim=True))
    return ember.where(norm == 0, ember.zeros_like(x), x / ember.where(norm == 0, ember.ones_like(norm), norm))


def _dropout(n: NodeContext, x, ratio=None, training=None):
    training = bool(n.static(training)) if training is not None else \
        (n.opset < 7 and not n.attr("is_test", 0))
    ratio = float(n.static(ratio)) if ratio is not None else n.attr("ratio", 0.5)
    if training and ratio > 0:
        keep = ember.rand(x.shape, device=x.device) >= ratio
        return x * keep.to(x.dtype) / (1 - ratio), keep
    return x, ember.ones(x.shape, dtype=dtypes.bool_, device=x.device)


def _centred(x, zero_point, axis_shape=None):
    """An integer operand less its zero point, in float64 (exact), the zero point laid along `axis_shape` when it
    is a vector."""
    wide = x.to(dtypes.float64)
    if zero_point is None:
        return wide
    zero = zero_point.to(dtypes.float64)
    return wide - (zero.reshape(axis_shape) if zero.ndim == 1 and axis_shape else zero)


def _matmul_integer(n: NodeContext, a, b, a_zero=None, b_zero=None):
    out = _centred(a, a_zero, (-1, 1)) @ _centred(b, b_zero, (1, -1))
    return out.to(dtypes.int32)


def _conv_integer(n: NodeContext, x, w, x_zero=None, w_zero=None):
    centred_w = _centred(w, w_zero, (-1, *([1] * (w.ndim - 1))))
    return _conv(n, _centred(x, x_zero), centred_w).to(dtypes.int32)


def _requantized(n: NodeContext, value, scale, zero, zero_index: int):
    """A float result quantized to the type of its zero point (ONNX's QLinear* outputs): rounded half to even,
    saturated."""
    declared = n.declared_type(zero_index)
    npd = numpy_type(declared) if declared else zero.dtype.np
    info = np.iinfo(npd)
    q = ember.round(value / scale.to(value.dtype)) + zero.to(value.dtype)
    return ember.clamp(q, float(info.min), float(info.max)).to(zero.dtype)


def _qlinear_matmul(n: NodeContext, a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero):
    da = _centred(a, a_zero, (-1, 1)).to(dtypes.float32) * (a_scale.reshape(-1, 1) if a_scale.ndim == 1 else a_scale)
    db = _centred(b, b_zero, (1, -1)).to(dtypes.float32) * (b_scale.reshape(1, -1) if b_scale.ndim == 1 else b_scale)
    return _requantized(n, da @ db, y_scale, y_zero, 7)


def _qlinear_conv(n: NodeContext, x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias=None):
    per_channel = (-1, *([1] * (w.ndim - 1)))
    dx = _centred(x, x_zero).to(dtypes.float32) * x_scale
    dw = _centred(w, w_zero, per_channel).to(dtypes.float32) * (w_scale.reshape(per_channel) if w_scale.ndim == 1
                                                               else w_scale)
    out = _conv(n, dx, dw)
    if bias is not None:
        scale = (x_scale * w_scale).reshape(-1) if w_scale.ndim == 1 else (x_scale * w_scale).reshape(1)
        out = out + (bias.to(dtypes.float32) * scale).reshape(1, -1, *([1] * (out.ndim - 2)))
    return _requantized(n, out, y_scale, y_zero, 7)


OPS = {
    "Conv": _conv, "ConvTranspose": _conv_transpose, "MaxPool": _max_pool, "AveragePool": _average_pool,
    "LpPool": _lp_pool, "MaxUnpool": _max_unpool, "Col2Im": _col2im,
    "DeformConv": _deform_conv, "GlobalAveragePool": _global(ember.mean),
    "GlobalMaxPool": _global(ember.amax),
    "GlobalLpPool": lambda n, x: ember.pow(ember.pow(ember.abs(x), float(n.attr("p", 2))).sum(
        tuple(range(2, x.ndim)), keepdim=True), 1.0 / n.attr("p", 2)),
    "BatchNormalization": _batch_norm, "InstanceNormalization": _instance_norm, "LRN": _lrn,
    "LpNormalization": _lp_normalization, "Dropout": _dropout, "MatMulInteger": _matmul_integer,
    "ConvInteger": _conv_integer, "QLinearMatMul": _qlinear_matmul, "QLinearConv": _qlinear_conv,
}
