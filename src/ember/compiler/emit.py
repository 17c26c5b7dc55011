"""The shared emitter of the lowering: a kernel's statements built node by node at an index (`Emitter`), the
parameters and sizes of its functions (`Context`), and the passes over emitted statements every pattern uses
(hoisting loads, dropping unread values, the scope check of `unbound_reads`).

The lowering walks the graph from each output of a kernel and turns every node into a statement,
evaluated at an *index*: the position, within the node's own shape, that the element being computed
reads. Movement ops never produce a value of their own; they rewrite the index (a permute swaps
positions, an expand pins a dimension to 0, a slice scales and shifts, a pad adds a bound check, a
reshape goes through the linear position). Only stored nodes are loaded.

Sizes are kernel parameters, not literals, so a new batch size reuses the compiled kernel; float
constants that change between steps (a learning rate) and random seeds are parameters too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember import dtypes
from ember.compiler.context import CompileContext
from ember.compiler.fused import OTHER, ROW, FusedKernel, Level, input_level
from ember.compiler.kernel import (
    Assign,
    Bin,
    Block,
    Branch,
    Call,
    Effect,
    Expr,
    Function,
    Lit,
    Loop,
    Param,
    ParamKind,
    Prim,
    Var,
    add,
    call,
    literal_int,
    mul,
)
from ember.dtypes import DType, compute_dtype
from ember.errors import CompileError, index_out_of_bounds
from ember.ir import Kind, Node, Op
from ember.ir.ops import RULES

INT32_LIMIT = 2**31 - 1

ZERO, ONE = Lit(0), Lit(1)

# a GEMM tile's axes and their block sizes
GEMM_BLOCK = {axis: Block(name, axis) for axis, name in
              (("rm", "BLOCK_M"), ("rn", "BLOCK_N"), ("ka", "BLOCK_K"), ("kb", "BLOCK_K"))}


BLOCK = Block("BLOCK", "x")  # a pointwise kernel's tile
HEAVY_BLOCK = Block("BLOCK_HEAVY", "x")  # a segmented launch's tile for its heavy segments (fewer elements)

# How the lowering computes each primitive that is not pointwise (a pointwise one becomes a Prim, which each
# target renders by the primitive's own lowering, RULES[op].lowerings). tests/test_kernel_ir.py checks that
# every primitive is one or the other.
_MOVED = "folded into the index of its reader (Emitter.move)"

_REDUCED = "reduced in registers: a row kernel's loop, a GEMM epilogue's atomics or a mainloop's K-sum"

STRUCTURAL = {
    Op.BUFFER: "loaded from its buffer", Op.CONST: "a literal, or a scalar parameter",
    Op.IOTA: "the index itself", Op.RAND: "Philox at the element's linear position",
    Op.RESHAPE: "the linear position, or runs of dimensions regrouped", Op.PERMUTE: _MOVED, Op.EXPAND: _MOVED,
    Op.SLICE: _MOVED, Op.FLIP: _MOVED, Op.PAD: "a clamped load and a bound check choosing the fill value",
    Op.SUM: _REDUCED, Op.PROD: _REDUCED, Op.MAX: _REDUCED, Op.MIN: _REDUCED,
    Op.ARGMAX: "a (value, position) pair reduced together", Op.ARGMIN: "a (value, position) pair reduced together",
    Op.MATMUL: "a GEMM core (tiles, a K loop, dot), or the vendor's matmul",
    Op.CONV2D: "the vendor's convolution",
    Op.CONV2D_INPUT_GRAD: "the vendor's convolution backward to the input (cuDNN's backward-data)",
    Op.CONV2D_WEIGHT_GRAD: "the vendor's convolution backward to the weight (cuDNN's backward-filter)",
    Op.ATTENTION: "a fused attention kernel: key tiles streamed, an online softmax (compiler/patterns/attention.py)",
    Op.ATTENTION_GRAD: "the fused attention backward: the scores computed again per tile",
    Op.GATHER: "a load at a clamped, checked position (zero where the index is out of range)",
    Op.SCATTER_ADD: "an atomic add at a clamped position",
    Op.ARGSORT: "the vendor's sort (torch.sort)",
    Op.COLLECTIVE: "a collective of the process group, by torch.distributed (NCCL on cuda, gloo on cpu)",
    Op.CHECK_INDEX: "the index itself; where it is out of range, recorded in the plan's flags (record_index)",
    Op.COPY: "a transfer between devices, made by the runtime at a plan's edges",
}


def padded_width(width: int) -> int:
    """A width as an MLP kernel lays it along a tile: a power of two, at least 16."""
    return max(16, 1 << (width - 1).bit_length())


def merges_only(shape: tuple[int, ...], source: tuple[int, ...]) -> bool:
    """Whether a reshape from `source` to `shape` only splits dimensions of `source`: each of them is then a run of
    `shape`'s, and positions in `shape` map back by merging runs (no division)."""
    i = j = 0
    while i < len(shape) and j < len(source):
        left, right, i, j = shape[i], source[j], i + 1, j + 1
        while left != right:
            if left < right:
                left *= shape[i]
                i += 1
            else:
                return False  # a dimension of `shape` spans several of `source`'s
    return True


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def both(*conditions: Expr) -> Expr:
    out = conditions[0]
    for c in conditions[1:]:
        out = Bin("&", out, c)
    return out


@dataclass(frozen=True)
class Index:
    """Where an element sits in a node's shape: per-dimension positions and/or the linear position."""

    dims: tuple[Expr, ...] | None
    linear: Expr | None
    mask: Expr | None
    level: Level

    def key(self) -> tuple:
        return (self.dims, self.linear if self.dims is None else None, self.mask, self.level)


class Context:
    """State shared by all functions of one kernel: parameters and the size table."""

    def __init__(self, stored: set[int], settings: CompileContext):
        self.stored = stored
        self.settings = settings
        self.params: list[Param] = []
        self.names: dict[tuple, str] = {}
        self.decisions: dict[tuple, object] = {}  # choices made once per kernel (an unrolled axis)

    def param(self, kind: ParamKind, value, prefix: str, dtype: DType | None = None) -> Var:
        key = (kind, id(value) if isinstance(value, Node) else value)
        if key not in self.names:
            self.names[key] = f"{prefix}{sum(1 for p in self.params if p.kind == kind)}"
            self.params.append(Param(kind, value, self.names[key], dtype))
        return Var(self.names[key])

    def size(self, value: int) -> Expr:
        return ONE if value == 1 else self.param(ParamKind.SIZE, value, "n")

    def function(self, suffix: str, body: list, constexprs: dict[str, int], grid: int, num_warps: int) -> Function:
        order = list(ParamKind)
        self.params.sort(key=lambda p: order.index(p.kind))
        return Function(suffix, list(self.params), constexprs, body, grid, num_warps)


class Emitter:
    """Emits the statements of one kernel (or one segment of a segmented launch)."""

    def __init__(self, ctx: Context, kernel: FusedKernel, block: list, tag: str = ""):
        self.ctx = ctx
        self.kernel = kernel
        self.block = block
        self.tag = tag
        self.memo: dict[tuple, tuple[Expr, DType]] = {}
        self.unravelled: dict[tuple, tuple[Expr, ...]] = {}
        self.reduced: dict[int, Var] = {}
        self.loop: Loop | None = None  # the column loop being emitted
        self.hoisting = False
        self.hoisted: set[tuple] = set()  # memo keys of values computed before a loop
        self.count = 0
        self.definitions: dict[str, Expr] = {}  # each bound name's value
        self.accumulator: Var | None = None  # a GEMM epilogue's name for the core's value
        self.accumulators: dict[int, Var] = {}  # an MLP kernel's: id(core) -> its accumulator, once computed
        self.blocks: dict[str, Block] = GEMM_BLOCK  # the block laid along each tile axis of a GEMM's tiles
        self.tile_axes: frozenset[str] | None = None  # the axes of the tiles a GEMM or MLP kernel stores
        self.row_index: Index | None = None  # a row kernel's index of one value per row
        # A GEMM's tiles are 2-d: a mask split by axis lets a load that varies along one axis only (a
        # bias, a per-feature scale) load a row or a column instead of the whole tile.
        self.mask_parts: dict[Var, dict[str, Var]] = {}  # a 2-d mask -> {axis: that axis's own mask}
        # a pad's mask (the index's mask and its bound checks) -> (the index's mask, the positions it checks)
        self.padded: dict[Expr, tuple[Expr | None, tuple[Expr, ...]]] = {}
        self.big = max([n.numel for n in kernel.covers + kernel.reads + kernel.outputs] + [1]) > INT32_LIMIT

    # -- small helpers -------------------------------------------------------------------
    def emit(self, statement) -> None:
        if self.hoisting:  # a row-level value inside a column loop: compute it once, before the loop
            self.loop.prelude.append(statement)
        else:
            self.block.append(statement)

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.tag}_{self.count}"

    def bind(self, name: str, value: Expr) -> Var:
        var = Var(name, value.axes)
        self.definitions[name] = value
        self.emit(Assign((var,), value))
        return var

    def define(self, value: Expr, stem: str = "v") -> Var:
        return self.bind(self.fresh(stem), value)

    def load_mask(self, mask: Expr | None, offset: Expr) -> Expr | None:
        """The mask a load at `offset` needs: the parts of a split mask along the axes the offset varies."""
        parts = self.mask_parts.get(mask)
        if not parts:
            return mask
        used = [part for axis, part in parts.items() if axis in offset.axes]
        if len(used) == len(parts):
            return mask
        return both(*used) if used else None

    def unravel(self, linear: Expr, shape: tuple[int, ...]) -> tuple[Expr, ...]:
        key = (linear, shape)
        if key not in self.unravelled:
            # positions of a value the column loop does not change (a row's) are computed once, before the loop,
            # where every later loop over the row reads them too
            hoist = self.loop is not None and not self.hoisting and not (read_names(linear) & self._loop_names())
            self.hoisting = self.hoisting or hoist
            try:
                self.unravelled[key] = self._unravel(linear, shape)
            finally:
                self.hoisting = self.hoisting and not hoist
        return self.unravelled[key]

    def _loop_names(self) -> set[str]:
        """The names the column loop being emitted assigns (its variable included)."""
        return {self.loop.var.name, *(t.name for s in flat_statements(self.loop.body) if isinstance(s, Assign)
                                      for t in s.targets)}

    def _unravel(self, linear: Expr, shape: tuple[int, ...]) -> tuple[Expr, ...]:
        dims: list[Expr] = []
        rest = linear
        for d in range(len(shape) - 1, -1, -1):
            s = shape[d]
            if s == 1:
                dims.append(ZERO)
                continue
            if all(x == 1 for x in shape[:d]):
                dims.append(rest)
                break
            # a literal divisor: the division compiles to a multiply and shifts (a size 0, in a kernel
            # with nothing to compute, stays an argument: a literal would fold into a division by zero)
            size = Lit(s) if s else self.ctx.size(s)
            dims.append(self.define(Bin("%", rest, size), "i"))
            rest = self.define(Bin("//", rest, size), "q")
        dims += [ZERO] * (len(shape) - len(dims))
        return tuple(reversed(dims))

    def dims(self, idx: Index, shape: tuple[int, ...]) -> tuple[Expr, ...]:
        return idx.dims if idx.dims is not None else self.unravel(idx.linear, shape)

    def linear(self, idx: Index, shape: tuple[int, ...]) -> Expr:
        if idx.linear is not None:
            return idx.linear
        terms, stride = [], 1
        for d in range(len(shape) - 1, -1, -1):
            if shape[d] != 1 and idx.dims[d] != ZERO:
                terms.append(mul(idx.dims[d], self.ctx.size(stride)))
            stride *= shape[d]
        out = ZERO
        for term in reversed(terms):
            out = add(out, term)
        # a reshape that flattens and one that unflattens back (around a gather) then cost no divisions; the
        # positions are in range wherever the mask of the index holds (a gather clamps its index; beneath a pad,
        # only the pad's own mask keeps them in range: they are not clamped, see pad())
        self.unravelled.setdefault((out, shape), tuple(ZERO if s == 1 else d for d, s in zip(idx.dims, shape)))
        return out

    def reshape_dims(self, dims: tuple[Expr, ...], shape: tuple[int, ...],
                     source: tuple[int, ...]) -> tuple[Expr, ...]:
        """Per-dimension positions in `source` for positions `dims` in `shape`, group by group.

        A reshape splits or merges runs of dimensions; matching the runs by their products, a
        merge becomes multiply-adds and only a split needs a division (by a run's inner sizes).
        """
        out: list[Expr] = []
        i = j = 0
        while i < len(shape) or j < len(source):
            a, b = i + 1, j + 1
            left = shape[i] if i < len(shape) else 1
            right = source[j] if j < len(source) else 1
            while left != right:
                if left < right:
                    left *= shape[a]
                    a += 1
                else:
                    right *= source[b]
                    b += 1
            group_dims, group_shape = dims[i:a], shape[i:a]
            target = source[j:b]
            if len(target) == 1:
                out.append(self.linear(Index(group_dims, None, None, OTHER), group_shape))
            elif len(group_dims) == 1:
                out.extend(self.unravel(group_dims[0], target))
            else:
                out.extend(self.unravel(self.linear(Index(group_dims, None, None, OTHER), group_shape), target))
            i, j = a, b
        return tuple(out[:len(source)]) if len(out) >= len(source) else tuple(out) + (ZERO,) * (len(source) - len(out))

    # -- values ----------------------------------------------------------------------------
    def value(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        """node's value at idx (a Var or a Lit), and the dtype it is computed in."""
        key = (id(node), idx.key())
        if key in self.memo:
            return self.memo[key]
        if idx.level == ROW and self.loop is not None and not self.hoisting:
            # nothing below a row-level value depends on the column: hoist it out of the loop
            self.hoisting = True
            try:
                result = self._value(node, idx)
            finally:
                self.hoisting = False
            self.hoisted.add(key)
        else:
            result = self._value(node, idx)
        self.memo[key] = result
        return result

    def _value(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        kernel = self.kernel
        if node is kernel.core:  # the planner lets an epilogue read it only at the element computed
            if self.accumulator is None:
                raise CompileError(f"kernel {kernel.index}: the matmul's result is read before it is computed")
            return self.accumulator, dtypes.float32
        if id(node) in self.accumulators:  # a layer of an MLP kernel, read at the element computed
            return self.accumulators[id(node)], dtypes.float32
        if node in kernel.reductions:
            if id(node) not in self.reduced:
                raise CompileError(f"kernel {kernel.index}: reduction {node} is read before it is computed")
            return self.reduced[id(node)], compute_dtype(node.dtype)
        if node.op is Op.BUFFER or (id(node) in self.ctx.stored and node not in kernel.outputs
                                    and node not in kernel.recomputed):
            return self.load(node, idx)
        op, kind = node.op, node.op.kind
        if kind is Kind.LEAF:
            return self.leaf(node, idx)
        if op is Op.PAD:
            return self.pad(node, idx)
        if kind is Kind.MOVEMENT:
            return self.value(node.inputs[0], self.move(node, idx))
        if op is Op.GATHER:
            return self.gather(node, idx)
        if op is Op.CHECK_INDEX:
            return self.check_index(node, idx)
        if kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY):
            args = [self.value(i, Index(idx.dims, idx.linear, idx.mask,
                                        input_level(node, idx.level, kernel.space, kernel.axes, p)))
                    for p, i in enumerate(node.inputs)]
            return self.define(Prim(node.op, node, tuple(a for a, _ in args), args[0][1])), compute_dtype(node.dtype)
        raise CompileError(f"kernel {kernel.index}: {node.op.label} cannot be computed inside a fused kernel")

    def load(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        """A stored node's value, computed in float32 if it is a half type."""
        pointer = self.ctx.param(ParamKind.READ, node, "in")
        offset = self.linear(idx, node.shape)
        # an offset every lane shares is a scalar load, in bounds by construction
        needed = self.load_mask(idx.mask, offset)
        masked = {"mask": needed, "other": ZERO} if needed is not None and offset.is_tile else {}
        value: Expr = call("load", add(pointer, offset), **masked)
        out = compute_dtype(node.dtype)
        if out is not node.dtype:
            value = call("cast", value, dtype=out)
        return self.define(value), out

    def operand(self, node: Node, idx: Index, dtype: DType) -> tuple[Var, str]:
        """A GEMM operand tile in `dtype` and its layout. A view of a stored value is loaded as it is (so
        the tile goes to the tensor cores unconverted): layout "n" when the tile's column index runs
        along rows in memory, else "t". A prologue ("p") is computed, zeroed outside the mask and cast."""
        rows, cols = idx.dims[-2:]
        view = node
        while view.op.kind is Kind.MOVEMENT and view.op is not Op.PAD and id(view) not in self.ctx.stored:
            idx = self.move(view, idx)
            view = view.inputs[0]
        if view.op is Op.BUFFER or id(view) in self.ctx.stored:
            offset = self.linear(idx, view.shape)
            if offset.axes != rows.axes | cols.axes:  # a size-1 axis: a load still needs a tile of pointers
                tile = (self.blocks[next(iter(rows.axes))], self.blocks[next(iter(cols.axes))])
                offset = Bin("+", offset, call("zeros", shape=tile, dtype=dtypes.int32))
            masked = {"mask": idx.mask, "other": ZERO} if idx.mask is not None else {}  # None: a whole tile
            value = self.define(call("load", add(self.ctx.param(ParamKind.READ, view, "in"), offset), **masked))
            layout = "t" if idx.dims and idx.dims[-1] not in (cols, ZERO) else "n"
            return (value if view.dtype is dtype else self.define(call("cast", value, dtype=dtype), "x")), layout
        value, _ = self.value(view, idx)
        if idx.mask is not None:
            value = call("where", idx.mask, value, ZERO)
        return self.define(call("cast", value, dtype=dtype), "x"), "p"

    def leaf(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        if node.op is Op.CONST:
            out = compute_dtype(node.dtype)
            if "arg" in node.attrs:
                # typed, so a float64 constant stays float64 (a launch passes a plain Python float)
                scalar = self.ctx.param(ParamKind.SCALAR, node.attrs["arg"], "c", out)
                return self.define(call("full", scalar, shape=(), dtype=out)), out
            return Lit(node.attrs["value"], node.dtype), out
        if node.op is Op.IOTA:
            position = idx.linear if idx.dims is None else idx.dims[0]
            if literal_int(position) is not None:  # a fixed position: a typed scalar of it
                return self.define(call("full", position, shape=(), dtype=dtypes.int64)), dtypes.int64
            return self.define(call("cast", position, dtype=dtypes.int64)), dtypes.int64
        if node.op is Op.RAND:
            # (seed, offset) pairs are read from device memory, so a replayed CUDA graph draws fresh numbers
            k = node.attrs["seed_arg"]
            draws = self.ctx.param(ParamKind.DRAWS, "draws", "draws")
            seed = self.define(call("load", add(draws, Lit(2 * k))), "seed")
            start = self.define(call("load", add(draws, Lit(2 * k + 1))), "start")
            fn = "rand" if node.attrs["distribution"] == "uniform" else "randn"
            return self.define(call(fn, seed, add(start, self.linear(idx, node.shape)))), dtypes.float32
        raise CompileError(f"no code for leaf {node.op.label}")

    def move(self, node: Node, idx: Index) -> Index:
        """The index into node's input that node's index reads: the view rule of each movement op."""
        op, a = node.op, node.attrs
        source = node.inputs[0].shape
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        if op is Op.RESHAPE:
            loaded = node.inputs[0].op is Op.BUFFER or id(node.inputs[0]) in self.ctx.stored
            if idx.dims is None or 0 in source or (loaded and not merges_only(node.shape, source)):
                # the linear position is the same on both sides of a reshape (empty: no runs to match); a
                # reshaped buffer is loaded at it rather than at its positions regrouped (a division each). One
                # that only merges runs is loaded at its positions merged, the index every other reader of the
                # buffer through the same reshape computes, so they share one load.
                return Index(None, self.linear(idx, node.shape), idx.mask, level)
            return Index(self.reshape_dims(idx.dims, node.shape, source), None, idx.mask, level)
        dims = self.dims(idx, node.shape)
        if op is Op.PERMUTE:
            new: list[Expr] = [ZERO] * len(dims)
            for i, o in enumerate(a["order"]):
                new[o] = dims[i]
            return Index(tuple(new), None, idx.mask, level)
        if op is Op.EXPAND:
            if level == ROW:
                return self.row_index
            new = tuple(ZERO if s == 1 and n != 1 else d for d, s, n in zip(dims, source, node.shape))
            return Index(new, None, self.unpadded(idx.mask, [d for d, e in zip(dims, new) if e is ZERO]), level)
        if op is Op.SLICE:
            new = [add(Lit(start), mul(d, Lit(step))) for d, (start, _, step) in zip(dims, a["slices"])]
            return Index(tuple(new), None, idx.mask, level)
        if op is Op.FLIP:
            new = [Bin("-", Bin("-", self.ctx.size(source[i]), ONE), d) if i in a["axes"] else d
                   for i, d in enumerate(dims)]
            return Index(tuple(new), None, idx.mask, level)
        raise CompileError(f"no index rule for {op.label}")

    def unpadded(self, mask: Expr | None, broadcast: list[Expr]) -> Expr | None:
        """`mask` without the checks of the pads above it that test only positions a broadcast drops: the loads
        beneath read the same addresses at every such position (a batch norm's per-channel statistics under a
        max-pooling's nine padded windows), so they share one index, and the pad's where() still picks the fill."""
        while mask in self.padded:
            outer, checked = self.padded[mask]
            if not all(any(c is d for d in broadcast) for c in checked):
                break
            mask = outer
        return mask

    def clamp(self, position: Expr, size: int) -> Var:
        """A position forced into [0, size): the load stays in bounds and a where() picks the real value."""
        return self.define(call("minimum", call("maximum", position, ZERO), Bin("-", self.ctx.size(size), ONE)), "c")

    def in_range(self, position: Expr, size: int) -> Expr:
        return Bin("&", Bin(">=", position, ZERO), Bin("<", position, self.ctx.size(size)))

    def pad(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        dims = self.dims(idx, node.shape)
        source = node.inputs[0].shape
        fill = Lit(node.attrs["value"], node.dtype)
        if 0 in source:  # all padding, and no position to clamp a load to
            return fill, compute_dtype(node.dtype)
        inner, checks, checked = [], [], []
        for d, (lo, hi), s in zip(dims, node.attrs["pads"], source):
            if lo == 0 and hi == 0:
                inner.append(d)
                continue
            if literal_int(d) is not None:  # a fixed position: decide now whether it falls in the padding
                if not 0 <= literal_int(d) - lo < s:
                    return fill, compute_dtype(node.dtype)
                inner.append(Lit(literal_int(d) - lo))
                continue
            shifted = self.define(Bin("-", d, Lit(lo)), "p") if lo else d
            # a position that varies across the tile stays unclamped: every load beneath it is masked by the check
            # below, and a clamp would hide from Triton that it runs contiguously (loads of a concatenation's parts
            # would not coalesce); a scalar one is clamped, as a scalar load is unmasked
            inner.append(shifted if shifted.is_tile else self.clamp(shifted, s))
            checks.append(self.in_range(shifted, s))
            checked.append(inner[-1])
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        if not checks:
            return self.value(node.inputs[0], Index(tuple(inner), None, idx.mask, level))
        # the loads beneath skip the padding: a sparse view (a strided scatter's gradient) reads only its
        # real elements
        valid = self.define(both(*checks), "ok")
        inside = self.define(both(idx.mask, valid), "m") if idx.mask is not None else valid
        self.padded[inside] = (idx.mask, tuple(checked))
        value, dt = self.value(node.inputs[0], Index(tuple(inner), None, inside, level))
        return self.define(call("where", valid, value, fill)), dt

    def gather(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        source, index = node.inputs
        axis = node.attrs["axis"]
        if source.numel == 0:  # every index is out of range, and no position to clamp a load to
            return ZERO, compute_dtype(node.dtype)
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 1)
        picked, _ = self.value(index, Index(idx.dims, idx.linear, idx.mask, level))
        size = source.shape[axis]
        valid = self.define(self.in_range(picked, size), "ok")
        dims = list(self.dims(idx, node.shape))
        # clamped, so every position beneath is in range (other nodes may reuse them, see linear())
        dims[axis] = self.clamp(picked, size)
        source_level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        value, dt = self.value(source, Index(tuple(dims), None, idx.mask, source_level))
        return self.define(call("where", valid, value, ZERO)), dt

    def check_index(self, node: Node, idx: Index) -> tuple[Expr, DType]:
        """The index as it is; the lanes (within the mask) where it falls outside its dimension record it in
        the check's flag, which the runtime reads at the next host read. What reads the index clamps it."""
        a = node.attrs
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        value, dt = self.value(node.inputs[0], Index(idx.dims, idx.linear, idx.mask, level))
        if literal_int(value) is not None:  # a fixed index: decided now
            if not (-a["size"] if a["negative"] else 0) <= literal_int(value) < a["size"]:
                raise index_out_of_bounds(a["op_name"], literal_int(value), a["dim"], a["size"])
            return value, dt
        size = self.ctx.size(a["size"])
        below = Bin("<", Bin("+", value, size), ZERO) if a["negative"] else Bin("<", value, ZERO)
        outside = Bin("|", below, Bin(">=", value, size))
        bad = self.define(both(idx.mask, outside) if idx.mask is not None else outside, "bad")
        self.emit(Effect(call("record_index", self.ctx.param(ParamKind.FLAG, node, "flag"), value, bad)))
        return value, dt

    # -- stores ------------------------------------------------------------------------------
    def store(self, node: Node, idx: Index, tile: tuple[Block | int, ...]) -> None:
        value, dt = self.value(node, idx)
        pointer = self.ctx.param(ParamKind.WRITE, node, "out")
        if not value.is_tile:  # a literal or a scalar: give it the tile's shape
            value = Bin("+", value, call("zeros", shape=tile, dtype=dt))
        if dt is not node.dtype:
            value = call("cast", value, dtype=node.dtype)
        offset = self.linear(idx, node.shape)
        # a store needs a tile of addresses: an offset that is one scalar (every axis of size 1), or a GEMM's
        # that misses an axis of the tile, is broadcast to the tile
        if not offset.is_tile or (self.tile_axes is not None and not self.tile_axes <= offset.axes):
            offset = Bin("+", offset, call("zeros", shape=tile, dtype=dtypes.int32))
        masked = {"mask": idx.mask} if idx.mask is not None else {}
        self.emit(Effect(call("store", add(pointer, offset), value, **masked)))


def identity(op: Op, dtype: DType) -> Lit:
    """The value a reduction starts from (declared with the reduction, RULES[op].identity), as a literal of
    the kind of `dtype`: a bool accumulates as an integer."""
    value = RULES[op].identity(dtype)
    return Lit(float(value) if dtype.is_floating_point else int(value))


def unbound_reads(function: Function) -> set[str]:
    """The names `function` reads where they are not defined, by the scoping of a compiled kernel (Triton's): a
    name first assigned inside a loop's body is not defined after the loop; one assigned in one branch of an
    `if` only, not after it. The interpreter runs kernels as Python, where both are defined: this check is what
    tells it apart on a machine without a GPU."""
    unbound: set[str] = set()

    def walk(block: list, scope: set[str]) -> set[str]:
        for s in block:
            if isinstance(s, Loop):
                unbound.update(read_names(s.start) - scope, read_names(s.stop) - scope, read_names(s.step) - scope)
                walk(s.prelude, scope)
                walk(s.body, {*scope, s.var.name})
            elif isinstance(s, Branch):
                unbound.update(read_names(s.condition) - scope)
                scope |= walk(s.body, set(scope)) & walk(s.orelse, set(scope))
            else:
                unbound.update(read_names(s.value) - scope)
                if isinstance(s, Assign):
                    scope.update(t.name for t in s.targets)
        return scope

    walk(function.body, {p.name for p in function.params} | set(function.constexprs))
    return unbound


def program_index(emitter: Emitter, axis: int = 0, name: str = "pid") -> Var:
    return emitter.bind(name, call("program_id", axis=axis))


def flat_exprs(s) -> list[Expr]:
    """The expressions statement `s` evaluates, those of the statements inside it too."""
    return [e for t in flat_statements([s]) for e in ((t.value,) if isinstance(t, (Assign, Effect)) else
                                            (t.start, t.stop, t.step) if isinstance(t, Loop) else (t.condition,))]


def flat_statements(block: list) -> list:
    """The statements of `block`, those inside its loops and branches too."""
    out = []
    for s in block:
        out.append(s)
        if isinstance(s, Loop):
            out += flat_statements(s.prelude) + flat_statements(s.body)
        elif isinstance(s, Branch):
            out += flat_statements(s.body) + flat_statements(s.orelse)
    return out


def reads_memory(e: Expr) -> bool:
    """Whether `e` loads from memory (a load, or a value computed from one)."""
    return (isinstance(e, Call) and e.fn == "load") or any(reads_memory(c) for c in e.children())


def read_names(e: Expr) -> set[str]:
    """The names of the variables `e` reads."""
    if isinstance(e, Var):
        return {e.name}
    return set().union(*(read_names(c) for c in e.children()))


def widened(emitter: Emitter, x: Expr) -> Expr:
    return call("cast", x, dtype=dtypes.int64) if emitter.big else x


def scratch_buffer(ctx: Context, kernel: FusedKernel, key, elements: int) -> Var:
    """The float32 scratch buffer of a GEMM's partials: its tiles' ("partial") or an operand sum's (its key)."""
    what = ("partial" if key == "partial" else "sum", elements, key, id(kernel.core))
    return ctx.param(ParamKind.SCRATCH, what, "scratch")


UNKNOWN_MULTIPROCESSORS = 132  # the SMs a kernel plans for where the GPU's size is not known
