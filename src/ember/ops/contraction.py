"""Matmul and convolution: the contractions, with PyTorch's shape rules."""

from __future__ import annotations

from ember import dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import conv_out_size
from ember.ops.movement import expand, reshape, squeeze, unsqueeze
from ember.ops.pointwise import _check_devices, broadcast_shapes
from ember.tensor import Tensor, apply


def _check_operands(op: str, a: Tensor, b: Tensor) -> None:
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError(f"{op}: expected two Tensors, got {operands(a, b)}")
    _check_devices(op, [a, b])
    if a.dtype is not b.dtype:
        raise DTypeError(f"{op}: operands must have the same dtype, got {operands(a, b)}; "
                         f"cast one with .to({a.dtype.name}) or .to({b.dtype.name})")
    if a.dtype is dtypes.bool_:
        raise DTypeError(f"{op}: bool operands are not supported ({operands(a, b)})")


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul: 1-d operands are promoted and squeezed, batch dims broadcast."""
    _check_operands("matmul", a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: both operands need at least 1 dim, got {operands(a, b)}")
    x = unsqueeze(a, 0) if a.ndim == 1 else a
    y = unsqueeze(b, -1) if b.ndim == 1 else b
    if x.shape[-1] != y.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} cannot be multiplied "
                         f"({x.shape[-1]} != {y.shape[-2]}); the last dim of the first operand must equal "
                         f"the {'only' if b.ndim == 1 else 'second-to-last'} dim of the second")
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


def mm(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"mm: expects 2-d operands, got {operands(a, b)}")
    return matmul(a, b)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
        raise ShapeError(f"bmm: expects 3-d operands with equal batch, got {operands(a, b)}")
    return matmul(a, b)


def dot(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 1 or b.ndim != 1:
        raise ShapeError(f"dot: expects 1-d operands, got {operands(a, b)}")
    return matmul(a, b)


def outer(a: Tensor, b: Tensor) -> Tensor:
    return reshape(a, (-1, 1)) * reshape(b, (1, -1))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, as torch.nn.functional.linear."""
    if weight.ndim not in (1, 2):
        raise ShapeError(f"linear: weight must be 1-d or 2-d, got shape {weight.shape}")
    if x.ndim == 0 or x.shape[-1] != weight.shape[-1]:
        raise ShapeError(f"linear: input of shape {x.shape} does not fit weight of shape {weight.shape} "
                         f"(in_features {weight.shape[-1]})")
    out = matmul(x, weight.mT if weight.ndim == 2 else weight)
    return out + bias if bias is not None else out


def _pair(op: str, name: str, v) -> tuple[int, int]:
    pair = (v, v) if isinstance(v, int) else tuple(v)
    if len(pair) != 2 or not all(isinstance(p, int) for p in pair):
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    return pair


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """2-d cross-correlation over NCHW input (or CHW, unbatched), as torch.nn.functional.conv2d."""
    _check_operands("conv2d", x, weight)
    unbatched = x.ndim == 3
    if unbatched:
        x = unsqueeze(x, 0)
    if x.ndim != 4 or weight.ndim != 4:
        raise ShapeError(f"conv2d: expects input (N, C, H, W) or (C, H, W) and weight (O, C/groups, kH, kW), "
                         f"got {operands(x, weight)}")
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
                from ember.ops.movement import pad

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
    out = apply(Op.CONV2D, x, weight, stride=stride, padding=padding, dilation=dilation, groups=groups)
    if bias is not None:
        if bias.shape != (o,):
            raise ShapeError(f"conv2d: bias must have shape ({o},), got {bias.shape}")
        out = out + reshape(bias, (1, o, 1, 1))
    return squeeze(out, 0) if unbatched else out
