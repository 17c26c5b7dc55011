"""Graph passes that run before fusion, on a private copy of the pending graph (whose key, read before them, is
compiler/signatures.py's).

`lower` copies the graph into placeholder nodes that hold no user data and
simplifies it: common-subexpression elimination, constant folding, algebraic
identities (x*1, x+0, --x, cast chains) and folding of chained movement ops.
Dead code never enters, because only nodes the outputs need are copied. It also
stages reductions the GPU would run on too few programs or with gathered reads
(split, nested and merged reductions), and, under the compile context's
channels_last memory format, lays half-precision convolutions and the ops between
them out on (N, H, W, C) memory (compiler/layout.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ember import dtypes
from ember.compiler.layout import CONVOLUTIONS, SPLIT_REDUCTIONS, ChannelsLast, shaped_like
from ember.compiler.patterns.gemm import gemm_splits  # the GEMM pattern's own decision (_summed_by_gemms)
from ember.compiler.patterns.rows import column_parts, column_rows_together  # the row pattern's column split
from ember.compiler.signatures import Signature
from ember.errors import CompileError
from ember.ir import Kind, Node, Op, toposort
from ember.ir.node import is_runtime_scalar
from ember.ir.ops import RULES, expand


def _attr_key(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _attr_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


@dataclass
class Lowered:
    """The private, simplified graph that fusion plans over."""

    nodes: list[Node]  # topological order, placeholders for inputs included
    outputs: list[Node]  # one per kept original node, in `order`
    inputs: list[Node]  # placeholders: op BUFFER, attrs {"input": k}
    replaced: int = 0  # nodes removed by the passes

    @functools.cached_property
    def sources(self) -> list[tuple[int, int]]:
        """Per output: the inputs, and the index checks (its CHECK_INDEX nodes, in order), that its value is
        computed from, as bit masks (bit k: input k; check k)."""
        position = {id(n): k for k, n in enumerate(self.inputs)}
        masks: dict[int, tuple[int, int]] = {}  # node id -> (inputs' bits, checks' bits)
        checks = 0
        for n in self.nodes:
            read, checked = 1 << position[id(n)] if id(n) in position else 0, 0
            for i in n.inputs:
                r, c = masks[id(i)]
                read, checked = read | r, checked | c
            if n.op is Op.CHECK_INDEX:
                checked |= 1 << checks
                checks += 1
            masks[id(n)] = (read, checked)
        return [masks[id(o)] for o in self.outputs]


def expand_composites(order: list[Node], keep: set[int]) -> tuple[list[Node], list[Node]]:
    """The graph with every composite node replaced by its primitives (ember.ir.ops.define_composite), the nodes
    after it made again on them, as (order, results): `results` are what the kept nodes became, in `order`'s
    order (an expansion shared by several results may place a later one's nodes first). An expansion made of
    composites (cross entropy of log-softmax) is expanded in turn. The graph itself is unchanged; the caller's
    `order` when it has no composite."""
    results = [n for n in order if id(n) in keep]
    for _ in range(COMPOSITE_DEPTH):
        if not any(n.op.kind is Kind.COMPOSITE for n in order):
            return order, results
        order, now = _expand_once(order)
        results = [now[id(n)] for n in results]
    raise CompileError(f"composites nested more than {COMPOSITE_DEPTH} deep: "
                       f"{', '.join(sorted({n.op.label for n in order if n.op.kind is Kind.COMPOSITE}))}")


COMPOSITE_DEPTH = 8


def _expand_once(order: list[Node]) -> tuple[list[Node], dict[int, Node]]:
    """`order` with its composite nodes expanded one level; and what each node became, by id."""
    now: dict[int, Node] = {}
    expanded: list[Node] = []
    placed: set[Node] = set()
    leaves = {id(i) for n in order for i in n.inputs if i.realized}
    shared: dict = {}  # the expansions that several composite nodes' results share
    for node in order:
        ins = tuple(now.get(id(i), i) for i in node.inputs)
        if node.op.kind is Kind.COMPOSITE:
            new = expand(node.op, ins, node.attrs, shared)
            made = toposort([new], placed)
            added = [n for n in made if n.op is Op.RAND]
            added += [i for n in made for i in n.inputs if i.realized and id(i) not in leaves]
            if added:  # the plan's arguments are the graph's (its signature): an expansion may not add one
                raise CompileError(f"{node.op.label}: its expansion makes a {added[0].op.label} node, which would "
                                   "be an argument of the plan")
            for n in made:  # a float the expansion computes from the node's attributes and shapes, which the
                if is_runtime_scalar(n):  # plan's key holds: part of the plan's code, not an argument
                    n.attrs = {**n.attrs, "fixed": True}
        else:
            new = node if all(a is b for a, b in zip(ins, node.inputs)) else \
                Node(node.op, ins, node.attrs, node.shape, node.dtype, node.device, static=node.static)
            made = [new]
        expanded += made
        placed.update(made)
        now[id(node)] = new
    return expanded, now


def lower(order: list[Node], keep: set[int], sig: Signature, channels_last: bool = False,
          multiprocessors: int = 0, results: list[Node] | None = None, gpu_multiprocessors: int = 0) -> Lowered:
    """`multiprocessors`: the SMs of the GPU that generated GEMMs run on (0: none, or not generated), which
    decides what a GEMM sums along K itself. `gpu_multiprocessors`: the GPU's SMs, which decide how a column
    reduction is split (0: unknown). `results`: the kept nodes in the order the plan gives their values
    (by default `order`'s)."""
    builder = _Builder()
    builder.channels_last = channels_last
    builder.summed_by_gemms = _summed_by_gemms(order, multiprocessors)
    builder.multiprocessors = gpu_multiprocessors
    # convolutions that ask for channels-last themselves (conv2d's memory_format) turn the layout on
    builder.laying_out = channels_last or any(n.attrs.get("memory_format") == "channels_last" for n in order
                                              if n.op in CONVOLUTIONS)
    builder.transposed_products = _transposed_products(order, keep)
    mapping: dict[int, Node] = {}
    for k, leaf in enumerate(sig.inputs):
        mapping[id(leaf)] = builder.input(k, leaf)
    scalar_index = 0
    rand_index = 0
    outputs = []
    for node in order:
        ins = tuple(mapping[id(i)] for i in node.inputs)
        attrs = dict(node.attrs)
        if node.op is Op.RAND:
            attrs = {"distribution": attrs["distribution"], "seed_arg": rand_index, "shape": node.shape}
            rand_index += 1
        elif is_runtime_scalar(node):
            attrs = {"shape": node.shape, "dtype": node.dtype, "value": attrs["value"], "arg": scalar_index}
            scalar_index += 1
        new = builder.make(node.op, ins, attrs, node)
        mapping[id(node)] = new
        if id(node) in keep:
            outputs.append(new)
    if results is not None:
        outputs = [mapping[id(r)] for r in results]
    nodes = toposort(outputs)
    return Lowered(nodes, outputs, builder.inputs, replaced=len(order) - sum(1 for n in nodes if n.inputs))


def _transposed_products(order: list[Node], keep: set[int]) -> set[int]:
    """Matmuls read only through a transpose of their last two axes (a weight gradient, for one):
    lowered as the product of the transposed operands, (AB)^T = B^T A^T, so no kernel transposes."""
    readers: dict[int, list[Node]] = {}
    for node in order:
        for i in node.inputs:
            readers.setdefault(id(i), []).append(node)
    found = set()
    for node in order:
        if node.op is Op.MATMUL and id(node) not in keep:
            users = readers.get(id(node), [])
            if users and all(u.op is Op.PERMUTE and _swaps_last_two(u.attrs["order"]) for u in users):
                found.add(id(node))
    return found


def _computed_by_matmul(node: Node, depth: int = 8) -> bool:
    """Whether `node` is a matmul's result through pointwise work and reshapes (its epilogue's values)."""
    for _ in range(depth):
        if node.op is Op.MATMUL:
            return True
        if node.op.kind not in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) and node.op is not Op.RESHAPE:
            return False
        shaped = [i for i in node.inputs if math.prod(i.shape) == math.prod(node.shape)]
        if not shaped:
            return False
        node = next((i for i in shaped if i.op is Op.MATMUL), shaped[0])
    return False


def _summed_by_gemms(order: list[Node], multiprocessors: int) -> set[tuple[int, int]]:
    """(id(node), axis) of the operands of 2-d matmuls whose long K a generated GEMM splits over several
    programs per tile (see patterns.gemm.gemm_splits): a sum of such an operand along K is taken in that GEMM's
    mainloop in float32, spread as widely as the GEMM is, so it is not staged as a reduction of its own."""
    found = set()
    for node in order:
        if node.op is not Op.MATMUL or len(node.shape) != 2 or not node.dtype.is_floating_point:
            continue
        (m, k), n = node.inputs[0].shape, node.shape[1]
        if gemm_splits(m, n, k, multiprocessors) == 1:
            continue
        for position, operand in enumerate(node.inputs):
            k_axis = 1 if position == 0 else 0
            if operand.op is Op.PERMUTE and _swaps_last_two(operand.attrs["order"]):
                operand, k_axis = operand.inputs[0], 1 - k_axis
            found.add((id(operand), k_axis))
    return found


def _swaps_last_two(order: tuple[int, ...]) -> bool:
    n = len(order)
    return n >= 2 and tuple(order) == tuple(range(n - 2)) + (n - 1, n - 2)




class _Builder(ChannelsLast):
    """Creates lowered nodes, applying CSE, folding and simplification on the way."""

    def __init__(self):
        self.seen: dict[tuple, Node] = {}
        self.inputs: list[Node] = []
        self.transposed_products: set[int] = set()  # (ids of original matmuls) lowered transposed
        self.summed_by_gemms: set[tuple[int, int]] = set()  # (id(original node), axis) a split GEMM sums
        self.multiprocessors = 0  # the GPU's SMs, that a split column reduction's partial stage fills (0: unknown)
        self.channels_last = False  # every half-precision convolution on (N, H, W, C) memory
        self.laying_out = False  # some convolution is (those asking for it), so permutes sink
        self.in_nhwc: dict[int, Node | None] = {}  # id(node) -> the node made on (N, H, W, C) memory, if any

    def input(self, k: int, leaf: Node) -> Node:
        node = Node(Op.BUFFER, (), {"input": k}, leaf.shape, leaf.dtype, leaf.device)
        self.inputs.append(node)
        return node

    def make(self, op: Op, ins: tuple[Node, ...], attrs: dict, original: Node) -> Node:
        simplified = self._simplify(op, ins, attrs, original)
        if simplified is not None:
            return simplified
        return self._made(op, ins, attrs, original)

    def _made(self, op: Op, ins: tuple[Node, ...], attrs: dict, original: Node) -> Node:
        """The node as given, not simplified (one already in its final form), or the equal one made before."""
        key = (op, tuple(id(i) for i in ins), _attr_key(attrs), original.shape, original.dtype.name)
        if key in self.seen and op is not Op.RAND:
            return self.seen[key]
        node = Node(op, ins, attrs, original.shape, original.dtype, original.device)
        self.seen[key] = node
        return node

    def _const(self, value, like: Node) -> Node:
        attrs = {"shape": like.shape, "dtype": like.dtype, "value": value}
        return self.make(Op.CONST, (), attrs, like)

    def _simplify(self, op: Op, ins: tuple[Node, ...], attrs: dict, original: Node) -> Node | None:
        kind = op.kind
        # constant folding: pointwise ops of structural constants, movement of constants
        if ins and all(i.op is Op.CONST and "arg" not in i.attrs for i in ins):
            if kind is Kind.MOVEMENT and op is not Op.PAD:
                return self._const(ins[0].attrs["value"], original)
            if kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY):  # by the primitive's reference rule
                args = [np.asarray(i.attrs["value"], dtype=dtypes.compute_dtype(i.dtype).np) for i in ins]
                with np.errstate(all="ignore"):
                    value = np.asarray(RULES[op].reference(*args, **attrs)).astype(original.dtype.np).item()
                return self._const(value, original)
        laid_out = self._channels_last(op, ins, attrs, original)
        if laid_out is not None:
            return laid_out
        if kind is Kind.BINARY:
            a, b = ins
            if op in (Op.MUL,) and _is_value(b, 1):
                return a
            if op in (Op.MUL,) and _is_value(a, 1):
                return b
            if op in (Op.ADD,) and _is_value(b, 0) and original.dtype.is_integer:
                return a
            if op in (Op.ADD,) and _is_value(a, 0) and original.dtype.is_integer:
                return b
            if op in (Op.SUB,) and _is_value(b, 0) and original.dtype.is_integer:
                return a
            if op is Op.DIV and _is_value(b, 1) and original.dtype.is_floating_point:
                return a
            if op is Op.DIV and b.op is Op.EXPAND and original.dtype.is_floating_point:
                # one reciprocal per broadcast value instead of a division per element (softmax's
                # normalisation, layer norm's scale)
                source = b.inputs[0]
                inverse = self.make(Op.RECIPROCAL, (source,), {}, source)
                spread = self.make(Op.EXPAND, (inverse,), dict(b.attrs), b)
                return self.make(Op.MUL, (a, spread), {}, original)
        if op is Op.NEG and ins[0].op is Op.NEG:
            return ins[0].inputs[0]
        if op is Op.CAST:
            (x,) = ins
            if attrs["dtype"] is x.dtype:
                return x
            if x.op is Op.CAST and _lossless(x.inputs[0].dtype, x.dtype):
                # the inner cast loses nothing, so the outer one can start from the source
                return self.make(Op.CAST, x.inputs, attrs, original)
        if kind is Kind.MOVEMENT:
            return self._fold_movement(op, ins[0], attrs, original)
        if op is Op.SCATTER_ADD and original.dtype in ATOMIC_WIDENING:
            return self._widen_scatter_add(ins, attrs, original)
        if kind is Kind.REDUCE:
            if op is Op.SUM and len(attrs["axes"]) == 1:
                picked = self._one_hot_sum(ins[0], attrs["axes"][0], original)
                if picked is not None:
                    return picked
            if op is Op.SUM:
                factored = self._factored_sum(ins[0], attrs, original)
                if factored is not None:
                    return factored
            staged = self._nested_reduction(op, ins[0], attrs, original)
            if staged is None:
                staged = self._merged_reduction(op, ins[0], attrs, original)
            if staged is not None:
                return staged
            return self._split_reduction(op, ins[0], attrs, original)
        return None

    def _merged_reduction(self, op: Op, x: Node, attrs: dict, original: Node) -> Node | None:
        """A reduction over a run of adjacent axes with kept axes after it (channels-last batch norm's N, H, W
        of N, H, W, C) is a reduction over one axis of their product, which `_split_reduction` can spread
        over many programs."""
        axes = [a for a in attrs["axes"] if x.shape[a] != 1]
        if op not in SPLIT_REDUCTIONS or len(axes) < 2:
            return None
        lo, hi = min(axes), max(axes)
        if any(x.shape[a] != 1 and a not in axes for a in range(lo, hi + 1)) or all(
                s == 1 for s in x.shape[hi + 1:]):
            return None  # not one run, or a trailing one (rows: a row kernel's own case)
        merged = x.shape[:lo] + (math.prod(x.shape[lo:hi + 1]),) + x.shape[hi + 1:]
        x = self.make(Op.RESHAPE, (x,), {"shape": merged}, shaped_like(x, merged))
        kept = merged[:lo] + (1,) + merged[lo + 1:]
        total = self.make(op, (x,), {"axes": (lo,)}, shaped_like(original, kept))
        return self.make(Op.RESHAPE, (total,), {"shape": original.shape}, original)

    def _one_hot_sum(self, x: Node, axis: int, original: Node) -> Node | None:
        """sum over an axis of where(position == k, y, 0), with k and y constant along the axis, is
        y where k is a valid position (and 0 elsewhere): the backward pass of a gather (cross
        entropy's) summed again by log_softmax's backward. No loop over the axis is needed."""
        # ops between the sum and the select that commute with picking the one nonzero value
        around: list[Node] = []
        node = x
        while node.op is Op.NEG or (node.op is Op.MUL and _along(node.inputs[1], axis) is not None) or (
                node.op is Op.CAST and node.dtype.is_floating_point and node.inputs[0].dtype.is_floating_point):
            around.append(node)
            node = node.inputs[0]
        if node.op is not Op.WHERE or not _is_value(node.inputs[2], 0):
            return None
        condition, value = node.inputs[0], node.inputs[1]
        row_value = _along(value, axis)
        if row_value is None and _is_number(value) and value.shape == x.shape:  # a number (nll_loss's -1)
            kept = tuple(1 if d == axis else s for d, s in enumerate(value.shape))
            row_value = self._const(value.attrs["value"], shaped_like(value, kept))
        if condition.op is not Op.EQ or row_value is None:
            return None
        position, key = condition.inputs
        if not _is_position(position, axis):
            position, key = key, position
        row_key = _along(key, axis)
        if not _is_position(position, axis) or row_key is None:
            return None
        flag = shaped_like(row_key, row_key.shape, dtypes.bool_)
        valid = self.make(Op.AND, (self.make(Op.LE, (self._const(0, row_key), row_key), {}, flag),
                                   self.make(Op.LT, (row_key, self._const(x.shape[axis], row_key)), {}, flag)),
                          {}, flag)
        result = self.make(Op.WHERE, (valid, row_value, self._const(0, row_value)), {}, row_value)
        for op_node in reversed(around):  # innermost first
            template = shaped_like(result, result.shape, op_node.dtype)
            if op_node.op is Op.NEG:
                result = self.make(Op.NEG, (result,), {}, template)
            elif op_node.op is Op.CAST:
                result = self.make(Op.CAST, (result,), dict(op_node.attrs), template)
            else:
                result = self.make(Op.MUL, (result, _along(op_node.inputs[1], axis)), {}, template)
        return result if result.shape == original.shape and result.dtype is original.dtype else None

    def _widen_scatter_add(self, ins: tuple[Node, ...], attrs: dict, original: Node) -> Node:
        """GPUs add atomically only in 32- and 64-bit types and float16: accumulate in a wider type and
        convert once. Integers wrap as they would in their own type; bool sums are "any"."""
        base, index, src = ins
        wide = ATOMIC_WIDENING[original.dtype]
        base = self.make(Op.CAST, (base,), {"dtype": wide}, shaped_like(base, base.shape, wide))
        src = self.make(Op.CAST, (src,), {"dtype": wide}, shaped_like(src, src.shape, wide))
        total = self.make(Op.SCATTER_ADD, (base, index, src), attrs, shaped_like(original, original.shape, wide))
        return self.make(Op.CAST, (total,), {"dtype": original.dtype}, original)

    def _nested_reduction(self, op: Op, x: Node, attrs: dict, original: Node) -> Node | None:
        """A reduction over axes that kept axes interleave (batch norm's (0, 2, 3) of N, C, H, W) would give
        each program one output to gather from all over memory: reduce the innermost run of axes first
        (contiguous rows, many of them), then the others over those partial results. Half-precision sums
        keep their partial results in float32 and round once, as a single reduction does."""
        axes = {a for a in attrs["axes"] if x.shape[a] != 1}
        if op not in SPLIT_REDUCTIONS or len(axes) < 2:
            return None
        kept_after = [a for a in range(len(x.shape)) if a not in axes and x.shape[a] != 1]
        inner = {a for a in axes if not any(k > a for k in kept_after)}
        if not inner or inner == axes:
            return None
        wide = dtypes.float32 if original.dtype in (dtypes.float16, dtypes.bfloat16) else original.dtype
        if wide is not original.dtype:
            x = self.make(Op.CAST, (x,), {"dtype": wide}, shaped_like(x, x.shape, wide))
        partial_shape = tuple(1 if a in inner else s for a, s in enumerate(x.shape))
        partial = self.make(op, (x,), {"axes": tuple(sorted(inner))}, shaped_like(x, partial_shape, wide))
        total = self.make(op, (partial,), {"axes": tuple(sorted(axes - inner))},
                          shaped_like(original, original.shape, wide))
        if wide is not original.dtype:
            total = self.make(Op.CAST, (total,), {"dtype": original.dtype}, original)
        return total

    def _factored_sum(self, x: Node, attrs: dict, original: Node) -> Node | None:
        """A float sum of a product with a factor constant along the summed axes (a value per row, broadcast), or
        of its negation, as that factor times the sum of the rest: c·Σy for Σ(c·y), -Σz for Σ(-z). The sum then
        reads nothing computed from the row's other sums, so a row kernel takes it in the same pass over the row
        as theirs (a layer norm's backward: one pass fewer)."""
        if original.dtype not in (dtypes.float32, dtypes.float64):
            return None
        axes = tuple(attrs["axes"])
        if x.op is Op.NEG and x.dtype is original.dtype:
            inner = self._factored_sum(x.inputs[0], attrs, original)
            return None if inner is None else self.make(Op.NEG, (inner,), {}, original)
        if x.op is not Op.MUL or x.dtype is not original.dtype:
            return None
        for factor, rest in (x.inputs, reversed(x.inputs)):
            source = factor.inputs[0] if factor.op is Op.EXPAND else None
            if source is not None and source.shape == original.shape and all(source.shape[a] == 1 for a in axes):
                total = self.make(Op.SUM, (rest,), attrs, original)
                return self.make(Op.MUL, (total, source), {}, original)
        return None

    def _split_reduction(self, op: Op, x: Node, attrs: dict, original: Node) -> Node | None:
        """A long reduction into few outputs would run on few programs and starve the GPU: reduce
        in two stages, first P partial results per output (in parallel), then those."""
        axes = tuple(attrs["axes"])
        if op not in SPLIT_REDUCTIONS or not axes or axes != tuple(range(axes[0], axes[0] + len(axes))):
            return None
        axis = axes[0]
        if original.inputs and (id(original.inputs[0]), axis) in self.summed_by_gemms:
            return None
        if len(axes) > 1:  # adjacent axes reduced together (a loss over every element): one axis of their product
            merged = x.shape[:axis] + (math.prod(x.shape[a] for a in axes),) + x.shape[axes[-1] + 1:]
            x = self.make(Op.RESHAPE, (x,), {"shape": merged}, shaped_like(x, merged))
        n, outputs = x.shape[axis], original.numel
        trailing = all(s == 1 for s in x.shape[axis + 1:])
        # a column reduction into few contiguous positions reads `together` rows at once, as one wider row; not
        # one of values a matmul computes, whose first stage a GEMM or MLP kernel takes in its programs as they are
        together = 1 if trailing or any(s != 1 for s in x.shape[:axis]) or _computed_by_matmul(x) \
            else column_rows_together(outputs)
        parts = self._row_parts(n, outputs) if trailing else column_parts(
            n // together, outputs * together, x.dtype.itemsize, self.multiprocessors)
        if parts == 1 or n * outputs < SPLIT_MIN_ELEMENTS:
            return None
        padded = -(-n // (parts * together)) * parts * together
        if padded != n and not original.dtype.is_floating_point:
            return None
        if padded != n:  # pad with the reduction's identity, so the padding changes nothing
            x = self._padded_rows(op, x, axis, padded, flat=together > 1)
        kept = x.shape[axis + 1:] if together == 1 else (together * outputs,)
        split = x.shape[:axis] + (parts, padded // parts // together) + kept
        x = self.make(Op.RESHAPE, (x,), {"shape": split}, shaped_like(x, split))
        # half-precision sums and products keep their partial results in float32 and round once, as a single
        # reduction does (cast after the reshapes: a reshaped buffer is loaded at its linear position)
        wide = dtypes.float32 if op in (Op.SUM, Op.PROD) and original.dtype in HALF_FLOATS else original.dtype
        if wide is not x.dtype:
            x = self.make(Op.CAST, (x,), {"dtype": wide}, shaped_like(x, x.shape, wide))
        partial_shape = split[:axis + 1] + (1,) + split[axis + 2:]
        # the two stages are made as they are: neither is split again
        partial = self._made(op, (x,), {"axes": (axis + 1,)}, shaped_like(x, partial_shape))
        if together > 1:  # the partial results of each of the rows read together, as rows of their own
            rows = x.shape[:axis] + (parts * together, outputs)
            partial = self.make(Op.RESHAPE, (partial,), {"shape": rows}, shaped_like(partial, rows))
        total_shape = partial.shape[:axis] + (1,) + partial.shape[axis + 1:]
        total = self._made(op, (partial,), {"axes": (axis,)}, shaped_like(x, total_shape))
        total = self.make(Op.RESHAPE, (total,), {"shape": original.shape}, shaped_like(total, original.shape))
        if wide is not original.dtype:
            total = self.make(Op.CAST, (total,), {"dtype": original.dtype}, original)
        return total

    def _padded_rows(self, op: Op, x: Node, axis: int, padded: int, flat: bool) -> Node:
        """x padded along `axis` to `padded` with op's identity; `flat`: as one flat axis (x has no kept axes
        before `axis`), so that rows read together stay one run of contiguous positions, not an unravelled one."""
        value = RULES[op].identity(x.dtype)
        if flat:
            length = math.prod(x.shape)
            line = self.make(Op.RESHAPE, (x,), {"shape": (length,)}, shaped_like(x, (length,)))
            extra = (padded - x.shape[axis]) * length // max(x.shape[axis], 1)
            shape = (length + extra,)
            line = self.make(Op.PAD, (line,), {"pads": ((0, extra),), "value": value}, shaped_like(x, shape))
            rows = x.shape[:axis] + (padded,) + x.shape[axis + 1:]
            return self.make(Op.RESHAPE, (line,), {"shape": rows}, shaped_like(x, rows))
        pads = tuple((0, padded - x.shape[axis]) if d == axis else (0, 0) for d in range(len(x.shape)))
        shape = tuple(padded if d == axis else s for d, s in enumerate(x.shape))
        return self.make(Op.PAD, (x,), {"pads": pads, "value": value}, shaped_like(x, shape))

    @staticmethod
    def _row_parts(n: int, outputs: int) -> int:
        """Into how many parts a reduction of rows (the reduced axis the last) is split: a row kernel gives each
        program one or a few rows, so few long rows fill few programs. 1: not split."""
        if outputs >= SPLIT_MIN_PROGRAMS or n < SPLIT_MIN_LENGTH:
            return 1
        # the partial results fill SPLIT_MIN_PROGRAMS programs (rows), so the partial stage is not split again: two
        # kernels, the second reducing at most SPLIT_MIN_PROGRAMS partials (or SPLIT_PARTS) per output
        wanted = max(SPLIT_PARTS, -(-SPLIT_MIN_PROGRAMS // outputs))
        return min(wanted, n // SPLIT_MIN_PART)

    def _fold_movement(self, op: Op, x: Node, attrs: dict, original: Node) -> Node | None:
        if op is Op.PERMUTE and x.op is Op.MATMUL and original.inputs and \
                id(original.inputs[0]) in self.transposed_products:
            a, b = (self.make(Op.PERMUTE, (i,), {"order": attrs["order"]}, shaped_like(i, _transposed(i.shape)))
                    for i in x.inputs)
            return self.make(Op.MATMUL, (b, a), {}, original)
        if x.shape == original.shape and op in (Op.RESHAPE, Op.EXPAND):
            return x
        if op is Op.PERMUTE and attrs["order"] == tuple(range(len(x.shape))):
            return x
        if op is Op.RESHAPE and x.op is Op.RESHAPE:
            return self.make(Op.RESHAPE, x.inputs, attrs, original)
        if op is Op.PERMUTE and x.op is Op.PERMUTE:
            inner = x.attrs["order"]
            order = tuple(inner[i] for i in attrs["order"])
            return self.make(Op.PERMUTE, x.inputs, {"order": order}, original)
        if op is Op.EXPAND and x.op is Op.EXPAND:
            return self.make(Op.EXPAND, x.inputs, attrs, original)
        return None


# a reduction of rows is split (a column reduction's split is the row pattern's rule, rows.column_parts)
SPLIT_PARTS = 64  # partial results per output of a split reduction
SPLIT_MIN_PROGRAMS = 1024  # split only reductions that would otherwise run on fewer programs
SPLIT_MIN_LENGTH = 1024  # and only reductions at least this long
SPLIT_MIN_PART = 64  # elements each partial result reduces, at least
SPLIT_MIN_ELEMENTS = 1 << 18  # any split reduction reads this many elements (below, the extra launch costs more)
HALF_FLOATS = (dtypes.float16, dtypes.bfloat16)
# scatter_add dtypes without atomic addition on the GPU, and the type they accumulate in
ATOMIC_WIDENING = {dtypes.bool_: dtypes.int32, dtypes.uint8: dtypes.int32, dtypes.int8: dtypes.int32,
                   dtypes.int16: dtypes.int32, dtypes.bfloat16: dtypes.float32}


def _transposed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:-2] + (shape[-1], shape[-2])


def _along(node: Node, axis: int) -> Node | None:
    """The keepdim-shaped node that `node` broadcasts along `axis`, if it is such a broadcast."""
    if node.op is Op.EXPAND and node.inputs[0].shape[axis] == 1 and node.shape[axis] != 1:
        return node.inputs[0]
    return None


def _is_position(node: Node, axis: int) -> bool:
    """Whether node's value is its own index along `axis`: an arange reshaped and broadcast into place."""
    if node.op is not Op.EXPAND:
        return False
    shaped = node.inputs[0]
    if [d for d, s in enumerate(shaped.shape) if s != 1] != [axis]:
        return False
    while shaped.op is Op.RESHAPE:
        shaped = shaped.inputs[0]
    return shaped.op is Op.IOTA


def _is_number(node: Node) -> bool:
    return node.op is Op.CONST and "arg" not in node.attrs


def _is_value(node: Node, value) -> bool:
    return _is_number(node) and node.attrs["value"] == value


def _lossless(src: dtypes.DType, mid: dtypes.DType) -> bool:
    """Whether every value of `src` survives a round trip through `mid`."""
    if src is mid:
        return True
    if mid.is_floating_point:
        if src.is_floating_point:
            return mid.itemsize > src.itemsize and not (src is dtypes.bfloat16 and mid is dtypes.float16)
        return (src.itemsize <= 2 and mid.itemsize >= 4) or (src.itemsize <= 4 and mid is dtypes.float64)
    if src.is_floating_point or mid is dtypes.bool_:
        return False
    if src is dtypes.bool_:
        return True
    if src.kind == mid.kind:
        return mid.itemsize >= src.itemsize
    return mid.kind == "int" and mid.itemsize > src.itemsize
