"""ATen operators on ember tensors: the core ATen operator set (what torch.export and AOTAutograd produce, with
torch's decompositions applied to the rest) mapped to ember's ops. `ember.frontends.aten_graph` runs a torch.fx
graph of such operators by this table, building one lazy ember graph that the compiler fuses like any other.

`OPS` is the one table: ATen overload name ("aten.add.Tensor"), or its packet's ("aten.add") for every overload
with the same meaning, to a function of ember tensors and the node's Python arguments (dtypes and devices as torch
names them). A backward operator torch keeps whole (a convolution's, max pooling's, attention's) is the
vector-Jacobian product of ember's own forward op, taken by ember's autograd: each derivative keeps one home, the
VJP rules of ember's ops. Its forward's auxiliary outputs (max pooling's indices, attention's log-sum-exp) are
ember's own where ember computes them (where each window's maximum lies in it, one byte; the attention rows'
log-sum-exp), so the backward reads them instead of computing the forward again, and are read by nothing else in
the graphs torch makes; a graph that reads them elsewhere is refused at translation (`aten_graph.AtenGraph`), as
is any operator the table lacks, all named in one error. The attention operators
have a module of their own, `aten_attention`, whose entries join this table.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable

import ember
from ember import dtypes
from ember.autograd import enable_grad
from ember.device import as_device
from ember.ir import Op
from ember.nn import functional as F
from ember.ops import pooling
from ember.ops.index import checked, one_per_row, picked
from ember.ops.movement import dilate_axis, pad_axis
from ember.tensor import Tensor


def _dtype(d):
    return None if d is None else dtypes.as_dtype(d)


_placement = threading.local()  # device: where the running graph makes its new tensors (None: where torch said)


def _device(d):
    if d is None:
        return None
    placed = getattr(_placement, "device", None)
    return placed if placed is not None else as_device(str(d))


def _vjp(forward: Callable, inputs: list, grad: Tensor, wanted: list[bool] | None = None) -> list:
    """The gradients of `forward(*inputs)` to the inputs (None where not `wanted`), given its output's `grad`, by
    ember's autograd: the backward of the ember op, whatever torch's backward operator computes."""
    wanted = wanted or [True] * len(inputs)
    leaves = [x.detach().requires_grad_(w) if isinstance(x, Tensor) else x for x, w in zip(inputs, wanted)]
    with enable_grad():
        out = forward(*leaves)
        asked = [x for x, w in zip(leaves, wanted) if w and isinstance(x, Tensor)]
        grads = iter(ember.grad(out, asked, grad, allow_unused=True) if asked else [])
    return [next(grads) if w and isinstance(x, Tensor) else None for x, w in zip(leaves, wanted)]


# -- views and copies --------------------------------------------------------------------------------------------

def _to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if device is not None and _device(device) != x.device:
        x = x.to(_device(device))
    return x.to(_dtype(dtype)) if dtype is not None else x.clone()


def _slice(x, dim=0, start=None, end=None, step=1):
    size = x.shape[dim]
    start = 0 if start is None else start + size if start < 0 else min(start, size)
    end = size if end is None else end + size if end < 0 else min(end, size)
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, max(end, start), step)
    return x[tuple(index)]


def _select(x, dim, index):
    where = [slice(None)] * x.ndim
    where[dim] = index
    return x[tuple(where)]


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """x with the slice `_slice(x, dim, start, end, step)` replaced by src (what functionalization writes for an
    assignment into a slice): src spread to its positions along dim, chosen where the slice reads."""
    dim = dim % x.ndim
    size = x.shape[dim]
    start = 0 if start is None else start + size if start < 0 else min(start, size)
    count = src.shape[dim]
    if count == 0:
        return x
    mask = ember.ones(tuple(count if d == dim else 1 for d in range(x.ndim)), dtype=dtypes.bool_, device=x.device)
    placed, mask = (dilate_axis(t, dim, step) if step > 1 else t for t in (src.to(x.dtype), mask))
    placed, mask = (pad_axis(t, dim, start, size - start - t.shape[dim]) for t in (placed, mask))
    return ember.where(mask, placed, x)


def _select_scatter(x, src, dim, index):
    """x with its `index`-th slice along dim replaced by src."""
    index = index % x.shape[dim % x.ndim] if x.shape[dim % x.ndim] else index
    return _slice_scatter(x, src.unsqueeze(dim % x.ndim), dim, index, index + 1)


def _squeeze(x, dims=None):
    if dims is None:
        return x.squeeze()
    dims = [dims] if isinstance(dims, int) else dims
    dims = sorted((d % x.ndim for d in dims if x.shape[d % x.ndim] == 1), reverse=True)
    for d in dims:
        x = x.squeeze(d)
    return x


def _split_with_sizes(x, sizes, dim=0):
    return list(x.split(list(sizes), dim))


def _expand(x, size, implicit=False):
    return x.expand(*[x.shape[i - (len(size) - x.ndim)] if s == -1 else s for i, s in enumerate(size)])


# -- creation ----------------------------------------------------------------------------------------------------

def _full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None, requires_grad=False):
    return ember.full(tuple(size), fill_value, dtype=_dtype(dtype) or dtypes.scalar_dtype(fill_value),
                      device=_device(device))


def _full_like(x, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return ember.full(x.shape, fill_value, dtype=_dtype(dtype) or x.dtype, device=_device(device) or x.device)


def _arange(start, end=None, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    if end is None:
        start, end = 0, start
    return ember.arange(start, end, step, dtype=_dtype(dtype), device=_device(device))


def _scalar_tensor(value, dtype=None, layout=None, device=None, pin_memory=None):
    """A constant in the graph (folded into the kernels that read it), not a value uploaded each call."""
    return ember.full((), value, dtype=_dtype(dtype) or dtypes.float32, device=_device(device))


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return ember.zeros(tuple(size), dtype=_dtype(dtype) or dtypes.float32, device=_device(device))


# -- arithmetic --------------------------------------------------------------------------------------------------

def _add(x, y, alpha=1):
    return x + (y * alpha if alpha != 1 else y)


def _sub(x, y, alpha=1):
    return x - (y * alpha if alpha != 1 else y)


def _div(x, y, rounding_mode=None):
    if rounding_mode is None:
        return ember.div(x, y)
    return ember.div(x, y, rounding_mode=rounding_mode)


def _clamp(x, min=None, max=None):
    return ember.clamp(x, min, max)


def _sum(x, dims=None, keepdim=False, dtype=None):
    x = x.to(_dtype(dtype)) if dtype is not None else x
    return x.sum() if not dims else x.sum(tuple(dims), keepdim=keepdim)


def _mean(x, dims=None, keepdim=False, dtype=None):
    x = x.to(_dtype(dtype)) if dtype is not None else x
    return x.mean() if not dims else x.mean(tuple(dims), keepdim=keepdim)


def _var(x, dims=None, correction=None, keepdim=False):
    correction = 1 if correction is None else correction
    dims = tuple(range(x.ndim)) if not dims else tuple(dims)
    count = math.prod(x.shape[d] for d in dims)
    mean = x.mean(dims, keepdim=True)
    return ((x - mean).square().sum(dims, keepdim=keepdim)) / max(count - correction, 0)


def _vector_norm(x, ord=2, dims=None, keepdim=False, dtype=None):
    x = x.to(_dtype(dtype)) if dtype is not None else x
    dims = tuple(range(x.ndim)) if dims is None or dims == [] else dims if isinstance(dims, int) else tuple(dims)
    return ember.norm(x, ord, dims, keepdim)


def _reduce(fn):
    def reduce(x, dims=None, keepdim=False):
        if dims is None or (isinstance(dims, (list, tuple)) and not dims):
            return fn(x)
        return fn(x, tuple(dims) if isinstance(dims, (list, tuple)) else dims, keepdim=keepdim)
    return reduce


def _max_dim(x, dim, keepdim=False):
    values, indices = x.max(dim, keepdim=keepdim)
    return values, indices


def _min_dim(x, dim, keepdim=False):
    values, indices = x.min(dim, keepdim=keepdim)
    return values, indices


def _where(condition, x, y):
    return ember.where(condition, x, y)


def _pow(x, exponent):
    return x ** exponent if isinstance(x, Tensor) else ember.pow(x, exponent)


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """aten.elu (SELU is one with its scales): scale * (x if x > 0 else alpha * (exp(x * input_scale) - 1))."""
    out = ember.where(x > 0, x, ember.expm1(x * input_scale) * alpha)
    return out * scale if scale != 1 else out


def _gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def _scatter(x, dim, index, src, reduce=None):
    """scatter.value / scatter.src: positions the index names take the value; a position named several times
    (which torch leaves undefined) takes the mean of its values, so equal copies give that value. One position
    per row (an index of size 1 along dim, as large as x elsewhere: nll_loss's backward) is a select."""
    if reduce is not None:
        raise NotImplementedError(f"aten.scatter with reduce={reduce!r} is not supported")
    axis = dim % max(x.ndim, 1)
    if one_per_row(x, axis, index):
        value = _select_like(src, index) if isinstance(src, Tensor) else ember.full((), src, dtype=x.dtype,
                                                                                     device=x.device)
        return ember.where(picked(x, axis, checked("scatter", index, x.shape[axis], axis)), value, x)
    ones = ember.ones(index.shape, dtype=x.dtype, device=x.device)
    count = ember.scatter_add(ember.zeros(x.shape, dtype=x.dtype, device=x.device), dim, index, ones)
    hit = count > 0
    if not isinstance(src, Tensor):
        return ember.where(hit, ember.full((), src, dtype=x.dtype, device=x.device), x)
    placed = ember.scatter_add(ember.zeros(x.shape, dtype=x.dtype, device=x.device), dim, index,
                               _select_like(src, index))
    if x.dtype is not dtypes.bool_:
        placed = ember.div(placed, ember.where(hit, count, ember.ones_like(count)),
                           rounding_mode=None if x.dtype.is_floating_point else "floor")
    return ember.where(hit, placed, x)


def _select_like(src, index):
    return src[tuple(slice(0, n) for n in index.shape)] if src.shape != index.shape else src


def _index_put(x, indices, values, accumulate=False):
    """x[indices] = values (or +=, with `accumulate`, where repeated positions add up): the flat positions the
    indices select in x, scattered into x flattened (what decomposed backward operators, an upsampling's, write)."""
    positions = _index(ember.arange(x.numel(), device=x.device).reshape(x.shape), indices)
    values = ember.broadcast_to(values, positions.shape).reshape(-1)
    positions, flat = positions.reshape(-1), x.reshape(-1)
    put = ember.scatter_add(flat, 0, positions, values) if accumulate else _scatter(flat, 0, positions, values)
    return put.reshape(x.shape)


def _index(x, indices):
    return x[tuple(slice(None) if i is None else i for i in indices)]


def _constant_pad_nd(x, pad, value=0.0):
    return ember.pad(x, list(pad), value=value)


def _padding(mode: str) -> dict:
    """aten.{reflection,replication}_pad{1,2,3}d and their backward operators (`mode` ember.pad's name)."""
    def backward(grad, x, padding):
        (dx,) = _vjp(lambda a: ember.pad(a, list(padding), mode=mode), [x], grad)
        return dx
    name = {"reflect": "reflection", "replicate": "replication"}[mode]
    table = {}
    for rank in (1, 2, 3):
        table[f"aten.{name}_pad{rank}d"] = lambda x, padding: ember.pad(x, list(padding), mode=mode)
        table[f"aten.{name}_pad{rank}d_backward"] = backward
    return table


def _native_dropout(x, p, train=True):
    if not train or p == 0:
        return x, ember.ones(x.shape, dtype=dtypes.bool_, device=x.device)
    keep = ember.rand(x.shape, device=x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p)), keep


# -- neural-network operators --------------------------------------------------------------------------------------

def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        convolve = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}.get(x.ndim)
        if convolve is None:
            raise NotImplementedError(f"aten.convolution, transposed, of a {x.ndim - 2}-d input (shape {x.shape}): "
                                      f"ember's transposed convolutions are 1-, 2- and 3-d")
        return convolve(x, weight, bias, tuple(stride), tuple(padding), tuple(output_padding), groups,
                        tuple(dilation))
    convolve = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}.get(x.ndim)
    if convolve is None:
        raise NotImplementedError(f"aten.convolution of a {x.ndim - 2}-d input: ember convolves 1-, 2- and 3-d inputs")
    return convolve(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def _convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask):
    dx, dw = _vjp(lambda a, w: _convolution(a, w, None, stride, padding, dilation, transposed, output_padding,
                                            groups), [x, weight], grad, list(output_mask[:2]))
    db = grad.sum((0, *range(2, grad.ndim))) if output_mask[2] else None
    return dx, dw, db


# -- pooling, 2-d and 3-d: the rank is the kernel's ----------------------------------------------------------------

_MAX_POOLS, _AVG_POOLS = {2: F.max_pool2d, 3: F.max_pool3d}, {2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAPTIVE_AVG_POOLS = {2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def _spread(v, rank: int) -> tuple:
    """An int[] argument of a pooling (an int, one entry for every axis, or one per axis) as one per axis."""
    v = (v,) if isinstance(v, int) else tuple(v)
    return v * rank if len(v) == 1 else v


def _max_pool(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    rank = len(kernel_size)
    return _MAX_POOLS[rank](x, tuple(kernel_size), tuple(stride) or None, _spread(padding, rank),
                            _spread(dilation, rank), ceil_mode)


def _max_pool_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """The pooled values and, in the indices' place (read by the backward alone, see aten_graph), where each window's
    first maximum lies in it, as ember's gradient reads it: one byte, not torch's int64 position in the input plane;
    nothing where ember's pooling is no MAX_POOL2D node (3-d, dilated)."""
    out = _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode)
    if out._node.op is Op.MAX_POOL2D:
        return out, pooling.max_pool2d_windows(x, out)
    return out, _NotComputed(f"the indices of aten.max_pool{len(kernel_size)}d_with_indices", out.shape)


def _max_pool_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    def forward(a):
        return _max_pool(a, kernel_size, stride, padding, dilation, ceil_mode)

    if isinstance(indices, Tensor) and indices.dtype is not dtypes.int64:  # the forward's windows (above)
        node = forward(x)._node  # not computed: the attributes its gradient needs
        if node.op is Op.MAX_POOL2D:
            return pooling.max_pool2d_grad(grad, indices, x.shape, node.attrs)
    (dx,) = _vjp(forward, [x], grad)
    return dx


def _avg_pool(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    rank = len(kernel_size)
    return _AVG_POOLS[rank](x, tuple(kernel_size), tuple(stride) or None, _spread(padding, rank), ceil_mode,
                            count_include_pad, divisor_override)


def _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    (dx,) = _vjp(lambda a: _avg_pool(a, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                     divisor_override), [x], grad)
    return dx


def _adaptive_avg_pool(x, size):
    return _ADAPTIVE_AVG_POOLS[len(size)](x, tuple(size))


def _adaptive_avg_pool_backward(rank: int):
    def backward(grad, x):
        (dx,) = _vjp(lambda a: _adaptive_avg_pool(a, grad.shape[-rank:]), [x], grad)
        return dx
    return backward


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = x.mean(dims, keepdim=True)
    rstd = ((x - mean).square().mean(dims, keepdim=True) + eps).rsqrt()
    out = F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)
    return out, mean, rstd


def _batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """_native_batch_norm_legit_functional: the output, the batch mean and inverse deviation, and the new
    running statistics (unbiased variance), as values; half-precision inputs are normalized in float32."""
    dims = (0, *range(2, x.ndim))
    shape = (1, -1, *([1] * (x.ndim - 2)))
    wide = x if x.dtype in (dtypes.float32, dtypes.float64) else x.float()
    if training:
        mean = wide.mean(dims)
        var = _var(wide, dims, 0)
    else:
        mean, var = running_mean.to(wide.dtype), running_var.to(wide.dtype)
    rstd = (var + eps).rsqrt()
    out = (wide - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.to(wide.dtype).reshape(shape)
    if bias is not None:
        out = out + bias.to(wide.dtype).reshape(shape)
    out = out.to(x.dtype)
    if running_mean is None or not training:
        return out, mean, rstd, running_mean, running_var
    count = x.numel() // x.shape[1]
    new_mean = (running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum)
    new_var = (running_var * (1 - momentum) + (var * (count / max(count - 1, 1))).to(running_var.dtype) * momentum)
    return out, mean, rstd, new_mean, new_var


def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, rstd, _, _ = _batch_norm_functional(x, weight, bias, None, None, True, momentum, eps)
    return out, mean, rstd


def _batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, rstd, _, _ = _batch_norm_functional(x, weight, bias, running_mean, running_var, False, momentum, eps)
    return out, _empty_like(x), _empty_like(x)


def _empty_like(x, *args, **kwargs):
    return ember.zeros((0,), dtype=dtypes.float32, device=x.device)


def _native_group_norm(x, weight, bias, n, c, hw, groups, eps):
    grouped = x.reshape(n, groups, -1)
    mean = grouped.mean(2)
    rstd = (_var(grouped, (2,), 0) + eps).rsqrt()
    return F.group_norm(x, groups, weight, bias, eps), mean, rstd


def _softmax(x, dim, half_to_float=False):
    return F.softmax(x.float() if half_to_float else x, dim)


def _log_softmax(x, dim, half_to_float=False):
    return F.log_softmax(x.float() if half_to_float else x, dim)


def _softmax_backward(grad, out, dim, input_dtype):
    g = grad * out
    return (g - out * g.sum(dim, keepdim=True)).to(_dtype(input_dtype))


def _log_softmax_backward(grad, out, dim, input_dtype):
    return (grad - out.exp() * grad.sum(dim, keepdim=True)).to(_dtype(input_dtype))


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return ember.embedding(indices, weight, None if padding_idx < 0 else padding_idx)


def _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    weight = ember.zeros((num_weights, grad.shape[-1]), dtype=grad.dtype, device=grad.device)
    (dw,) = _vjp(lambda w: ember.embedding(indices, w, None if padding_idx < 0 else padding_idx), [weight], grad)
    return dw


def _upsample(mode):
    """aten.upsample_{mode}, both overloads: (x, output_size, [align_corners,] scales...) and .vec's
    (x, output_size or None, [align_corners,] scale_factors or None). Where every axis has its scale, the
    source positions are computed from the scales, as torch computes them."""
    def upsample(x, output_size, *rest):
        align_corners = None
        if mode != "nearest":
            align_corners, rest = rest[0], rest[1:]
        scales = rest[0] if len(rest) == 1 and not isinstance(rest[0], (int, float)) else rest  # .vec: one list
        scales = tuple(scales or ())
        spatial = x.shape[2:]
        if len(scales) == len(spatial) and None not in scales and (
                output_size is None or all(int(n * f) == m for n, f, m in zip(spatial, scales, output_size))):
            return F.interpolate(x, scale_factor=scales, mode=mode, align_corners=align_corners)
        return F.interpolate(x, size=tuple(output_size), mode=mode, align_corners=align_corners)
    return upsample


def _histc(x, bins=100, min=0, max=0):  # noqa: A002 (torch's argument names)
    """torch.histc: counts of `x` in `bins` equal bins over [min, max] (the data's own range where min == max, widened
    by 1 each way where that is one value); values outside the range, and NaN, are not counted; one equal to max is
    in the last bin. The counts in x's dtype (float32 for integers). A range that is not finite (the data's, with a
    NaN or an infinity) counts nothing, where torch raises: the data are not read on the host."""
    dtype = x.dtype if x.dtype.is_floating_point else dtypes.float32
    if x.numel() == 0:
        return ember.zeros((bins,), dtype=dtype, device=x.device)
    v = x.reshape(-1).to(dtype)
    lo, hi = (v.min(), v.max()) if min == max else (ember.full((), min, dtype=dtype, device=x.device),
                                                   ember.full((), max, dtype=dtype, device=x.device))
    same = lo == hi
    lo, hi = ember.where(same, lo - 1, lo), ember.where(same, hi + 1, hi)
    inside = (v >= lo) & (v <= hi)
    position = ember.floor((v - lo) * bins / (hi - lo)).to(dtypes.int64)
    position = ember.where(inside, ember.clamp(position, 0, bins - 1), ember.full((), bins, dtype=dtypes.int64,
                                                                                  device=x.device))
    counts = ember.scatter_add(ember.zeros((bins + 1,), dtype=dtype, device=x.device), 0, position,
                               ember.ones(position.shape, dtype=dtype, device=x.device))
    return counts[:bins]


def _groups(x, offs):
    """The group of each row of `x`, as a grouped matmul's cumulative row counts `offs` place it (the number of
    groups for rows past the last)."""
    rows = ember.arange(x.shape[0], device=x.device)
    return (offs.reshape(1, -1) <= rows.reshape(-1, 1)).to(dtypes.int64).sum(1)


def _grouped_mm(x, weight, offs=None, bias=None, out_dtype=None):
    """A grouped matmul (a mixture of experts' layer): the rows of `x` in consecutive groups, the cumulative counts
    `offs` say where each ends, group g multiplied by weight[g]; rows past the last group give zeros. Each group's
    product is taken over every row with the rows of other groups zeroed (masks fused into the matmul's loads):
    the arithmetic of as many full matmuls as there are groups, no host read of the counts."""
    if offs is None or x.ndim != 2 or weight.ndim != 3 or bias is not None:
        extra = (" with a bias" if bias is not None else "") + (" without offs" if offs is None else "")
        raise NotImplementedError(f"a grouped matmul of {x.ndim}-d by {weight.ndim}-d operands{extra} is not "
                                  "supported: ember takes 2-d rows in groups by 3-d weights")
    group = _groups(x, offs).reshape(-1, 1)
    out = None
    for g in range(weight.shape[0]):
        part = (x * (group == g).to(x.dtype)) @ weight[g]
        out = part if out is None else out + part
    return out.to(_dtype(out_dtype)) if out_dtype is not None else out


def _grouped_mm_backward(x, weight, offs, grad):
    """The gradients of `_grouped_mm` with respect to its rows and its weights."""
    group = _groups(x, offs).reshape(-1, 1)
    grad_x, grad_w = None, []
    for g in range(weight.shape[0]):
        mask = (group == g).to(x.dtype)
        part = (grad * mask) @ weight[g].t()
        grad_x = part if grad_x is None else grad_x + part
        grad_w.append((x * mask).t() @ grad)
    return grad_x, ember.stack(grad_w, 0)


class _NotComputed:
    """An output torch's operator returns that ember computes nothing for: only its backward operator reads it
    (checked by AtenGraph), which ember derives from the forward instead."""

    def __init__(self, what: str, shape: tuple) -> None:
        self.what, self.shape = what, tuple(shape)


# The core ATen operators (and the others torch's graphs keep) as ember functions: by overload, or by packet for
# every overload of one meaning.
OPS: dict[str, Callable] = {
    # views, copies, shapes
    "aten.view": lambda x, size: x.reshape(tuple(size)), "aten._unsafe_view": lambda x, size: x.reshape(tuple(size)),
    "aten.reshape": lambda x, size: x.reshape(tuple(size)), "aten.permute": lambda x, dims: x.permute(*dims),
    "aten.t": lambda x: x.t(), "aten.transpose": lambda x, a, b: x.transpose(a, b), "aten.expand": _expand,
    "aten.squeeze": _squeeze, "aten.unsqueeze": lambda x, dim: x.unsqueeze(dim),
    "aten.clone": lambda x, memory_format=None: x.clone(), "aten.alias": lambda x: x,
    "aten.detach": lambda x: x.detach(), "aten.lift_fresh_copy": lambda x: x.clone(),
    "aten._to_copy": _to_copy, "aten.copy": lambda x, src, non_blocking=False: src.to(x.dtype).expand(*x.shape),
    "aten.slice.Tensor": _slice, "aten.select.int": _select, "aten.split_with_sizes": _split_with_sizes,
    "aten.split.Tensor": lambda x, size, dim=0: list(x.split(size, dim)),
    "aten.cat": lambda tensors, dim=0: ember.cat([t for t in tensors if t.numel() or t.ndim > 1], dim),
    "aten.stack": lambda tensors, dim=0: ember.stack(list(tensors), dim),
    "aten.flip": lambda x, dims: x.flip(tuple(dims)), "aten.roll": lambda x, shifts, dims=(): ember.roll(
        x, tuple(shifts), tuple(dims) or None),
    "aten.constant_pad_nd": _constant_pad_nd, "aten.repeat": lambda x, repeats: x.repeat(*repeats),
    **_padding("reflect"), **_padding("replicate"),
    "aten.index_select": lambda x, dim, index: x.index_select(dim, index), "aten.index.Tensor": _index,
    "aten.gather": lambda x, dim, index, sparse_grad=False: x.gather(dim, index),
    "aten.scatter_add": lambda x, dim, index, src: ember.scatter_add(x, dim, index, src),
    "aten.histc": _histc, "aten._grouped_mm": _grouped_mm,
    "transformers.grouped_mm_fallback.default": _grouped_mm,  # transformers' mixture-of-experts layers
    "transformers.grouped_mm_fallback_backward.default": _grouped_mm_backward,
    "aten.scatter.value": _scatter, "aten.scatter.src": _scatter, "aten.index_put": _index_put,
    "aten.slice_scatter": _slice_scatter, "aten.select_scatter": _select_scatter,
    "aten.tril": lambda x, diagonal=0: x.tril(diagonal), "aten.triu": lambda x, diagonal=0: x.triu(diagonal),
    # creation
    "aten.full": _full, "aten.full_like": _full_like, "aten.arange": _arange, "aten.scalar_tensor": _scalar_tensor,
    "aten.zeros": lambda size, **kw: _full(size, 0, **kw), "aten.ones": lambda size, **kw: _full(size, 1, **kw),
    "aten.zeros_like": lambda x, **kw: _full_like(x, 0, **kw), "aten.ones_like": lambda x, **kw: _full_like(x, 1, **kw),
    "aten.empty.memory_format": _empty, "aten.empty_like": lambda x, **kw: _full_like(x, 0, **kw),
    "aten.new_zeros": lambda x, size, **kw: _full(size, 0, **{"dtype": x.dtype, "device": str(x.device), **kw}),
    "aten.new_ones": lambda x, size, **kw: _full(size, 1, **{"dtype": x.dtype, "device": str(x.device), **kw}),
    "aten.new_full": lambda x, size, v, **kw: _full(size, v, **{"dtype": x.dtype, "device": str(x.device), **kw}),
    "aten.new_empty": lambda x, size, **kw: _full(size, 0, **{"dtype": x.dtype, "device": str(x.device), **kw}),
    "aten.fill.Scalar": lambda x, value: _full_like(x, value),
    "aten.empty_permuted": lambda size, physical_layout, **kw: _full(size, 0, **kw),
    "aten.bernoulli.p": lambda x, p=0.5, generator=None: (ember.rand(x.shape, device=x.device) < p).to(x.dtype),
    "aten.bernoulli.default": lambda x, generator=None: (ember.rand(x.shape, device=x.device) < x).to(x.dtype),
    "aten.rand": lambda size, **kw: ember.rand(
        tuple(size), dtype=_dtype(kw.get("dtype")), device=_device(kw.get("device"))),
    "aten.randn": lambda size, **kw: ember.randn(tuple(size), dtype=_dtype(kw.get("dtype")),
                                                 device=_device(kw.get("device"))),
    # pointwise
    "aten.add": _add, "aten.sub": _sub, "aten.rsub": lambda x, y, alpha=1: _sub(y, x, alpha) if isinstance(
        y, Tensor) else (y - x * alpha), "aten.mul": operator.mul, "aten.div": _div,
    "aten.neg": operator.neg, "aten.abs": ember.abs, "aten.exp": ember.exp, "aten.exp2": ember.exp2,
    "aten.expm1": ember.expm1, "aten.log": ember.log, "aten.log1p": ember.log1p, "aten.log2": ember.log2,
    "aten.sqrt": ember.sqrt, "aten.rsqrt": ember.rsqrt, "aten.reciprocal": ember.reciprocal,
    "aten.sin": ember.sin, "aten.cos": ember.cos, "aten.tanh": ember.tanh, "aten.sigmoid": ember.sigmoid,
    "aten.erf": ember.erf, "aten.sign": ember.sign, "aten.floor": ember.floor, "aten.ceil": ember.ceil,
    "aten.round": lambda x, decimals=0: ember.round(x * 10**decimals) / 10**decimals if decimals else ember.round(x),
    "aten.trunc": ember.trunc, "aten.pow": _pow, "aten.relu": ember.relu, "aten.gelu": _gelu,
    "aten.silu": F.silu, "aten.hardtanh": lambda x, lo=-1.0, hi=1.0: ember.hardtanh(x, lo, hi),
    "aten.leaky_relu": lambda x, slope=0.01: ember.leaky_relu(x, slope), "aten.elu": _elu,
    "aten.softplus": lambda x, beta=1, threshold=20: F.softplus(x, beta, threshold),
    "aten.clamp": _clamp, "aten.clamp_min": lambda x, v: ember.clamp(x, v, None),
    "aten.clamp_max": lambda x, v: ember.clamp(x, None, v), "aten.where.self": _where,
    "aten.maximum": ember.maximum, "aten.minimum": ember.minimum, "aten.remainder": ember.remainder,
    "aten.fmod": ember.fmod, "aten.eq": ember.eq, "aten.ne": ember.ne, "aten.lt": ember.lt, "aten.le": ember.le,
    "aten.gt": ember.gt, "aten.ge": ember.ge, "aten.logical_and": ember.logical_and,
    "aten.logical_or": ember.logical_or, "aten.logical_not": ember.logical_not,
    "aten.logical_xor": ember.logical_xor, "aten.bitwise_and": ember.bitwise_and,
    "aten.bitwise_or": ember.bitwise_or, "aten.bitwise_xor": ember.bitwise_xor, "aten.bitwise_not": ember.bitwise_not,
    "aten.isnan": ember.isnan, "aten.isinf": ember.isinf, "aten.masked_fill": lambda x, mask, v: x.masked_fill(mask, v),
    # reductions
    "aten.sum.dim_IntList": _sum, "aten.sum.default": lambda x, dtype=None: _sum(x, None, False, dtype),
    "aten.mean.dim": _mean, "aten.mean.default": lambda x, dtype=None: _mean(x, None, False, dtype),
    "aten.amax": _reduce(ember.amax), "aten.amin": _reduce(ember.amin), "aten.any.dim": _reduce(ember.any),
    "aten.any.dims": _reduce(ember.any), "aten.any.default": ember.any, "aten.all.dim": _reduce(ember.all),
    "aten.all.default": ember.all, "aten.max.dim": _max_dim, "aten.min.dim": _min_dim,
    "aten.max.default": lambda x: x.max(), "aten.min.default": lambda x: x.min(),
    "aten.argmax": lambda x, dim=None, keepdim=False: x.argmax(dim, keepdim),
    "aten.argmin": lambda x, dim=None, keepdim=False: x.argmin(dim, keepdim),
    "aten.var.correction": _var, "aten.linalg_vector_norm": _vector_norm,
    "aten.prod.dim_int": lambda x, dim, keepdim=False, dtype=None: x.prod(dim, keepdim),
    "aten.cumsum": lambda x, dim, dtype=None: x.cumsum(dim, _dtype(dtype)),
    "aten.topk": lambda x, k, dim=-1, largest=True, sorted=True: tuple(ember.topk(x, k, dim, largest, sorted)),
    "aten.sort.default": lambda x, dim=-1, descending=False: tuple(ember.sort(x, dim, descending)),
    "aten.sort.stable": lambda x, *, stable=None, dim=-1, descending=False: tuple(
        ember.sort(x, dim, descending, stable=bool(stable))),
    "aten.logsumexp": lambda x, dims, keepdim=False: x.logsumexp(tuple(dims), keepdim),
    # contractions
    "aten.mm": ember.mm, "aten.bmm": ember.bmm, "aten.matmul": ember.matmul,
    "aten.addmm": lambda bias, a, b, beta=1, alpha=1: bias * beta + (a @ b) * alpha if (beta, alpha) != (1, 1)
        else bias + a @ b,
    "aten.convolution": _convolution, "aten.convolution_backward": _convolution_backward,
    # neural-network operators
    "aten._softmax": _softmax, "aten._log_softmax": _log_softmax,
    "aten._softmax_backward_data": _softmax_backward, "aten._log_softmax_backward_data": _log_softmax_backward,
    "aten.native_layer_norm": _native_layer_norm,
    "aten._native_batch_norm_legit_functional": _batch_norm_functional,
    "aten._native_batch_norm_legit.no_stats": _batch_norm_no_stats,
    "aten._native_batch_norm_legit_no_training": _batch_norm_no_training,
    "aten.native_group_norm": _native_group_norm, "aten.embedding": _embedding,
    "aten.embedding_dense_backward": _embedding_dense_backward, "aten.native_dropout": _native_dropout,
    "aten.native_dropout_backward": lambda grad, mask, scale: grad * mask.to(grad.dtype) * scale,
    "aten.max_pool2d_with_indices": _max_pool_with_indices, "aten.max_pool3d_with_indices": _max_pool_with_indices,
    "aten.max_pool2d_with_indices_backward": _max_pool_with_indices_backward,
    "aten.max_pool3d_with_indices_backward": _max_pool_with_indices_backward,
    "aten.avg_pool2d": _avg_pool, "aten.avg_pool2d_backward": _avg_pool_backward,
    "aten.avg_pool3d": _avg_pool, "aten.avg_pool3d_backward": _avg_pool_backward,
    "aten._adaptive_avg_pool2d": _adaptive_avg_pool, "aten._adaptive_avg_pool3d": _adaptive_avg_pool,
    "aten._adaptive_avg_pool2d_backward": _adaptive_avg_pool_backward(2),
    "aten._adaptive_avg_pool3d_backward": _adaptive_avg_pool_backward(3),
    "aten.upsample_nearest2d": _upsample("nearest"), "aten.upsample_bilinear2d": _upsample("bilinear"),
    "aten.upsample_bicubic2d": _upsample("bicubic"), "aten.upsample_nearest3d": _upsample("nearest"),
    "aten.upsample_trilinear3d": _upsample("trilinear"), "aten.upsample_nearest1d": _upsample("nearest"),
    "aten.upsample_linear1d": _upsample("linear"),
    "aten.lerp": lambda x, end, weight: x + (end - x) * weight,
    "aten.addcmul": lambda x, a, b, value=1: x + a * b * value,
    "aten.addcdiv": lambda x, a, b, value=1: x + a / b * value,
    "aten.sqrt_": ember.sqrt, "aten.copy_": lambda x, src, non_blocking=False: src.to(x.dtype).expand(*x.shape),
    # prims torch's decompositions produce
    "prims.fma": lambda a, b, c: a * b + c, "prims.convert_element_type": lambda x, dtype: x.to(_dtype(dtype)),
    "prims.broadcast_in_dim": lambda x, shape, dims: _broadcast_in_dim(x, shape, dims),
    "prims.div": _div, "prims.sqrt": ember.sqrt, "prims.mul": operator.mul, "prims.add": operator.add,
    "prims.sub": operator.sub, "prims.neg": operator.neg, "prims.exp": ember.exp, "prims.log": ember.log,
    "prims.where": _where, "prims.squeeze": _squeeze, "prims.view_of": lambda x: x,
    # Python's operators on sizes (symbolic shapes)
    "_operator.getitem": operator.getitem, "_operator.mul": operator.mul, "_operator.add": operator.add,
    "_operator.sub": operator.sub, "_operator.floordiv": operator.floordiv, "_operator.truediv": operator.truediv,
    "aten.sym_size.int": lambda x, dim: x.shape[dim], "aten.sym_numel": lambda x: x.numel(),
    "aten._assert_scalar": lambda *args: None, "aten._assert_tensor_metadata": lambda *args, **kw: None,
}

def _broadcast_in_dim(x, shape, dims):
    """prims.broadcast_in_dim: x's dimension i becomes dimension dims[i] of `shape`, the others broadcast."""
    kept = [1] * len(shape)
    for i, d in enumerate(dims):
        kept[d] = x.shape[i]
    return x.reshape(tuple(kept)).expand(*shape)
