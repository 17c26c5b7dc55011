"""The channels-last layout, a part of the lowering (compiler/passes.py).

cuDNN's half-precision convolutions run on (N, H, W, C) memory; given (N, C, H, W) they transpose their operands
and results around every call. So under the compile context's channels_last memory format (or where a
convolution asks for it), a float16 or bfloat16 convolution runs channels-last (the primitive's channels_last
attribute: its activations are (N, H, W, C) and its weight and weight gradient (O, kH, kW, I)) between permutes,
and the permute back to (N, C, H, W) sinks through what follows (pointwise ops, broadcasts, reductions, and the
pads, strided slices and reshapes of a max-pooling and its gradient) until the next convolution's permute to
(N, H, W, C) cancels it: batch norms, activations, poolings and residual adds between convolutions run on
channels-last memory, and nothing is transposed between them. What is left to transpose (the weights, the
network's input) the planner stores by the plan's own kernels (small and independent of each other, they share
launches), so cuDNN reads every operand as it lies. A stride-1 convolution's input gradient becomes a forward
convolution of the output gradient by the swapped, flipped weight, which cuDNN writes straight into its buffer.
"""

from __future__ import annotations

from ember import dtypes
from ember.ir import Kind, Node, Op

CONVOLUTIONS = (Op.CONV2D, Op.CONV2D_INPUT_GRAD, Op.CONV2D_WEIGHT_GRAD)
SPLIT_REDUCTIONS = (Op.SUM, Op.MAX, Op.MIN, Op.PROD)  # the reductions that combine partial results


class ChannelsLast:
    """The lowering builder's channels-last rewrites (mixed into compiler/passes.py's builder, whose `make`
    they call)."""

    channels_last: bool  # these three are the builder's (compiler/passes.py), which says what each holds
    laying_out: bool
    in_nhwc: dict

    def _channels_last(self, op: Op, ins: tuple[Node, ...], attrs: dict, original: Node) -> Node | None:
        if not self.laying_out:
            return None
        if op in CONVOLUTIONS:
            requested = attrs.get("memory_format")  # as the convolution was called (conv2d's memory_format)
            asked = requested == "channels_last" if requested is not None else self.channels_last
            if not asked or attrs.get("channels_last") or original.dtype not in (dtypes.float16, dtypes.bfloat16):
                return None
            laid_out = {key: v for key, v in attrs.items() if key != "memory_format"} | {"channels_last": True}
            if op is Op.CONV2D_INPUT_GRAD and len(ins) == 2:
                forward = forward_padding(ins[1].shape[2:], attrs["stride"], attrs["padding"], attrs["dilation"],
                                          attrs["groups"])
                if forward is not None:
                    return self._input_grad_as_forward(ins, attrs, forward, original)
            # both operands and the result channels-last: activations (N, H, W, C), weights and the weight
            # gradient (O, kH, kW, I), the memory cuDNN's channels-last kernels read and write
            operands = tuple(self._permuted(i, _to_nhwc(4)) for i in ins[:2])
            out = self.make(op, (*operands, *ins[2:]), laid_out, shaped_like(original, _nhwc(original.shape)))
            return self._permuted(out, _to_nchw(4), original)
        rank = len(original.shape)
        if op is Op.PERMUTE and rank >= 4 and tuple(attrs["order"]) in (_to_nchw(rank), _to_nhwc(rank)) \
                and _keeps_order(ins[0].shape, attrs["order"]):
            return self.make(Op.RESHAPE, ins, {"shape": original.shape}, original)  # moves only axes of size 1
        if rank < 4 or not any(_is_to_nchw(i) for i in ins):
            return None
        inner_like = shaped_like(original, _nhwc(original.shape))
        if op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY):
            inner = [self._to_nhwc(i) for i in ins]
            if any(i is None for i in inner):
                return None  # an operand would be read transposed: leave the permute where it is
            return self._permuted(self.make(op, tuple(inner), attrs, inner_like), _to_nchw(rank), original)
        if op.kind is Kind.MOVEMENT:
            moved = self._moved(op, ins[0].inputs[0], attrs, original)
            return None if moved is None else self._permuted(moved, _to_nchw(rank), original)
        if op in SPLIT_REDUCTIONS:
            axes = tuple(sorted(_to_nchw(rank)[a] for a in attrs["axes"]))
            return self._permuted(self.make(op, (ins[0].inputs[0],), {**attrs, "axes": axes}, inner_like),
                                  _to_nchw(rank), original)
        return None

    def _input_grad_as_forward(self, ins: tuple[Node, ...], attrs: dict, padding: tuple[int, ...],
                               original: Node) -> Node:
        """A stride-1 convolution's input gradient as cuDNN's forward convolution of the output gradient, which
        writes straight into its buffer (cuDNN's backward-data result, through torch, is copied into it): the
        weight's channels swapped and its window flipped by the plan's own kernel, into (I, kH, kW, O) memory,
        and the padding widened back (see `forward_padding`)."""
        grad, weight = ins
        axes = tuple(a for a in (2, 3) if weight.shape[a] > 1)
        flipped = self.make(Op.FLIP, (weight,), {"axes": axes}, weight) if axes else weight
        conv = {"stride": (1, 1), "padding": padding, "dilation": tuple(attrs["dilation"]), "groups": 1,
                "channels_last": True}
        out = self.make(Op.CONV2D, (self._permuted(grad, _to_nhwc(4)), self._permuted(flipped, (1, 2, 3, 0))), conv,
                        shaped_like(original, _nhwc(original.shape)))
        return self._permuted(out, _to_nchw(4), original)

    def _moved(self, op: Op, x: Node, attrs: dict, original: Node) -> Node | None:
        """The movement op `op` (`attrs`, making `original`) of an (N, C, ...) value, made on `x`, that value's
        (N, ..., C) form: pads, slices and broadcasts of the other axes, and reshapes that keep N and C the
        leading axes (a max-pooling's windows and its gradient's strided repeats). None where it would move
        the channels among the other axes (a reshape merging them, a permute)."""
        shape, to_nhwc = _nhwc(original.shape), _to_nhwc(len(original.shape))
        target = shaped_like(original, shape)
        if op is Op.EXPAND:
            return self.make(op, (x,), {**attrs, "shape": shape}, target)
        if op is Op.PAD:
            return self.make(op, (x,), {**attrs, "pads": tuple(attrs["pads"][a] for a in to_nhwc)}, target)
        if op is Op.SLICE:
            return self.make(op, (x,), {**attrs, "slices": tuple(attrs["slices"][a] for a in to_nhwc)}, target)
        if op is Op.RESHAPE and (x.shape[0], x.shape[-1]) == original.shape[:2]:
            return self.make(op, (x,), {**attrs, "shape": shape}, target)
        return None

    def _permuted(self, x: Node, order: tuple[int, ...], original: Node | None = None) -> Node:
        shape = tuple(x.shape[i] for i in order)
        return self.make(Op.PERMUTE, (x,), {"order": order}, original or shaped_like(x, shape))

    def _to_nhwc(self, x: Node) -> Node | None:
        """x (N, C, ...) as an (N, ..., C) node, if that costs no transposition of a value: x is a permute from
        (N, ..., C), a constant, a value whose axes longer than 1 stay in order, a pointwise op of such nodes or a
        movement op (a broadcast, pad, slice or reshape that `_moved` allows) of one (made again on the permuted
        ones), or an input of bytes, read transposed."""
        if id(x) not in self.in_nhwc:
            self.in_nhwc[id(x)] = self._relayout(x)
        return self.in_nhwc[id(x)]

    def _relayout(self, x: Node) -> Node | None:
        rank = len(x.shape)
        shape = _nhwc(x.shape)
        if _is_to_nchw(x):
            return x.inputs[0]
        if x.op is Op.CONST:
            return self.make(Op.CONST, (), {**x.attrs, "shape": shape}, shaped_like(x, shape))
        if _keeps_order(x.shape, _to_nhwc(rank)):
            return self.make(Op.RESHAPE, (x,), {"shape": shape}, shaped_like(x, shape))
        if x.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY):
            inputs = [self._to_nhwc(i) for i in x.inputs]
            if any(i is None for i in inputs):
                return None
            return self.make(x.op, tuple(inputs), x.attrs, shaped_like(x, shape))
        if x.op in (Op.EXPAND, Op.PAD, Op.SLICE, Op.RESHAPE) and len(x.inputs[0].shape) >= 4:
            inner = self._to_nhwc(x.inputs[0])
            return None if inner is None else self._moved(x.op, inner, x.attrs, x)
        if x.op is Op.BUFFER and x.dtype.itemsize == 1:
            # an input of bytes (a mask, a max-pooling's window offsets) read transposed, so that what reads
            # it with channels-last values runs on their memory: half the bytes of a bfloat16 value of its
            # shape read so
            return self._permuted(x, _to_nhwc(rank))
        return None


def forward_padding(kernel: tuple[int, ...], stride, padding, dilation, groups: int) -> tuple[int, ...] | None:
    """The padding of the forward convolution that computes a convolution's input gradient from its output
    gradient (with the weight's channels swapped and its window flipped): d * (k - 1) - p on each axis, where
    the convolution has stride 1 and no groups and its padding is within the window's reach; else None."""
    reach = [d * (k - 1) for k, d in zip(kernel, dilation)]
    if groups != 1 or any(s != 1 for s in stride) or any(p > r for p, r in zip(padding, reach)):
        return None
    return tuple(r - p for r, p in zip(reach, padding))


def shaped_like(node: Node, shape: tuple[int, ...], dtype: dtypes.DType | None = None) -> Node:
    """A template for `make`: node's device (and dtype, unless given) with another shape."""
    return Node(Op.BUFFER, (), {}, shape, dtype or node.dtype, node.device)


def _nhwc(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The (N, H, W, C) shape of an (N, C, H, W) one (of any rank: the channels moved last)."""
    return (shape[0], *shape[2:], shape[1])


def _to_nhwc(rank: int) -> tuple[int, ...]:
    """The permute of an (N, C, ...) value of `rank` axes to channels-last, (N, ..., C): (0, 2, 3, 1) in 4-d."""
    return (0, *range(2, rank), 1)


def _to_nchw(rank: int) -> tuple[int, ...]:
    """The permute of an (N, ..., C) value of `rank` axes back to (N, C, ...): (0, 3, 1, 2) in 4-d."""
    return (0, rank - 1, *range(1, rank - 1))


def _is_to_nchw(node: Node) -> bool:
    rank = len(node.shape)
    return node.op is Op.PERMUTE and rank >= 4 and tuple(node.attrs["order"]) == _to_nchw(rank)


def _keeps_order(shape: tuple[int, ...], order: tuple[int, ...]) -> bool:
    """Whether permuting `shape` by `order` keeps its axes longer than 1 in order (a reshape, then)."""
    moved = [a for a in order if shape[a] != 1]
    return moved == sorted(moved)
