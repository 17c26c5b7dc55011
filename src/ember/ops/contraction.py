"""Matmul and convolution: the contractions, with PyTorch's shape rules; at the end, the MATMUL and
CONV2D primitives' rules."""

from __future__ import annotations

import numpy as np

from ember import amp, dtypes
from ember.device import channels_last, check_memory_format
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import check_shape, define
from ember.ops import attention
from ember.ops.movement import expand, pad, reshape, squeeze, unsqueeze
from ember.ops.pointwise import _check_devices, broadcast_shapes
from ember.tensor import Tensor, apply, composite, expect_tensors


def _check_operands(op: str, a: Tensor, b: Tensor) -> None:
    _check_devices(op, [a, b])
    if a.dtype is not b.dtype:
        raise DTypeError(f"{op}: operands must have the same dtype, got {operands(a, b)}; "
                         f"cast one with .to({a.dtype.name}) or .to({b.dtype.name})")
    if a.dtype is dtypes.bool_:
        raise DTypeError(f"{op}: bool operands are not supported ({operands(a, b)})")


@amp.autocast_op("matmul")
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul: 1-d operands are promoted and squeezed, batch dims broadcast."""
    expect_tensors("matmul", input=a, other=b)
    _check_operands("matmul", a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: both operands need at least 1 dim, got {operands(a, b)}")
    x = unsqueeze(a, 0) if a.ndim == 1 else a
    y = unsqueeze(b, -1) if b.ndim == 1 else b
    if x.shape[-1] != y.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} cannot be multiplied "
                         f"({x.shape[-1]} != {y.shape[-2]}); the last dim of the first operand must equal "
                         f"the {'only' if b.ndim == 1 else 'second-to-last'} dim of the second")
    if a.ndim > 1 and b.ndim > 1:  # a softmax of scores q @ kᵀ, times values: attention, one kernel
        fused = attention.recognised(a, b)
        if fused is not None:
            return fused
    try:
        batch = broadcast_shapes(x.shape[:-2], y.shape[:-2], op="matmul")
    except ShapeError:
        raise ShapeError(f"matmul: the batch dims {x.shape[:-2]} and {y.shape[:-2]} of shapes {a.shape} and "
                         f"{b.shape} cannot be broadcast together; make them equal or 1") from None
    if y.ndim == 2 and x.ndim > 2:  # one matrix for the whole batch: a single GEMM over the batch's rows
        rows = reshape(x, (-1, x.shape[-1]))
        out = reshape(apply(Op.MATMUL, rows, y), batch + (x.shape[-2], y.shape[-1]))
    else:
        x = expand(x, batch + x.shape[-2:])
        y = expand(y, batch + y.shape[-2:])
        out = apply(Op.MATMUL, x, y)
    if a.ndim == 1:
        out = squeeze(out, -2)
    if b.ndim == 1:
        out = squeeze(out, -1)
    return out


@amp.autocast_op("mm")
def mm(a: Tensor, b: Tensor) -> Tensor:
    expect_tensors("mm", input=a, mat2=b)
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"mm: expects 2-d operands, got {operands(a, b)}")
    return matmul(a, b)


@amp.autocast_op("bmm")
def bmm(a: Tensor, b: Tensor) -> Tensor:
    expect_tensors("bmm", input=a, mat2=b)
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
        raise ShapeError(f"bmm: expects 3-d operands with equal batch, got {operands(a, b)}")
    return matmul(a, b)


def dot(a: Tensor, b: Tensor) -> Tensor:
    expect_tensors("dot", input=a, tensor=b)
    if a.ndim != 1 or b.ndim != 1:
        raise ShapeError(f"dot: expects 1-d operands, got {operands(a, b)}")
    return matmul(a, b)


def outer(a: Tensor, b: Tensor) -> Tensor:
    expect_tensors("outer", input=a, vec2=b)
    return reshape(a, (-1, 1)) * reshape(b, (1, -1))


@amp.autocast_op("linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, as torch.nn.functional.linear."""
    expect_tensors("linear", input=x, weight=weight)
    if bias is not None:
        expect_tensors("linear", bias=bias)
    if weight.ndim not in (1, 2):
        raise ShapeError(f"linear: weight must be 1-d or 2-d, got shape {weight.shape}")
    if x.ndim == 0 or x.shape[-1] != weight.shape[-1]:
        raise ShapeError(f"linear: input of shape {x.shape} does not fit weight of shape {weight.shape} "
                         f"(in_features {weight.shape[-1]})")
    if (weight.ndim == 2 and x.dtype is weight.dtype and x.dtype.is_floating_point
            and (bias is None or bias.dtype is x.dtype and bias.shape == weight.shape[:1])):
        return apply(Op.LINEAR, x, weight, *(() if bias is None else (bias,)))  # one node until it is compiled
    return _linear(x, weight, bias)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear in primitives (without autocast's casts: its operands have been cast)."""
    out = matmul.__wrapped__(x, weight.mT if weight.ndim == 2 else weight)
    return out + bias if bias is not None else out


def _linear_rule(inputs, attrs):
    x, weight = inputs[:2]
    check_shape(x.dtype is weight.dtype and x.shape[-1] == weight.shape[1], Op.LINEAR,
                f"input {x.shape} {x.dtype.name} does not fit weight {weight.shape} {weight.dtype.name}")
    return x.shape[:-1] + weight.shape[:1], x.dtype


def _pair(op: str, name: str, v) -> tuple[int, int]:
    pair = (v, v) if isinstance(v, int) else tuple(v)
    if len(pair) != 2 or not all(isinstance(p, int) for p in pair):
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    return pair


def _batched(op: str, x: Tensor, weight: Tensor, weight_layout: str) -> tuple[Tensor, bool]:
    """A convolution's checked operands: x with a batch axis (added if x is unbatched), and whether it was."""
    expect_tensors(op, input=x, weight=weight)
    _check_operands(op, x, weight)
    unbatched = x.ndim == 3
    if unbatched:
        x = unsqueeze(x, 0)
    if x.ndim != 4 or weight.ndim != 4:
        raise ShapeError(f"{op}: expects input (N, C, H, W) or (C, H, W) and weight {weight_layout}, "
                         f"got {operands(x, weight)}")
    return x, unbatched


@amp.autocast_op("conv2d")
def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1, *, memory_format=None) -> Tensor:
    """2-d cross-correlation over NCHW input (or CHW, unbatched), as torch.nn.functional.conv2d.

    `memory_format` (ember's): ember.channels_last asks cuda to run this convolution, and its gradients,
    on (N, H, W, C) memory (float16 and bfloat16), as `ember.set_conv_memory_format` does for all of
    them; None or ember.contiguous_format follows that setting. Values are the same either way."""
    x, unbatched = _batched("conv2d", x, weight, "(O, C/groups, kH, kW)")
    stride, dilation = _pair("conv2d", "stride", stride), _pair("conv2d", "dilation", dilation)
    kh, kw = weight.shape[2:]
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise ValueError("conv2d: padding='same' is not supported for strided convolutions")
            total = (dilation[0] * (kh - 1), dilation[1] * (kw - 1))
            if total[0] % 2 or total[1] % 2:
                x = pad(x, (total[1] // 2, total[1] - total[1] // 2, total[0] // 2, total[0] - total[0] // 2))
                padding = (0, 0)
            else:
                padding = (total[0] // 2, total[1] // 2)
        else:
            raise ValueError(f"conv2d: padding must be an int, a pair, 'valid' or 'same', not {padding!r}")
    padding = _pair("conv2d", "padding", padding)
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or groups < 1:
        raise ValueError(f"conv2d: invalid stride {stride}, padding {padding}, dilation {dilation} "
                         f"or groups {groups}")
    n, c, h, w = x.shape
    o, cg = weight.shape[:2]
    if c != cg * groups or o % groups:
        raise ShapeError(f"conv2d: input of shape {x.shape} ({c} channels) does not fit weight of shape "
                         f"{weight.shape} with "
                         f"groups={groups} (expected {cg * groups} input channels and out channels "
                         f"divisible by {groups})")
    ho = conv_out_size(h, kh, stride[0], padding[0], dilation[0])
    wo = conv_out_size(w, kw, stride[1], padding[1], dilation[1])
    if ho <= 0 or wo <= 0:
        raise ShapeError(f"conv2d: input of shape {x.shape} (spatial size {(h, w)}, padded by {padding}) is "
                         f"smaller than the dilated kernel {(dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1)} "
                         f"of weight {weight.shape}")
    out = apply(Op.CONV2D, x, weight, stride=stride, padding=padding, dilation=dilation, groups=groups,
                **_layout_request("conv2d", memory_format))
    if bias is not None:
        expect_tensors("conv2d", bias=bias)
        if bias.shape != (o,):
            raise ShapeError(f"conv2d: bias must have shape ({o},), got {bias.shape}")
        out = out + reshape(bias, (1, o, 1, 1))
    return squeeze(out, 0) if unbatched else out


@amp.autocast_op("conv_transpose2d")
def conv_transpose2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1, *, memory_format=None) -> Tensor:
    """2-d transposed convolution over NCHW input (or CHW), as torch.nn.functional.conv_transpose2d: the
    gradient of a conv2d with respect to its input, so it is that primitive (cuDNN's backward-data on a GPU).
    The weight is (in_channels, out_channels / groups, kH, kW); `memory_format` as conv2d's."""
    x, unbatched = _batched("conv_transpose2d", x, weight, "(C, O/groups, kH, kW)")
    stride, dilation = _pair("conv_transpose2d", "stride", stride), _pair("conv_transpose2d", "dilation", dilation)
    padding = _pair("conv_transpose2d", "padding", padding)
    output_padding = _pair("conv_transpose2d", "output_padding", output_padding)
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0 or groups < 1:
        raise ValueError(f"conv_transpose2d: invalid stride {stride}, padding {padding}, output_padding "
                         f"{output_padding}, dilation {dilation} or groups {groups}")
    if any(op >= s for op, s in zip(output_padding, stride)):
        raise ValueError(f"conv_transpose2d: output_padding {output_padding} must be smaller than the stride "
                         f"{stride} (ember does not take the larger output_padding torch allows below the dilation)")
    n, c, h, w = x.shape
    cin, og, kh, kw = weight.shape
    if c != cin or cin % groups:
        raise ShapeError(f"conv_transpose2d: input of shape {x.shape} ({c} channels) does not fit weight of shape "
                         f"{weight.shape} with groups={groups} (expected {cin} input channels, divisible by "
                         f"{groups})")
    size = tuple((i - 1) * s - 2 * p + d * (k - 1) + op + 1
                 for i, s, p, d, k, op in zip((h, w), stride, padding, dilation, (kh, kw), output_padding))
    if min(size) <= 0:
        raise ShapeError(f"conv_transpose2d: input of shape {x.shape} with padding {padding} gives an output of "
                         f"size {size}")
    out = apply(Op.CONV2D_INPUT_GRAD, x, weight, input_size=size, stride=stride, padding=padding,
                dilation=dilation, groups=groups, **_layout_request("conv_transpose2d", memory_format))
    if bias is not None:
        expect_tensors("conv_transpose2d", bias=bias)
        if bias.shape != (og * groups,):
            raise ShapeError(f"conv_transpose2d: bias must have shape ({og * groups},), got {bias.shape}")
        out = out + reshape(bias, (1, og * groups, 1, 1))
    return squeeze(out, 0) if unbatched else out


# -- the contraction primitives -----------------------------------------------------------------------
# Each primitive's rules side by side: shape (the dtype is the operands'), VJP, and reference
# implementation (NumPy, half types computed in float32, the attributes as keywords).

def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _matmul_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    x, y = inputs
    a, b = x.shape, y.shape
    check_shape(len(a) == len(b) >= 2 and a[:-2] == b[:-2] and a[-1] == b[-2], Op.MATMUL,
                f"cannot multiply {a} by {b}")
    return a[:-1] + b[-1:], x.dtype


def _conv_output(op: Op, x: tuple[int, ...], w: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    """The output shape of input shape x convolved with weight shape w."""
    n, c, h, wd = x
    o, cg, kh, kw = w
    (sh, sw), (ph, pw), (dh, dw), g = attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]
    check_shape(c == cg * g and o % g == 0, op, f"input {x} and weight {w} do not fit groups={g}")
    return (n, o, conv_out_size(h, kh, sh, ph, dh), conv_out_size(wd, kw, sw, pw, dw))


# The compiler may hold a convolution's activations channels-last: with the attribute channels_last=True,
# its input, output gradient and output are (N, H, W, C) (the weight stays (O, C/groups, kh, kw)).
def _nchw(shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    """An activation's shape in (N, C, H, W) order."""
    return (shape[0], shape[3], shape[1], shape[2]) if attrs.get("channels_last") else shape


def _in_layout(shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    """An (N, C, H, W) shape in the convolution's layout."""
    return (shape[0], shape[2], shape[3], shape[1]) if attrs.get("channels_last") else shape


def _conv2d_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    out = _conv_output(Op.CONV2D, _nchw(inputs[0].shape, attrs), inputs[1].shape, attrs)
    return _in_layout(out, attrs), inputs[0].dtype


def _matmul_vjp(g, xs, out, a):
    x, y = xs
    return apply(Op.MATMUL, g, y.mT), apply(Op.MATMUL, x.mT, g)


def _layout_request(op: str, memory_format) -> dict:
    """The attribute by which a convolution asks for channels-last activations (none: the global setting)."""
    if memory_format is None or check_memory_format(op, memory_format) != channels_last:
        return {}
    return {"memory_format": channels_last}


def _conv_attrs(a: dict) -> dict:
    keys = ("stride", "padding", "dilation", "groups", "channels_last", "memory_format")
    return {key: a[key] for key in keys if key in a}


def _conv2d_vjp(g, xs, out, a):
    """A convolution's gradients are primitives of their own, so each runs as the vendor's backward kernels
    (cuDNN's backward-data and backward-filter) instead of as forward convolutions of reshaped operands."""
    x, w = xs
    gx = apply(Op.CONV2D_INPUT_GRAD, g, w, input_size=_nchw(x.shape, a)[2:], **_conv_attrs(a))
    gw = apply(Op.CONV2D_WEIGHT_GRAD, x, g, kernel_size=w.shape[2:], **_conv_attrs(a))
    return gx, gw


def _conv2d_input_grad_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    g, w = _nchw(inputs[0].shape, attrs), inputs[1].shape
    x = (g[0], w[1] * attrs["groups"], *attrs["input_size"])
    check_shape(_conv_output(Op.CONV2D_INPUT_GRAD, x, w, attrs) == g, Op.CONV2D_INPUT_GRAD,
                f"gradient {g} is not the output of an input {x} convolved with weight {w}")
    return _in_layout(x, attrs), inputs[0].dtype


def _conv2d_weight_grad_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    x, g = _nchw(inputs[0].shape, attrs), _nchw(inputs[1].shape, attrs)
    w = (g[1], x[1] // attrs["groups"], *attrs["kernel_size"])
    check_shape(_conv_output(Op.CONV2D_WEIGHT_GRAD, x, w, attrs) == g, Op.CONV2D_WEIGHT_GRAD,
                f"gradient {g} is not the output of input {x} convolved with a weight {w}")
    return w, inputs[0].dtype


def _conv2d_input_grad_vjp(h, xs, out, a):
    """x's gradient is linear in the output gradient g and in the weight w: <h, dx(g, w)> = <conv2d(h, w), g>."""
    g, w = xs
    attrs = _conv_attrs(a)
    return (apply(Op.CONV2D, h, w, **attrs),
            apply(Op.CONV2D_WEIGHT_GRAD, h, g, kernel_size=w.shape[2:], **attrs))


def _conv2d_weight_grad_vjp(h, xs, out, a):
    """w's gradient is linear in the input x and in g: <h, dw(x, g)> = <conv2d(x, h), g>."""
    x, g = xs
    attrs = _conv_attrs(a)
    return (apply(Op.CONV2D_INPUT_GRAD, g, h, input_size=_nchw(x.shape, a)[2:], **attrs),
            apply(Op.CONV2D, x, h, **attrs))


def _windows(x: np.ndarray, kernel: tuple[int, int], stride, padding, dilation) -> np.ndarray:
    """windows[n, c, i, j, p, q] = x_padded[n, c, i*sh + p*dh, j*sw + q*dw], a view (im2col without a copy)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    ho = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    s = x.strides
    return np.lib.stride_tricks.as_strided(
        x, (x.shape[0], x.shape[1], max(ho, 0), max(wo, 0), kh, kw),
        (s[0], s[1], s[2] * sh, s[3] * sw, s[2] * dh, s[3] * dw), writeable=False)


def _np_conv2d(x: np.ndarray, w: np.ndarray, stride, padding, dilation, groups: int) -> np.ndarray:
    """Direct 2-D convolution (cross-correlation, as in PyTorch) through the input's windows."""
    n = x.shape[0]
    o, cg, kh, kw = w.shape
    windows = _windows(x, (kh, kw), stride, padding, dilation)
    ho, wo = windows.shape[2:4]
    windows = windows.reshape(n, groups, cg, ho, wo, kh, kw)
    out = np.einsum("ngchwpq,gocpq->ngohw", windows, w.reshape(groups, o // groups, cg, kh, kw), optimize=True)
    return out.reshape(n, o, ho, wo)


def _np_conv2d_input_grad(g: np.ndarray, w: np.ndarray, input_size, stride, padding, dilation,
                          groups: int) -> np.ndarray:
    """Each output gradient spread back over the input positions its window read, weighted by w."""
    n, o, ho, wo = g.shape
    _, cg, kh, kw = w.shape
    (h, wd), (sh, sw), (ph, pw), (dh, dw) = input_size, stride, padding, dilation
    parts = np.einsum("ngohw,gocpq->ngchwpq", g.reshape(n, groups, o // groups, ho, wo),
                      w.reshape(groups, o // groups, cg, kh, kw), optimize=True).reshape(n, groups * cg, ho, wo, kh, kw)
    padded = np.zeros((n, groups * cg, h + 2 * ph, wd + 2 * pw), dtype=parts.dtype)
    for p in range(kh):
        for q in range(kw):
            padded[:, :, p * dh:p * dh + sh * (ho - 1) + 1:sh, q * dw:q * dw + sw * (wo - 1) + 1:sw] += parts[..., p, q]
    return padded[:, :, ph:ph + h, pw:pw + wd]


def _np_conv2d_weight_grad(x: np.ndarray, g: np.ndarray, kernel_size, stride, padding, dilation,
                           groups: int) -> np.ndarray:
    """Each weight's gradient: the output gradients times the inputs its windows read, summed."""
    n, o, ho, wo = g.shape
    cg = x.shape[1] // groups
    kh, kw = kernel_size
    windows = _windows(x, (kh, kw), stride, padding, dilation).reshape(n, groups, cg, ho, wo, kh, kw)
    out = np.einsum("ngchwpq,ngohw->gocpq", windows, g.reshape(n, groups, o // groups, ho, wo), optimize=True)
    return out.reshape(o, cg, kh, kw)


def _laid_out(fn, activations: tuple[bool, bool], activation_out: bool):
    """A reference that also takes channels-last operands: `activations` says which inputs are activations
    (transposed to (N, C, H, W) for `fn`), `activation_out` whether the result is one (transposed back)."""
    def reference(a, b, *, channels_last: bool = False, memory_format=None, **attrs):
        if not channels_last:
            return fn(a, b, **attrs)
        a, b = (x.transpose(0, 3, 1, 2) if is_activation else x for x, is_activation in zip((a, b), activations))
        out = fn(a, b, **attrs)
        return np.ascontiguousarray(out.transpose(0, 2, 3, 1)) if activation_out else out
    return reference


define(Op.MATMUL, shape=_matmul_rule, vjp=_matmul_vjp, reference=np.matmul)
composite(Op.LINEAR, _linear_rule, _linear)
define(Op.CONV2D, shape=_conv2d_rule, vjp=_conv2d_vjp, reference=_laid_out(_np_conv2d, (True, False), True))
define(Op.CONV2D_INPUT_GRAD, shape=_conv2d_input_grad_rule, vjp=_conv2d_input_grad_vjp,
       reference=_laid_out(_np_conv2d_input_grad, (True, False), True))
define(Op.CONV2D_WEIGHT_GRAD, shape=_conv2d_weight_grad_rule, vjp=_conv2d_weight_grad_vjp,
       reference=_laid_out(_np_conv2d_weight_grad, (True, True), False))
