"""Folding a per-channel affine into the convolution before it: a pass over the lowered graph, between
`passes.lower` and the fusion planner, for targets with vendor convolutions.

A convolution's result followed only by ops that scale and shift each output channel by values known before it
(its bias, an eval-mode batch norm's running statistics, weight and bias; scalars) is

    y = conv(x, w) · scale[c] + shift[c] = conv(x, w · scale[c]) + shift[c]

so the convolution can run on a rescaled weight and add `shift` as its bias (the CONV2D primitive's optional third
input). The weight and bias are rescaled by small kernels on every run of the plan (the values may change between
steps; weights are small), and the pass over the activation that applied the affine disappears: the vendor step
adds the bias as it copies the convolution's result into its buffer, a copy it makes anyway.

It folds only where that saves bytes, by the planner's own choice of what it stores (`fusion.stored_values`): the
affine's result must be a value the planner would write in a pass of its own (a plan output, a vendor op's operand,
a shared value it stores). When pointwise readers take the affine in (a ReLU, a residual add, a reduction), it
costs no pass of its own and the fold would only add the rescaling, so it stays as it is. The rescaling must also
move fewer bytes than the pass it saves (a large weight over a small activation is not folded).

Values computed from the convolution's result (a training-mode batch norm's batch statistics) are not known
before it, so nothing is folded through them. Gradients are unchanged: the backward graph is already built, from
the unfolded ops, and reads none of the values folded away.
"""

from __future__ import annotations

import dataclasses

from ember import dtypes
from ember.compiler import fusion
from ember.compiler.context import CompileContext
from ember.compiler.fused import Costs
from ember.compiler.passes import Lowered
from ember.ir import Node, Op, toposort

AFFINE_OPS = (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.NEG, Op.CAST)


@dataclasses.dataclass
class _Affine:
    """A convolution's result through a chain of ops that scale and shift each channel: the chain's ops, and the
    scale and shift they come to, as nodes of shape (channels,) in the computation's dtype (None: 1 and 0)."""

    conv: Node
    channel: int  # the axis of its output channels: 1, or 3 for a convolution on channels-last memory
    ops: list[Node] = dataclasses.field(default_factory=list)
    scale: Node | None = None
    shift: Node | None = None

    def ones(self) -> Node:
        """A scale of 1 per channel, in the computation's dtype."""
        return _ones(self.conv.shape[self.channel], dtypes.compute_dtype(self.conv.dtype), self.conv.device)


def fold_affines(lowered: Lowered, context: CompileContext, costs: Costs) -> Lowered:
    """The lowered graph with each convolution whose result is only scaled and shifted per channel, in a value the
    planner would store, rewritten as a convolution of the rescaled weight with a bias (see the module's text)."""
    convolutions = [n for n in lowered.nodes if n.op is Op.CONV2D and len(n.inputs) == 2 and n.dtype.is_floating_point]
    if not convolutions:
        return lowered
    users: dict[int, list[Node]] = {}
    for n in lowered.nodes:
        for i in n.inputs:
            users.setdefault(id(i), []).append(n)
    outputs = {id(o) for o in lowered.outputs}
    affines = [a for a in (_affine_after(c, users, outputs) for c in convolutions) if a is not None]
    if not affines:
        return lowered
    stored = fusion.stored_values(lowered.nodes, lowered.outputs, context, costs)
    folded = {id(a.ops[-1]): _folded(a) for a in affines if id(a.ops[-1]) in stored and _saves_bytes(a)}
    if not folded:
        return lowered
    return _rebuilt(lowered, folded)


def _affine_after(conv: Node, users: dict[int, list[Node]], outputs: set[int]) -> _Affine | None:
    """The longest chain of per-channel affine ops after `conv` whose values nothing else reads, up to the last
    value in the convolution's dtype; None if there is none. Since the convolution and each value of the chain
    have the chain's next op as their only reader, no factor of the chain is computed from them (a training-mode
    batch norm's statistics end the chain where they read it)."""
    channel = 3 if conv.attrs.get("channels_last") else 1
    affine, ops, end = _Affine(conv, channel), [], 0
    committed = (None, None)
    value = conv
    while id(value) not in outputs and len(users.get(id(value), ())) == 1:
        user = users[id(value)][0]
        if user.shape != conv.shape or user.op not in AFFINE_OPS or not user.dtype.is_floating_point:
            break
        others = [i for i in user.inputs if i is not value]
        if len(others) != len(user.inputs) - 1:  # the value twice (x * x): not affine
            break
        factor = None
        if others:
            factor = _per_channel(others[0], conv, channel)
            if factor is None:
                break
        if not _compose(affine, user, factor, value_first=user.inputs[0] is value):
            break
        ops.append(user)
        value = user
        if user.dtype is conv.dtype:
            end = len(ops)
            committed = (affine.scale, affine.shift)
    if end == 0:
        return None
    affine.ops = ops[:end]
    affine.scale, affine.shift = committed
    if affine.scale is None and affine.shift is None:  # casts there and back
        return None
    return affine


def _per_channel(operand: Node, conv: Node, channel: int) -> Node | None:
    """`operand` of an op on the convolution's result as a vector of one value per output channel, in the
    computation's dtype, if it is such a value (a broadcast of a (1, C, 1, 1) value, or of a single value; a scalar
    constant); else None."""
    channels = conv.shape[channel]
    wide = dtypes.compute_dtype(conv.dtype)
    if operand.op is Op.CONST:  # one value at every position, an argument of the plan or not
        return Node(Op.CONST, (), {**operand.attrs, "shape": (channels,), "dtype": wide}, (channels,), wide,
                    operand.device)
    source = operand.inputs[0] if operand.op is Op.EXPAND else operand
    if len(source.shape) != 4 or source.shape[channel] not in (1, channels) or \
            any(s != 1 for d, s in enumerate(source.shape) if d != channel):
        return None
    if source.shape[channel] == channels:
        vector = _reshaped(source, (channels,))
    else:
        vector = _made(Op.EXPAND, _reshaped(source, (1,)), shape=(channels,))
    return _cast(vector, wide)


def _compose(affine: _Affine, op: Node, factor: Node | None, value_first: bool) -> bool:
    """Apply `op` (of the running value and `factor`, per channel) to the affine's scale and shift; False for an op
    that is not affine in the value (a division by it)."""
    scale, shift = affine.scale, affine.shift
    if op.op is Op.CAST:
        return True
    if op.op is Op.NEG:
        scale, shift = _neg(affine.ones() if scale is None else scale), _neg(shift)
    elif op.op is Op.ADD:
        shift = factor if shift is None else _made(Op.ADD, shift, factor)
    elif op.op is Op.SUB and value_first:
        shift = _neg(factor) if shift is None else _made(Op.SUB, shift, factor)
    elif op.op is Op.SUB:  # factor - value
        scale = _neg(affine.ones() if scale is None else scale)
        shift = factor if shift is None else _made(Op.SUB, factor, shift)
    elif op.op is Op.MUL:
        scale = factor if scale is None else _made(Op.MUL, scale, factor)
        shift = None if shift is None else _made(Op.MUL, shift, factor)
    elif op.op is Op.DIV and value_first:
        scale = _made(Op.DIV, affine.ones() if scale is None else scale, factor)
        shift = None if shift is None else _made(Op.DIV, shift, factor)
    else:
        return False
    affine.scale, affine.shift = scale, shift
    return True


def _saves_bytes(affine: _Affine) -> bool:
    """Whether the pass over the activation that the fold removes (a read of the convolution's result, a write of
    the affine's) moves more bytes than rescaling the weight (a read and a write of it) does."""
    conv = affine.conv
    saved = conv.numel * conv.dtype.itemsize * 2
    weight = conv.inputs[1]
    rescaled = 2 * weight.numel * weight.dtype.itemsize if affine.scale is not None else 0
    return saved > rescaled


def _folded(affine: _Affine) -> Node:
    """The convolution of the rescaled weight, with the shift as its bias."""
    conv = affine.conv
    x, weight = conv.inputs
    if affine.scale is not None:
        channels = affine.scale.shape[0]
        spread = _made(Op.EXPAND, _reshaped(affine.scale, (channels, 1, 1, 1)), shape=weight.shape)
        weight = _cast(_made(Op.MUL, _cast(weight, affine.scale.dtype), spread), weight.dtype)
    inputs = (x, weight) if affine.shift is None else (x, weight, affine.shift)
    attrs = {**conv.attrs, "folded": tuple(op.op.label for op in affine.ops if op.op is not Op.CAST)}
    return Node(Op.CONV2D, inputs, attrs, conv.shape, conv.dtype, conv.device)


def _rebuilt(lowered: Lowered, replacements: dict[int, Node]) -> Lowered:
    """`lowered` with the nodes whose ids `replacements` holds replaced, and the nodes after them made again. A
    replacement is made of the graph's nodes as they were: where one of those was replaced or made again (a
    convolution reading another's folded result), it is made again on the new one."""
    graph = {id(n) for n in lowered.nodes}
    now: dict[int, Node] = {}
    made: dict[int, Node] = {}  # the replacements' own nodes, made again

    def current(node: Node) -> Node:
        if id(node) in graph:
            return now.get(id(node), node)
        if id(node) not in made:
            made[id(node)] = _with_inputs(node, tuple(current(i) for i in node.inputs))
        return made[id(node)]

    for n in lowered.nodes:  # inputs first: a replacement reads only nodes placed before the one it replaces
        if id(n) in replacements:
            now[id(n)] = current(replacements[id(n)])
        else:
            new = _with_inputs(n, tuple(now.get(id(i), i) for i in n.inputs))
            if new is not n:
                now[id(n)] = new
    outputs = [now.get(id(o), o) for o in lowered.outputs]
    nodes = toposort(outputs)
    return Lowered(nodes, outputs, lowered.inputs, replaced=lowered.replaced + len(lowered.nodes) - len(nodes))


def _with_inputs(node: Node, inputs: tuple[Node, ...]) -> Node:
    """`node` itself if its inputs are these, else a node like it on them."""
    if all(a is b for a, b in zip(inputs, node.inputs)):
        return node
    return Node(node.op, inputs, node.attrs, node.shape, node.dtype, node.device)


# -- nodes of the scale and shift ---------------------------------------------------------------------------

def _made(op: Op, *inputs: Node, **attrs) -> Node:
    return Node.make(op, inputs, **attrs)


def _reshaped(node: Node, shape: tuple[int, ...]) -> Node:
    """`node` reshaped, from under the reshapes it is made of."""
    while node.op is Op.RESHAPE:
        node = node.inputs[0]
    return node if node.shape == shape else _made(Op.RESHAPE, node, shape=shape)


def _cast(node: Node, dtype: dtypes.DType) -> Node:
    return node if node.dtype is dtype else _made(Op.CAST, node, dtype=dtype)


def _neg(node: Node | None) -> Node | None:
    return None if node is None else _made(Op.NEG, node)


def _ones(channels: int, dtype: dtypes.DType, device) -> Node:
    return Node(Op.CONST, (), {"shape": (channels,), "dtype": dtype, "value": 1.0}, (channels,), dtype, device)
