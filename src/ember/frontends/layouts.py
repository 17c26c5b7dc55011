"""How torch's tensors cross into and out of the graphs the compile backend runs (frontends.dynamo) by layout.

ember's values have no memory layout: a graph reads and writes contiguous buffers. torch's tensors at a graph's
edges often are not contiguous, and copying each one on the way in or out would cost a pass over its memory per
call. So the graph is rewritten around its edges to read and write torch's memory as it lies:

- a tensor torch lays out densely in another order than its dimensions' (an attention's output kept transposed,
  channels-last activations) is read, or computed, as the contiguous permutation of it that its memory is
  (`in_memory_order`);
- an input that is a strided slice of a wider tensor (the query, key and value a fused projection's output is split
  into, saved for the backward as views of it) is read as the dense box of memory around it, which the graph slices
  (`box_inputs`, `Box`);
- a forward graph's half-precision activations saved for the backward are handed over channels-last where ember
  runs the convolutions so (`save_channels_last`).
"""

from __future__ import annotations

import collections
import math
from typing import NamedTuple

from ember.frontends import strided
from ember.frontends.aten_graph import auxiliary


def in_memory_order(graph, plan) -> dict[int, list[int]]:
    """Rewrites `graph` so that its values torch lays out densely in another order than ember's (an attention's
    output torch keeps transposed, channels-last activations) cross the boundary without a copy: ember computes
    such an output permuted to torch's memory order (its kernels write through the permutation), which torch sees
    back in its own dimensions (`plan.permuted`), and reads such an input as the contiguous permutation of it that
    torch's memory is. Returns the inputs' permutations by position (the inputs the graph writes are left as they
    are). `plan`: frontends.dynamo's `_Outputs` for the graph; the outputs it makes again as views of another
    output return that output instead."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    permute = torch.ops.aten.permute.default
    output = next(n for n in graph.nodes if n.op == "output")
    nodes = list(output.args[0])
    viewed = {i for i, _, _ in plan.views}  # made again from their value's tensor
    own = plan.count + len({base for _, base, _ in plan.views if base >= plan.count})
    with unset_fake_temporarily():
        for p in range(own):
            node = nodes[p]
            order = memory_order(node.meta.get("val")) if hasattr(node, "op") and p not in viewed else None
            if order is None or node.op == "placeholder" or auxiliary(node) and not _pooling_windows(node):
                continue
            with graph.inserting_before(output):
                nodes[p] = graph.call_function(permute, (node, order))
            nodes[p].meta["val"] = node.meta["val"].permute(order)
            plan.permuted[p] = inverse(order)
            plan.layouts.pop(p, None)  # the value comes back in torch's layout
        for i, base, _ in plan.views:  # made again on the value's tensor: ember computes no buffer of their own
            nodes[i] = nodes[base]
        output.args = (type(output.args[0])(nodes),)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        inputs, backs = {}, {}
        # (values such as a ReLU's mask or a max-pooling's window offsets saved for the backward; a permute of
        # torch's tensor reads any memory right, at worst through a copy)
        for p, node in _read_inputs(graph):
            value = node.meta["val"]
            order = memory_order(value)
            if order is None:
                continue
            with graph.inserting_before(first):
                back = graph.call_function(permute, (node, inverse(order)))
            node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
            back.meta["val"] = value
            node.meta["val"] = value.permute(order)
            inputs[p] = order
            backs[back] = node
        # an input the graph returns as it is (saved for the backward) is returned as the memory it was read from,
        # seen back in its own dimensions: not a copy of it in ember's order
        nodes = list(output.args[0])
        for p, node in enumerate(nodes):
            if node in backs:
                nodes[p] = backs[node]
                plan.permuted[p] = list(node.args[1])
                plan.layouts.pop(p, None)
        output.args = (type(output.args[0])(nodes),)
    return inputs


class Box(NamedTuple):
    """How a graph reads an input that is a strided slice of a wider tensor: as the dense box of memory around it,
    `shape` (outermost first) starting `shift` elements before its first element, which the graph slices back to
    the input (`box_inputs`). The box is a view of the input's storage where the input is laid out as it was
    compiled for (`strides`) and the box lies inside the storage (frontends.dynamo runs a graph that reads the
    input as before on calls where it is not)."""

    shape: tuple[int, ...]
    shift: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def fits(self, t) -> bool:
        """Whether torch tensor `t` is laid out as the box was made for (a dimension of size 1 with any stride),
        with the box inside its storage."""
        start = t.storage_offset() - self.shift
        return (tuple(t.shape) == self.sizes and start >= 0
                and all(n == 1 or a == b for n, a, b in zip(self.sizes, t.stride(), self.strides))
                and (start + math.prod(self.shape)) * t.element_size() <= t.untyped_storage().nbytes())

    def of(self, t):
        """Torch tensor `t`, which `fits`, as the box the graph reads: a view of its storage."""
        return t.as_strided(self.shape, _contiguous(self.shape), t.storage_offset() - self.shift)

    def within(self, box):
        """The input, as the slice of its box."""
        return box.as_strided(self.sizes, self.strides, box.storage_offset() + self.shift)


def box_inputs(graph, found: dict[int, tuple], plan) -> dict[int, Box]:
    """Rewrites `graph` so that each input that is a strided slice of a wider tensor (not dense: the query, key and
    value of a fused projection, split and transposed into heads, as the forward saves them for the backward) is
    read as the dense box of its storage around it (`Box`) and sliced in the graph, where ember's kernels read it
    through the slice, instead of being copied to contiguous memory at each call. An input the graph returns as it
    is (saved for the backward) is returned as its box, which `plan.sliced` (frontends.dynamo's `_Outputs`) slices
    back: torch's own tensor. `found`: `boxable`'s answer for `graph`. Returns the boxes by input position."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    output = next(n for n in graph.nodes if n.op == "output")
    returned = collections.defaultdict(list)
    for q, node in enumerate(output.args[0]):
        returned[node].append(q)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    boxes: dict[int, Box] = {}
    with unset_fake_temporarily():
        for p, (node, box, steps) in found.items():
            node.meta["val"] = view = node.meta["val"].new_empty(box.shape)
            made = []
            with graph.inserting_before(first):
                for op, args in steps:
                    made.append(graph.call_function(op, (made[-1] if made else node, *args)))
                    made[-1].meta["val"] = view = op(view, *args)
            node.replace_all_uses_with(made[-1], delete_user_cb=lambda user, start=made[0]: user not in (start, output))
            boxes[p] = box
            plan.sliced.update((q, box) for q in returned.get(node, ()))
    return boxes


def boxable(graph, example_inputs, skip) -> dict[int, tuple]:
    """The inputs `box_inputs` reads as boxes, by position: (the placeholder, its `Box`, the ATen operators slicing
    the box back to it). Left as they are: the inputs at positions in `skip`, those the graph writes, those whose
    layout is not known in numbers, overlaps itself or broadcasts, and every input of a graph with an `as_strided`
    (whose offsets address an input's storage as torch lays it out, and may reach past the input into memory a box
    would not be)."""
    import torch

    if any(str(n.target).rsplit(".", 1)[0] in strided.OPERATORS for n in graph.nodes if n.op == "call_function"):
        return {}
    found = {}
    for p, node in _read_inputs(graph):
        given = example_inputs[p]
        if p not in skip and isinstance(given, torch.Tensor) and (box := _box(given)) is not None:
            found[p] = (node, *box)
    return found


def _read_inputs(graph) -> list[tuple[int, object]]:
    """The inputs (position, placeholder) `graph` reads and does not write, that are tensors."""
    import torch

    written = {n.args[0] for n in graph.nodes if n.target is torch.ops.aten.copy_.default}
    return [(p, node) for p, node in enumerate(n for n in graph.nodes if n.op == "placeholder")
            if node.users and node not in written and isinstance(node.meta.get("val"), torch.Tensor)]


def _box(given) -> tuple[Box, list] | None:
    """The box around torch tensor `given` (a strided slice of a wider one: dimensions that nest, each stride a
    multiple of the next inner one's and past its extent) that lies inside its storage, and the ATen operators
    that slice the box back to it; None where it is dense already, overlaps itself, broadcasts, is empty, or its
    layout is not known in numbers.

    The box's dimensions are the tensor's in memory order, each as long as the next outer one's stride spans
    (the outermost as long as the tensor's), and, where the innermost stride is above 1, that stride's elements.
    It starts as far before the tensor's first element as it must to end inside the storage."""
    import torch

    sizes, strides, offset = tuple(given.shape), tuple(given.stride()), given.storage_offset()
    try:
        storage = given.untyped_storage().nbytes() // given.element_size()
    except (RuntimeError, NotImplementedError):
        return None
    if not all(isinstance(v, int) for v in (*sizes, *strides, offset, storage)) or math.prod(sizes) == 0 \
            or dense(sizes, strides):
        return None
    kept = [d for d in range(len(sizes)) if sizes[d] != 1]
    order = sorted(kept, key=lambda d: (-strides[d], d))  # outermost first
    if any(strides[d] <= 0 for d in kept) or any(
            strides[outer] % strides[inner] or strides[outer] < sizes[inner] * strides[inner]
            for outer, inner in zip(order, order[1:])):
        return None
    lengths = [sizes[order[0]]] + [strides[outer] // strides[inner] for outer, inner in zip(order, order[1:])]
    innermost = strides[order[-1]]
    shape = (*lengths, innermost) if innermost > 1 else tuple(lengths)
    shift = max(0, offset + math.prod(shape) - storage)
    if shift > offset:
        return None
    # the first element's place in the box: the shift in the box's mixed radix, innermost first
    place, rest = [], shift
    for length in reversed(shape):
        place.append(rest % length)
        rest //= length
    place.reverse()
    if rest or any(at + sizes[d] > length for at, d, length in zip(place, order, shape)):
        return None
    aten = torch.ops.aten
    steps = [(aten.slice.Tensor, (axis, at, at + sizes[d]))
             for axis, (at, d, length) in enumerate(zip(place, order, shape)) if (at, sizes[d]) != (0, length)]
    if innermost > 1:
        steps.append((aten.select.int, (len(order), place[-1])))
    if order != kept:
        steps.append((aten.permute.default, ([order.index(d) for d in kept],)))
    if len(kept) != len(sizes):
        steps.append((aten.view.default, (list(sizes),)))
    return Box(shape, shift, sizes, strides), steps


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def restride_placeholders(graph, example_inputs) -> None:
    """The graph's inputs laid out as the examples it is compiled for are: AOTAutograd traces a backward graph on
    the strides the forward's compiler reported for the values it saves (`save_channels_last`) but passes them in
    the examples only, not in the graph's own metadata."""
    import torch

    for node, given in zip([n for n in graph.nodes if n.op == "placeholder"], example_inputs):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(given, torch.Tensor):
            continue
        shape, strides = as_numbers(value.shape), as_numbers(given.stride())
        if shape is not None and strides is not None and shape == as_numbers(given.shape) \
                and strides != as_numbers(value.stride()):
            node.meta["val"] = value.as_strided(value.shape, strides)


def save_channels_last(graph) -> None:
    """In a forward graph whose convolutions ember runs on channels-last memory (ember.set_conv_memory_format: the
    half-precision ones), the activations saved for the backward cross to it as they lie: each such output (4-d,
    half-precision or boolean, or a max-pooling's window offsets; computed by the graph, returned nowhere else) is
    made a channels-last tensor of torch's, and its strides are reported to AOTAutograd
    (TracingContext.output_strides, as Inductor reports its layouts), which traces the backward graph on them;
    `in_memory_order` then writes and reads that memory with no transposition. Without this, ember would transpose
    every saved activation to torch's contiguous layout at the forward's end and back at the backward's start."""
    import torch
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    reported = getattr(context, "output_strides", None)
    try:  # (an inference graph's metadata counts no saved values)
        saved = context.fw_metadata.tensors_saved_for_backwards_slice
    except (AttributeError, AssertionError):
        saved = None
    convolution = torch.ops.aten.convolution.default
    half = (torch.float16, torch.bfloat16)
    if reported is None or saved is None or not any(
            n.target is convolution and getattr(n.meta.get("val"), "dtype", None) in half for n in graph.nodes):
        return  # not a forward graph AOTAutograd compiles for a backward, or one with no half-precision convolution
    output = next(n for n in graph.nodes if n.op == "output")
    nodes = list(output.args[0])
    kept = set(range(len(nodes))[saved])
    positions = collections.defaultdict(set)
    for p, node in enumerate(nodes):
        positions[node].add(p)
    strides: list = [None] * len(nodes)
    for p in sorted(kept):
        node = nodes[p]
        value = getattr(node, "meta", {}).get("val")
        activation = _pooling_windows(node) or not auxiliary(node) and getattr(value, "dtype", None) in (
            torch.float16, torch.bfloat16, torch.bool)
        if (not activation or not isinstance(value, torch.Tensor) or value.dim() != 4 or not positions[node] <= kept
                or node.op != "call_function" or getattr(node.target, "is_view", False)):
            continue
        shape, given = as_numbers(value.shape), as_numbers(value.stride())
        if shape is None or given is None or not dense(shape, given):
            continue
        n, c, h, w = shape
        layout = (h * w * c, 1, w * c, c)
        node.meta["val"] = value.as_strided(value.shape, layout)
        for q in positions[node]:
            strides[q] = layout
    reported.extend(strides)


def _pooling_windows(node) -> bool:
    """Whether fx node `node` is the indices' output of a 2-d max-pooling without dilation, where ember computes
    each window's first maximum (aten's `_max_pool_with_indices`: one byte an output, in torch's int64 place)."""
    import torch

    if not auxiliary(node) or node.args[0].target is not torch.ops.aten.max_pool2d_with_indices.default:
        return False
    pooling = node.args[0]
    dilation = pooling.args[4] if len(pooling.args) > 4 else pooling.kwargs.get("dilation", 1)
    return all(d == 1 for d in ((dilation,) if isinstance(dilation, int) else dilation))


def memory_order(value) -> list[int] | None:
    """The order of a tensor's dimensions in memory, outermost first, where torch lays it out densely in another
    order than its own dimensions' (what ember's values are); None where it is contiguous, not dense, or its layout
    is not known in numbers."""
    import torch

    if not isinstance(value, torch.Tensor) or value.is_sparse:
        return None
    shape, strides = as_numbers(value.shape), as_numbers(value.stride())
    if shape is None or strides is None or math.prod(shape) == 0 or dense(shape, strides):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    return order if dense([shape[d] for d in order], [strides[d] for d in order]) else None


def as_numbers(sizes) -> tuple[int, ...] | None:
    """Sizes or strides as numbers: a symbolic one (dynamic shapes) by the value it was traced with, which orders
    a dense layout's dimensions as every other value does; None where one has no such value."""
    numbers = [d if isinstance(d, int) else getattr(getattr(d, "node", None), "hint", None) for d in sizes]
    return tuple(numbers) if all(isinstance(d, int) for d in numbers) else None


def dense(shape, strides) -> bool:
    """Whether (shape, strides) is contiguous (a dimension of size 1 has any stride)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def inverse(order: list[int]) -> list[int]:
    back = [0] * len(order)
    for i, d in enumerate(order):
        back[d] = i
    return back
