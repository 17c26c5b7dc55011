"""Matmul, einsum and convolution: the contractions, with PyTorch's shape rules; at the end, the MATMUL and
CONV2D primitives' rules."""

from __future__ import annotations

import math
import string

import numpy as np

from ember import amp, dtypes
from ember.device import check_memory_format, get_conv_memory_format, preserve_format
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import check_shape, define
from ember.ops import attention
from ember.ops.movement import expand, pad, permute, reshape, slice_axis, squeeze, unsqueeze
from ember.ops.pointwise import _check_devices, broadcast_shapes, cast
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


# -- einsum ------------------------------------------------------------------------------------------------
# A label is a letter of the equation, or an int for a dimension that an ellipsis covers: -1 for the last, -2
# for the one before..., so that ellipses of different lengths line up from the right as they broadcast.

ELLIPSIS = "..."


def einsum(*args) -> Tensor:
    """torch.einsum: `einsum("ij,jk->ik", a, b)`, the operands as a list (`einsum("ij,jk", [a, b])`), or the
    sublist form (`einsum(a, [0, 1], b, [1, 2], [0, 2])`). Without `->` the output has the ellipsis' dims, then
    the labels used once, in alphabetical order (upper case first). A label repeated in one operand takes its
    diagonal; labels missing from the output are summed. Operands are contracted left to right, two at a time:
    labels shared and needed later are batch dims, those shared and not needed later are summed by a batched
    matmul (GEMM kernels), and a label only one side has and nothing needs later is summed before."""
    equation, tensors = _einsum_arguments(args)
    for i, x in enumerate(tensors):
        expect_tensors("einsum", **{f"operands[{i}]": x})
    _check_devices("einsum", list(tensors))
    if any(x.dtype is not tensors[0].dtype for x in tensors):
        raise DTypeError(f"einsum: operands must have the same dtype, got {operands(*tensors)}; cast them to one")
    if tensors[0].dtype is dtypes.bool_:
        raise DTypeError(f"einsum: bool operands are not supported ({operands(*tensors)})")
    terms, output = _parse_equation(equation, len(tensors))
    labelled = [_labelled(x, term, k) for k, (x, term) in enumerate(zip(tensors, terms))]
    sizes = _label_sizes(labelled)
    if output is None:
        once = [c for c in sorted(sizes, key=str) if isinstance(c, str)
                and sum(term.count(c) for term in terms) == 1]
        output = sorted(label for label in sizes if isinstance(label, int)) + once
    else:
        output = _explicit_output(output, sizes)
    x, labels = labelled[0]
    for k, (y, y_labels) in enumerate(labelled[1:], start=1):
        later = set(output).union(*(ls for _, ls in labelled[k + 1:]))
        x, labels = _contract(x, labels, y, y_labels, later)
    x, labels = _summed(x, labels, set(output))
    return permute(x, [labels.index(label) for label in output]) if labels != output else x


def _einsum_arguments(args) -> tuple[str, tuple]:
    """The equation and the operands of any of einsum's three forms."""
    if not args or isinstance(args[0], str) and len(args) == 1:
        raise ValueError("einsum: must specify the equation string and at least one operand, or at least one "
                         "operand and its subscripts list")
    if isinstance(args[0], str):
        operands = args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        return args[0], tuple(operands)
    pairs = args[:len(args) - len(args) % 2]
    terms = [_sublist(s) for s in pairs[1::2]]
    output = "->" + _sublist(args[-1]) if len(args) % 2 else ""
    return ",".join(terms) + output, tuple(pairs[0::2])


def _sublist(subscripts) -> str:
    """A sublist's subscripts as letters, as torch maps them: 0-25 to A-Z, 26-51 to a-z; Ellipsis to '...'."""
    letters = []
    for s in subscripts:
        if s is Ellipsis:
            letters.append(ELLIPSIS)
        elif isinstance(s, int) and 0 <= s < 52:
            letters.append(string.ascii_uppercase[s] if s < 26 else string.ascii_lowercase[s - 26])
        else:
            raise ValueError(f"einsum: subscript in subscript list is not within the valid range [0, 52), got {s!r}")
    return "".join(letters)


def _parse_equation(equation: str, count: int) -> tuple[list[list[str]], list[str] | None]:
    """Each operand's subscripts (letters and ELLIPSIS), and the output's (None: implicit)."""
    arrow = equation.find("->")
    lhs = equation if arrow < 0 else equation[:arrow]
    terms = _subscripts(lhs, 0, commas=True)
    if len(terms) > count:
        raise ValueError(f"einsum: fewer operands were provided than specified in the equation {equation!r}")
    if len(terms) < count:
        raise ValueError(f"einsum: more operands were provided than specified in the equation {equation!r}")
    return terms, None if arrow < 0 else _subscripts(equation[arrow + 2:], arrow + 2, commas=False)[0]


def _subscripts(text: str, start: int, commas: bool) -> list[list[str]]:
    terms: list[list[str]] = [[]]
    i = 0
    while i < len(text):
        c = text[i]
        if c == "," and commas:
            terms.append([])
        elif c == ".":
            where = f"operand {len(terms) - 1}" if commas else "the output"
            if text[i:i + 3] != ELLIPSIS:
                raise ValueError(f"einsum: found '.' for {where} that is not part of any ellipsis")
            if ELLIPSIS in terms[-1]:
                raise ValueError(f"einsum: found '.' for {where} for which an ellipsis was already found")
            terms[-1].append(ELLIPSIS)
            i += 2
        elif c in string.ascii_letters:
            terms[-1].append(c)
        elif c != " ":
            raise ValueError(f"einsum: invalid subscript given at index {start + i} in the equation string, "
                             "subscripts must be in [a-zA-Z]")
        i += 1
    return terms


def _labelled(x: Tensor, term: list[str], k: int) -> tuple[Tensor, list]:
    """Operand k with one label per dim: the ellipsis' dims labelled from the right, a repeated label's
    dims replaced by their diagonal."""
    letters = [c for c in term if c != ELLIPSIS]
    if ELLIPSIS not in term and len(letters) != x.ndim:
        raise ShapeError(f"einsum: the number of subscripts in the equation ({len(letters)}) does not match the "
                         f"number of dimensions ({x.ndim}) for operand {k} and no ellipsis was given")
    if len(letters) > x.ndim:
        raise ShapeError(f"einsum: the number of subscripts in the equation ({len(letters)}) is more than the "
                         f"number of dimensions ({x.ndim}) for operand {k}")
    labels: list = list(term)
    if ELLIPSIS in term:
        at, covered = term.index(ELLIPSIS), x.ndim - len(letters)
        labels[at:at + 1] = list(range(-covered, 0))
    for label in dict.fromkeys(labels):
        dims = [d for d, other in enumerate(labels) if other == label]
        if len(dims) > 1:
            x, labels = _diagonal(x, labels, dims, k)
    return x, labels


def _diagonal(x: Tensor, labels: list, dims: list[int], k: int) -> tuple[Tensor, list]:
    """The elements of x whose positions along `dims` (one label's) are equal, along one dim last: those dims
    moved last and flattened, every (1 + n + ... + n^(r-1))-th element of the r * n positions is on the diagonal."""
    n = x.shape[dims[0]]
    for d in dims[1:]:
        if x.shape[d] != n:
            raise ShapeError(f"einsum: subscript {labels[d]} is repeated for operand {k} but the sizes don't match, "
                             f"{x.shape[d]} != {n}")
    rest = [d for d in range(x.ndim) if d not in dims]
    flat = reshape(permute(x, rest + dims), tuple(x.shape[d] for d in rest) + (n ** len(dims),))
    step = sum(n ** i for i in range(len(dims)))
    return slice_axis(flat, len(rest), 0, n ** len(dims), step), [labels[d] for d in rest] + [labels[dims[0]]]


def _label_sizes(labelled: list[tuple[Tensor, list]]) -> dict:
    """Each label's size over all operands, where sizes of one label broadcast (equal, or 1)."""
    sizes: dict = {}
    for k, (x, labels) in enumerate(labelled):
        for d, (label, size) in enumerate(zip(labels, x.shape)):
            seen = sizes.setdefault(label, size)
            if size != seen and 1 not in (size, seen):
                if isinstance(label, int):
                    raise ShapeError(f"einsum: dimension {d} covered by ellipsis in operand {k} has size {size} which "
                                     f"does not broadcast with previously seen ellipsis with size {seen} for the "
                                     "respective dimension")
                raise ShapeError(f"einsum: subscript {label} has size {size} for operand {k} which does not "
                                 f"broadcast with previously seen size {seen}")
            if seen == 1:
                sizes[label] = size
    return sizes


def _explicit_output(output: list[str], sizes: dict) -> list:
    labels: list = []
    for c in output:
        if c == ELLIPSIS:
            labels += sorted(label for label in sizes if isinstance(label, int))
        elif c in labels:
            raise ValueError(f"einsum: output subscript {c} appears more than once in the output")
        elif c not in sizes:
            raise ValueError(f"einsum: output subscript {c} does not appear in the equation for any input operand")
        else:
            labels.append(c)
    return labels


def _summed(x: Tensor, labels: list, keep: set) -> tuple[Tensor, list]:
    """x summed over its labels outside `keep`, as torch.sum sums (integers as int64), which is how torch's einsum
    sums what no matmul does."""
    axes = tuple(d for d, label in enumerate(labels) if label not in keep)
    if not axes:
        return x, labels
    if not x.dtype.is_floating_point:
        x = cast(x, dtypes.int64)
    kept = [label for label in labels if label in keep]
    return reshape(apply(Op.SUM, x, axes=axes), tuple(s for d, s in enumerate(x.shape) if d not in axes)), kept


def _dropped(x: Tensor, labels: list, drop: set) -> tuple[Tensor, list]:
    """x without its labels in `drop`: summed over those of size above 1, squeezed where they have size 1."""
    x, labels = _summed(x, labels, {label for d, label in enumerate(labels) if label not in drop or x.shape[d] == 1})
    kept = [d for d, label in enumerate(labels) if label not in drop]
    return reshape(x, tuple(x.shape[d] for d in kept)), [labels[d] for d in kept]


def _contract(x: Tensor, x_labels: list, y: Tensor, y_labels: list, later: set) -> tuple[Tensor, list]:
    """The product of two labelled operands, summed over the labels both have that nothing later needs: a
    batched matmul of (batch, rows, summed) by (batch, summed, columns), or, with nothing to sum, a broadcast
    product. As in torch, a label to sum that one side has with size 1 is summed on the other side alone."""
    x, x_labels = _summed(x, x_labels, later | set(y_labels))
    y, y_labels = _summed(y, y_labels, later | set(x_labels))
    shared = [label for label in x_labels if label in y_labels and label not in later]
    x_ones = {label for label in shared if x.shape[x_labels.index(label)] == 1}
    y_ones = {label for label in shared if y.shape[y_labels.index(label)] == 1}
    x, x_labels = _dropped(x, x_labels, x_ones | y_ones)
    y, y_labels = _dropped(y, y_labels, x_ones | y_ones)
    if x.dtype is not y.dtype:  # one side summed as int64
        x, y = cast(x, dtypes.int64), cast(y, dtypes.int64)
    batch = [label for label in x_labels if label in y_labels and label in later]
    summed = [label for label in x_labels if label in y_labels and label not in later]
    rows = [label for label in x_labels if label not in y_labels]
    cols = [label for label in y_labels if label not in x_labels]
    a = permute(x, [x_labels.index(label) for label in batch + rows + summed])
    b = permute(y, [y_labels.index(label) for label in batch + summed + cols])
    nb, nr, ns = len(batch), len(rows), len(summed)
    if not summed:
        a = reshape(a, a.shape + (1,) * len(cols))
        b = reshape(b, b.shape[:nb] + (1,) * nr + b.shape[nb:])
        return a * b, batch + rows + cols
    rows_shape, k, cols_shape = a.shape[nb:nb + nr], a.shape[nb + nr:], b.shape[nb + ns:]
    a = reshape(a, a.shape[:nb] + (math.prod(rows_shape), math.prod(k)))
    b = reshape(b, b.shape[:nb] + (math.prod(k), math.prod(cols_shape)))
    out = matmul(a, b)
    return reshape(out, out.shape[:nb] + rows_shape + cols_shape), batch + rows + cols


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


def batched(op: str, x: Tensor, weight: Tensor, weight_layout: str, spatial: str = "H, W") -> tuple[Tensor, bool]:
    """A convolution's checked operands: x with a batch axis (added if x is unbatched), and whether it was; the
    input's `spatial` axes are named as the error names them."""
    expect_tensors(op, input=x, weight=weight)
    _check_operands(op, x, weight)
    rank = 3 + spatial.count(",")  # the batched input's
    unbatched = x.ndim == rank - 1
    if unbatched:
        x = unsqueeze(x, 0)
    if x.ndim != rank or weight.ndim != rank:
        raise ShapeError(f"{op}: expects input (N, C, {spatial}) or (C, {spatial}) and weight {weight_layout}, "
                         f"got {operands(x, weight)}")
    return x, unbatched


@amp.autocast_op("conv2d")
def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1, *, memory_format=None) -> Tensor:
    """2-d cross-correlation over NCHW input (or CHW, unbatched), as torch.nn.functional.conv2d.

    `memory_format` (ember's): where cuda runs this convolution and its gradients (float16 and bfloat16):
    ember.channels_last on (N, H, W, C) memory, ember.contiguous_format on (N, C, H, W); None follows
    `ember.set_conv_memory_format` as it is at this call (channels-last by default). Values are the same
    either way."""
    x, unbatched = batched("conv2d", x, weight, "(O, C/groups, kH, kW)")
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
    x, unbatched = batched("conv_transpose2d", x, weight, "(C, O/groups, kH, kW)")
    stride, dilation = _pair("conv_transpose2d", "stride", stride), _pair("conv_transpose2d", "dilation", dilation)
    padding = _pair("conv_transpose2d", "padding", padding)
    output_padding = _pair("conv_transpose2d", "output_padding", output_padding)
    size = transposed_output_size("conv_transpose2d", x, weight, stride, padding, output_padding, dilation, groups)
    og = weight.shape[1]
    out = apply(Op.CONV2D_INPUT_GRAD, x, weight, input_size=size, stride=stride, padding=padding,
                dilation=dilation, groups=groups, **_layout_request("conv_transpose2d", memory_format))
    if bias is not None:
        expect_tensors("conv_transpose2d", bias=bias)
        if bias.shape != (og * groups,):
            raise ShapeError(f"conv_transpose2d: bias must have shape ({og * groups},), got {bias.shape}")
        out = out + reshape(bias, (1, og * groups, 1, 1))
    return squeeze(out, 0) if unbatched else out


def transposed_output_size(op: str, x: Tensor, weight: Tensor, stride: tuple[int, ...], padding: tuple[int, ...],
                           output_padding: tuple[int, ...], dilation: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """The spatial size of a transposed convolution's output, its arguments (one int per spatial axis) checked
    against the batched input x (N, C, *spatial) and the weight (C, O/groups, *kernel)."""
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0 or groups < 1:
        raise ValueError(f"{op}: invalid stride {stride}, padding {padding}, output_padding {output_padding}, "
                         f"dilation {dilation} or groups {groups}")
    if any(extra >= s for extra, s in zip(output_padding, stride)):
        raise ValueError(f"{op}: output_padding {output_padding} must be smaller than the stride {stride} (ember "
                         f"does not take the larger output_padding torch allows below the dilation)")
    c, cin = x.shape[1], weight.shape[0]
    if c != cin or cin % groups:
        raise ShapeError(f"{op}: input of shape {x.shape} ({c} channels) does not fit weight of shape {weight.shape} "
                         f"with groups={groups} (expected {cin} input channels, divisible by {groups})")
    size = tuple((i - 1) * s - 2 * p + d * (k - 1) + extra + 1 for i, s, p, d, k, extra
                 in zip(x.shape[2:], stride, padding, dilation, weight.shape[2:], output_padding))
    if min(size) <= 0:
        raise ShapeError(f"{op}: input of shape {x.shape} with padding {padding} gives an output of size {size}")
    return size


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


# The compiler may run a convolution channels-last: with the attribute channels_last=True, its input, output
# gradient and output are (N, H, W, C) and its weight and weight gradient (O, kh, kw, C/groups).
def _nchw(shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    """An operand's shape in (N, C, H, W) order (a weight's in (O, I, kH, kW) order): a channels-last
    convolution's activations are (N, H, W, C) and its weights (O, kH, kW, I)."""
    return (shape[0], shape[3], shape[1], shape[2]) if attrs.get("channels_last") else shape


def _in_layout(shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    """An (N, C, H, W) shape in the convolution's layout."""
    return (shape[0], shape[2], shape[3], shape[1]) if attrs.get("channels_last") else shape


def _conv2d_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    """A convolution of an input by a weight, and with an optional third input, a bias per output channel
    added before the result is rounded to its dtype: only the compiler makes one (compiler/conv_folding.py
    folds a per-channel affine into the convolution), so the bias may be float32 for a half-precision one."""
    out = _conv_output(Op.CONV2D, _nchw(inputs[0].shape, attrs), _nchw(inputs[1].shape, attrs), attrs)
    if len(inputs) == 3:
        bias, x = inputs[2], inputs[0]
        check_shape(bias.shape == (out[1],), Op.CONV2D, f"bias of shape {bias.shape} for {out[1]} output channels")
        if bias.dtype is not x.dtype and bias.dtype is not dtypes.compute_dtype(x.dtype):
            raise DTypeError(f"conv2d: bias of dtype {bias.dtype.name} does not go with input of dtype "
                             f"{x.dtype.name}")
    return _in_layout(out, attrs), inputs[0].dtype


def _matmul_vjp(g, xs, out, a):
    x, y = xs
    return apply(Op.MATMUL, g, y.mT), apply(Op.MATMUL, x.mT, g)


def _layout_request(op: str, memory_format) -> dict:
    """The layout a convolution asks for, recorded on it: the one given, else ember's setting when it is called
    (ember.set_conv_memory_format, ember.conv_memory_format; ember.preserve_format follows it too). The plan that
    runs the convolution is made later, when a value is read, and keeps what was asked here."""
    chosen = preserve_format if memory_format is None else check_memory_format(op, memory_format)
    return {"memory_format": get_conv_memory_format() if chosen == preserve_format else chosen}


def _conv_attrs(a: dict) -> dict:
    keys = ("stride", "padding", "dilation", "groups", "channels_last", "memory_format")
    return {key: a[key] for key in keys if key in a}


def _conv2d_vjp(g, xs, out, a):
    """A convolution's gradients are primitives of their own, so each runs as the vendor's backward kernels
    (cuDNN's backward-data and backward-filter) instead of as forward convolutions of reshaped operands."""
    x, w = xs[:2]
    gx = apply(Op.CONV2D_INPUT_GRAD, g, w, input_size=_nchw(x.shape, a)[2:], **_conv_attrs(a))
    gw = apply(Op.CONV2D_WEIGHT_GRAD, x, g, kernel_size=_nchw(w.shape, a)[2:], **_conv_attrs(a))
    if len(xs) == 2:
        return gx, gw
    channel = 3 if a.get("channels_last") else 1  # a bias's gradient: the output gradient summed per channel
    summed = apply(Op.SUM, cast(g, xs[2].dtype), axes=tuple(d for d in range(4) if d != channel))
    return gx, gw, reshape(summed, xs[2].shape)


def _conv2d_input_grad_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    g, w = _nchw(inputs[0].shape, attrs), _nchw(inputs[1].shape, attrs)
    x = (g[0], w[1] * attrs["groups"], *attrs["input_size"])
    check_shape(_conv_output(Op.CONV2D_INPUT_GRAD, x, w, attrs) == g, Op.CONV2D_INPUT_GRAD,
                f"gradient {g} is not the output of an input {x} convolved with weight {w}")
    return _in_layout(x, attrs), inputs[0].dtype


def _conv2d_weight_grad_rule(inputs, attrs) -> tuple[tuple[int, ...], dtypes.DType]:
    x, g = _nchw(inputs[0].shape, attrs), _nchw(inputs[1].shape, attrs)
    w = (g[1], x[1] // attrs["groups"], *attrs["kernel_size"])
    check_shape(_conv_output(Op.CONV2D_WEIGHT_GRAD, x, w, attrs) == g, Op.CONV2D_WEIGHT_GRAD,
                f"gradient {g} is not the output of input {x} convolved with a weight {w}")
    return _in_layout(w, attrs), inputs[0].dtype


def _conv2d_input_grad_vjp(h, xs, out, a):
    """x's gradient is linear in the output gradient g and in the weight w: <h, dx(g, w)> = <conv2d(h, w), g>."""
    g, w = xs
    attrs = _conv_attrs(a)
    return (apply(Op.CONV2D, h, w, **attrs),
            apply(Op.CONV2D_WEIGHT_GRAD, h, g, kernel_size=_nchw(w.shape, a)[2:], **attrs))


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


def _np_conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, stride, padding, dilation,
               groups: int) -> np.ndarray:
    """Direct 2-D convolution (cross-correlation, as in PyTorch) through the input's windows, plus the bias
    per output channel, if any."""
    n = x.shape[0]
    o, cg, kh, kw = w.shape
    windows = _windows(x, (kh, kw), stride, padding, dilation)
    ho, wo = windows.shape[2:4]
    windows = windows.reshape(n, groups, cg, ho, wo, kh, kw)
    out = np.einsum("ngchwpq,gocpq->ngohw", windows, w.reshape(groups, o // groups, cg, kh, kw), optimize=True)
    out = out.reshape(n, o, ho, wo)
    return out if bias is None else out + bias.reshape(1, o, 1, 1)


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


def _laid_out(fn):
    """A reference that also takes channels-last operands ((N, H, W, C) activations, (O, kH, kW, I) weights:
    both transposed to (N, C, H, W) order for `fn`, and the result back). A folded convolution's description
    (`folded`, for explain) changes nothing of its value."""
    def reference(a, b, *rest, channels_last: bool = False, memory_format=None, folded=(), **attrs):
        if not channels_last:
            return fn(a, b, *rest, **attrs)
        out = fn(a.transpose(0, 3, 1, 2), b.transpose(0, 3, 1, 2), *rest, **attrs)
        return np.ascontiguousarray(out.transpose(0, 2, 3, 1))
    return reference


define(Op.MATMUL, shape=_matmul_rule, vjp=_matmul_vjp, reference=np.matmul)
composite(Op.LINEAR, _linear_rule, _linear)
define(Op.CONV2D, shape=_conv2d_rule, vjp=_conv2d_vjp, reference=_laid_out(_np_conv2d))
define(Op.CONV2D_INPUT_GRAD, shape=_conv2d_input_grad_rule, vjp=_conv2d_input_grad_vjp,
       reference=_laid_out(_np_conv2d_input_grad))
define(Op.CONV2D_WEIGHT_GRAD, shape=_conv2d_weight_grad_rule, vjp=_conv2d_weight_grad_vjp,
       reference=_laid_out(_np_conv2d_weight_grad))
