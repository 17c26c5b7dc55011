"""Vendor calls among a plan's steps: matrix products (cuBLAS), convolutions and their gradients (cuDNN) and sorts,
through torch, on a plan's buffers (viewed through the movement ops the planner left unstored), writing each result
into its node's buffer.
"""

from __future__ import annotations

import torch

from ember.compiler import Signature
from ember.compiler.layout import forward_padding
from ember.errors import CompileError
from ember.ir import Node, Op
from ember.ir.ops import STRIDED_VIEWS


def matmul(node: Node, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
    a, b = (_on_vendor_device(view(x, buffers)) for x in node.inputs)
    out = buffers[id(node)]
    if a.device == out.device:
        torch.matmul(a, b, out=out)
    else:
        out.copy_(torch.matmul(a, b))


def conv2d(node: Node, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
    """A convolution or one of its gradients, as the vendor computes them (cuDNN's forward, backward-data and
    backward-filter kernels through torch). A convolution's bias (one the compiler folded into it) is added as
    the result is copied into its buffer: cuDNN's convolution has no bias of its own (torch adds it in a pass
    after it), so that copy is the one pass over the result either way."""
    first, second, *bias = (_on_vendor_device(view(i, buffers)) for i in node.inputs)
    if first.numel() == 0 or second.numel() == 0:  # torch gets shapes wrong without channels; a sum of nothing
        if bias:
            buffers[id(node)].copy_(bias[0].view(-1, 1, 1) if not node.attrs.get("channels_last") else bias[0])
        else:
            buffers[id(node)].zero_()
        return
    a = node.attrs
    conv = (a["stride"], a["padding"], a["dilation"], a["groups"])
    out_buffer = buffers[id(node)]
    if a.get("channels_last"):  # (N, H, W, C) activations and (O, kH, kW, I) weights seen as (N, C, H, W) and
        # (O, I, kH, kW): torch's channels_last tensors, which cuDNN reads and writes with no transposition
        first, second, out_buffer = (t.permute(0, 3, 1, 2) for t in (first, second, out_buffer))
    if node.op is Op.CONV2D:
        if not bias and _into_buffer(first, second, conv, out_buffer):
            return
        out = torch.nn.functional.conv2d(first, second, None, *conv)
    elif node.op is Op.CONV2D_INPUT_GRAD:  # from the output gradient and the weight
        # (on cuda only: elsewhere cuDNN is not there to write into the buffer, and the weight's copy is wasted;
        # a channels-last one was made a forward convolution when it was laid out, compiler/layout.py)
        as_forward = input_grad_as_forward(second, conv) if first.is_cuda and not bias else None
        if as_forward is not None:
            weight, forward = as_forward
            if _into_buffer(first, weight.contiguous(), forward, out_buffer):
                return
        out = _convolution_backward(first, out_buffer, second, conv, 0)
    else:  # from the input and the output gradient
        out = _convolution_backward(second, first, out_buffer, conv, 1)
    if bias:
        torch.add(out, bias[0].view(-1, 1, 1), out=out_buffer)
    else:
        out_buffer.copy_(out)


_CUDNN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_cudnn_refused: set[tuple] = set()  # the convolutions cuDNN refused to write into a given buffer (keyed by shapes)


def _into_buffer(x: torch.Tensor, weight: torch.Tensor, conv: tuple, out: torch.Tensor) -> bool:
    """A convolution computed by cuDNN straight into its buffer (no copy of the result), where cuDNN is what torch
    would run it on (cuda, a float dtype, no groups, 32-bit indices); False where it is not, or cuDNN refuses."""
    stride, padding, dilation, groups = conv
    if (x.device.type != "cuda" or groups != 1 or x.dtype not in _CUDNN_DTYPES or weight.dtype != x.dtype
            or max(x.numel(), out.numel(), weight.numel()) >= 2**31 or not torch.backends.cudnn.enabled):
        return False
    key = (tuple(x.shape), x.stride(), tuple(weight.shape), x.dtype, conv, out.stride())
    if key in _cudnn_refused:
        return False
    cudnn = torch.backends.cudnn
    try:
        torch.ops.aten.cudnn_convolution.out(
            x, weight, list(padding), list(stride), list(dilation), groups, cudnn.benchmark,
            cudnn.deterministic or torch.are_deterministic_algorithms_enabled(), cudnn.allow_tf32, out=out)
    except RuntimeError:  # (on a first run, never in a capture: the cases torch would run elsewhere)
        _cudnn_refused.add(key)
        return False
    return True


def input_grad_as_forward(weight: torch.Tensor, conv: tuple) -> tuple[torch.Tensor, tuple] | None:
    """A stride-1 convolution's input gradient as a forward convolution of the output gradient, which cuDNN writes
    straight into a buffer (its backward-data kernels have no such form through torch, and their result is
    copied): the weight with its input and output channels swapped and its window flipped, and the padding that
    widens the output back to the input's size (d * (k - 1) - p on each axis). None where that is no convolution
    (a stride above 1, groups, a padding wider than the window's reach)."""
    stride, padding, dilation, groups = conv
    widened = forward_padding(weight.shape[2:], stride, padding, dilation, groups)
    if widened is None:
        return None
    swapped = weight.transpose(0, 1)
    flipped = swapped if all(k == 1 for k in weight.shape[2:]) else swapped.flip(2, 3)
    return flipped, ((1, 1), widened, tuple(dilation), 1)


def argsort(node: Node, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
    """The positions that sort a tensor along an axis, stably (NaN largest), by torch's sort."""
    x = view(node.inputs[0], buffers)
    order = torch.sort(x, dim=node.attrs["axis"], descending=node.attrs["descending"], stable=True).indices
    buffers[id(node)].copy_(order)


def _convolution_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, conv: tuple,
                          which: int) -> torch.Tensor:
    """One gradient of a convolution (0: the input's, 1: the weight's) by cuDNN's backward kernels, which run
    on the memory format of the input and weight. The operand the gradient is of lends only its shape and
    strides (the destination stands in for it)."""
    stride, padding, dilation, groups = conv
    mask = (which == 0, which == 1, False)
    return torch.ops.aten.convolution_backward(grad, input, weight, None, stride, padding, dilation, False, (0, 0),
                                               groups, mask)[which]


def view(node: Node, buffers: dict[int, torch.Tensor]) -> torch.Tensor:
    """A strided torch view of a stored node through the movement ops above it."""
    if id(node) in buffers:
        return buffers[id(node)]
    base = view(node.inputs[0], buffers)
    a = node.attrs
    if node.op is Op.RESHAPE:
        return base.reshape(a["shape"])
    if node.op is Op.PERMUTE:
        return base.permute(*a["order"])
    if node.op is Op.EXPAND:
        return base.expand(*a["shape"])
    if node.op is Op.SLICE:
        return base[tuple(slice(start, stop, step) for start, stop, step in a["slices"])]
    raise CompileError(f"{node.op.label} is not one of {[op.label for op in STRIDED_VIEWS]}, which a strided view "
                       "expresses; the planner should have stored its input")


def _on_vendor_device(operand: torch.Tensor) -> torch.Tensor:
    """Where torch can multiply or convolve the operand: cuBLAS and cuDNN take no integers, torch's CPU
    kernels do (integer matmuls and convolutions are rare enough to pay the copies)."""
    return operand.cpu() if operand.is_cuda and not operand.dtype.is_floating_point else operand
