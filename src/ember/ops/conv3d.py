"""conv3d and conv_transpose3d, as torch.nn.functional's, built on the CONV2D primitives: no primitive of their own.

A 3-d convolution's depth taps are gathered into channels: for each output depth, the kD input slices its kernel
reads are stacked beside each input channel, so one conv2d over (N * D_out, C * kD, H, W) with the weight
(O, C/groups * kD, kH, kW) — a free reshape of (O, C/groups, kD, kH, kW) — computes it. That is one vendor
convolution per conv3d (cuDNN's on a GPU) and one for each of its gradients; the price is the gathered input,
kD * D_out / D times the input's size. Its gradients are conv2d's and the movement ops' (the taps' gradients add
back into the input by the slices' adjoints).

conv_transpose3d is the mirror image: its depth taps are spread out of channels. One transposed conv2d over the
input's depth slices (N * D, C, H, W) with the weight (C, O/groups * kD, kH, kW) gives, for every input slice, the
kD output slices it feeds; tap t of input slice i lands at output depth i * stride + t * dilation, so each tap's
slices are spread by the stride, shifted by its offset and the taps summed, then the padding cropped. That is one
vendor transposed convolution (cuDNN's backward-data) per conv_transpose3d, and its gradients are that primitive's
and the movement ops'."""

from __future__ import annotations

from ember import amp
from ember.errors import ShapeError
from ember.ops.contraction import batched, conv2d, conv_out_size, conv_transpose2d, transposed_output_size
from ember.ops.movement import dilate_axis, pad, pad_axis, permute, reshape, slice_axis, squeeze, stack
from ember.tensor import Tensor, expect_tensors


def triple(op: str, name: str, v) -> tuple[int, int, int]:
    """An int or three ints, as three ints."""
    three = (v, v, v) if isinstance(v, int) else tuple(v)
    if len(three) != 3 or not all(isinstance(p, int) for p in three):
        raise ValueError(f"{op}: {name} must be an int or a triple of ints, got {v!r}")
    return three


def _same_padding(x: Tensor, kernel: tuple[int, ...], stride, dilation) -> tuple[Tensor, tuple[int, int, int]]:
    """padding='same': x padded so the output keeps its size (the odd extra on the far side, as torch), and the
    symmetric padding left to the convolution."""
    if stride != (1, 1, 1):
        raise ValueError("conv3d: padding='same' is not supported for strided convolutions")
    totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
    if any(t % 2 for t in totals):
        amounts = [a for t in reversed(totals) for a in (t // 2, t - t // 2)]
        return pad(x, amounts), (0, 0, 0)
    return x, tuple(t // 2 for t in totals)


@amp.autocast_op("conv3d")
def conv3d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """3-d cross-correlation over (N, C, D, H, W) input (or (C, D, H, W), unbatched) with a weight
    (O, C/groups, kD, kH, kW); `padding` an int, a triple, 'valid' or 'same' (stride 1)."""
    x, unbatched = batched("conv3d", x, weight, "(O, C/groups, kD, kH, kW)", "D, H, W")
    stride, dilation = triple("conv3d", "stride", stride), triple("conv3d", "dilation", dilation)
    kernel = weight.shape[2:]
    if padding == "valid":
        padding = (0, 0, 0)
    elif padding == "same":
        x, padding = _same_padding(x, kernel, stride, dilation)
    elif isinstance(padding, str):
        raise ValueError(f"conv3d: padding must be an int, a triple, 'valid' or 'same', not {padding!r}")
    padding = triple("conv3d", "padding", padding)
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or groups < 1:
        raise ValueError(f"conv3d: invalid stride {stride}, padding {padding}, dilation {dilation} "
                         f"or groups {groups}")
    n, c = x.shape[:2]
    o, cg = weight.shape[:2]
    if c != cg * groups or o % groups:
        raise ShapeError(f"conv3d: input of shape {x.shape} ({c} channels) does not fit weight of shape "
                         f"{weight.shape} with groups={groups} (expected {cg * groups} input channels and out "
                         f"channels divisible by {groups})")
    out_size = tuple(conv_out_size(*geometry) for geometry in zip(x.shape[2:], kernel, stride, padding, dilation))
    if min(out_size) <= 0:
        raise ShapeError(f"conv3d: input of shape {x.shape} (spatial size {x.shape[2:]}, padded by {padding}) is "
                         f"smaller than the dilated kernel {tuple(d * (k - 1) + 1 for d, k in zip(dilation, kernel))} "
                         f"of weight {weight.shape}")
    (kd, kh, kw), (do, ho, wo) = kernel, out_size
    deep = pad_axis(x, 2, padding[0], padding[0])
    taps = [slice_axis(deep, 2, t * dilation[0], t * dilation[0] + (do - 1) * stride[0] + 1, stride[0])
            for t in range(kd)]  # each (N, C, D_out, H, W)
    gathered = permute(stack(taps, 3), (0, 2, 1, 3, 4, 5))  # (N, D_out, C, kD, H, W)
    planes = reshape(gathered, (n * do, c * kd) + x.shape[3:])
    out = conv2d(planes, reshape(weight, (o, cg * kd, kh, kw)), bias, stride[1:], padding[1:], dilation[1:], groups)
    out = permute(reshape(out, (n, do, o, ho, wo)), (0, 2, 1, 3, 4))
    return squeeze(out, 0) if unbatched else out


@amp.autocast_op("conv_transpose3d")
def conv_transpose3d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, output_padding=0,
                     groups: int = 1, dilation=1) -> Tensor:
    """3-d transposed convolution over (N, C, D, H, W) input (or (C, D, H, W), unbatched), as
    torch.nn.functional.conv_transpose3d: the gradient of a conv3d with respect to its input. The weight is
    (in_channels, out_channels / groups, kD, kH, kW)."""
    op = "conv_transpose3d"
    x, unbatched = batched(op, x, weight, "(C, O/groups, kD, kH, kW)", "D, H, W")
    stride, padding = triple(op, "stride", stride), triple(op, "padding", padding)
    output_padding, dilation = triple(op, "output_padding", output_padding), triple(op, "dilation", dilation)
    size = transposed_output_size(op, x, weight, stride, padding, output_padding, dilation, groups)
    n, c, d, h, w = x.shape
    cin, og, kd, kh, kw = weight.shape
    o = og * groups
    planes = reshape(permute(x, (0, 2, 1, 3, 4)), (n * d, c, h, w))
    spread = conv_transpose2d(planes, reshape(weight, (cin, og * kd, kh, kw)), None, stride[1:], padding[1:],
                              output_padding[1:], groups, dilation[1:])  # (N * D, O * kD, H_out, W_out)
    spread = reshape(spread, (n, d, o, kd) + size[1:])
    placed = (d - 1) * stride[0] + 1  # the depth one tap's slices span, spread by the stride
    full = placed + dilation[0] * (kd - 1)  # the output's depth before the padding is cropped
    taps = [pad_axis(dilate_axis(spread[:, :, :, t], 1, stride[0]), 1, t * dilation[0],
                     full - placed - t * dilation[0]) for t in range(kd)]
    out = pad_axis(sum(taps[1:], taps[0]), 1, -padding[0], output_padding[0] - padding[0])
    out = permute(out, (0, 2, 1, 3, 4))  # (N, O, D_out, H_out, W_out)
    if bias is not None:
        expect_tensors(op, bias=bias)
        if bias.shape != (o,):
            raise ShapeError(f"{op}: bias must have shape ({o},), got {bias.shape}")
        out = out + reshape(bias, (1, o, 1, 1, 1))
    return squeeze(out, 0) if unbatched else out
