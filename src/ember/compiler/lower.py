"""Lowering: a FusedKernel becomes a KernelIR (compiler/kernel.py), for any target to render.

The lowering walks the graph from each output of a kernel and turns every node into a statement,
evaluated at an *index*: the position, within the node's own shape, that the element being computed
reads. Movement ops never produce a value of their own; they rewrite the index (a permute swaps
positions, an expand pins a dimension to 0, a slice scales and shifts, a pad adds a bound check, a
reshape goes through the linear position). Only stored nodes are loaded.

Sizes are kernel parameters, not literals, so a new batch size reuses the compiled kernel; float
constants that change between steps (a learning rate) and random seeds are parameters too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ember import dtypes
from ember.compiler.context import CompileContext
from ember.compiler.fusion import (
    FULL,
    OTHER,
    ROW,
    FusedKernel,
    KernelKind,
    input_level,
    mlp_blocks,
    mlp_widths,
    operand_sums,
    padded_width,
    summed_operand,
    summed_output,
    summed_views,
    written_intermediates,
)
from ember.compiler.kernel import (
    Assign,
    Bin,
    Block,
    Branch,
    Call,
    Effect,
    Expr,
    Function,
    KernelIR,
    Lit,
    Loop,
    Param,
    Prim,
    Range,
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

POINTWISE_BLOCK = 1024
ROW_TILE = 4096  # elements of a row kernel's tile; rows longer than this are reduced in a loop
LOOP_CHUNK = 1024  # columns per step of that loop
INT32_LIMIT = 2**31 - 1
ZERO, ONE = Lit(0), Lit(1)
# a GEMM tile's axes and their block sizes
GEMM_BLOCK = {axis: Block(name, axis) for axis, name in
              (("rm", "BLOCK_M"), ("rn", "BLOCK_N"), ("ka", "BLOCK_K"), ("kb", "BLOCK_K"))}
BLOCK_M, BLOCK_N = Block("BLOCK_M", "m"), Block("BLOCK_N", "n")  # a row kernel's tile
BLOCK = Block("BLOCK", "x")  # a pointwise kernel's tile

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
    Op.GATHER: "a load at a clamped, checked position (zero where the index is out of range)",
    Op.SCATTER_ADD: "an atomic add at a clamped position",
    Op.CHECK_INDEX: "the index itself; where it is out of range, recorded in the plan's flags (record_index)",
    Op.COPY: "a transfer between devices, made by the runtime at a plan's edges",
}


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
    level: str

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

    def param(self, kind: str, value, prefix: str, dtype: DType | None = None) -> Var:
        key = (kind, id(value) if isinstance(value, Node) else value)
        if key not in self.names:
            self.names[key] = f"{prefix}{sum(1 for p in self.params if p.kind == kind)}"
            self.params.append(Param(kind, value, self.names[key], dtype))
        return Var(self.names[key])

    def size(self, value: int) -> Expr:
        return ONE if value == 1 else self.param("size", value, "n")

    def function(self, suffix: str, body: list, constexprs: dict[str, int], grid: int, num_warps: int) -> Function:
        order = ("read", "write", "scratch", "flag", "draws", "size", "scalar", "bound")
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
            hoist = self.loop is not None and not self.hoisting and not (_names(linear) & self._loop_names())
            self.hoisting = self.hoisting or hoist
            try:
                self.unravelled[key] = self._unravel(linear, shape)
            finally:
                self.hoisting = self.hoisting and not hoist
        return self.unravelled[key]

    def _loop_names(self) -> set[str]:
        """The names the column loop being emitted assigns (its variable included)."""
        return {self.loop.var.name, *(t.name for s in _flat(self.loop.body) if isinstance(s, Assign)
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
        # positions are in range wherever the kernel's mask holds (a gather clamps its index)
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
        pointer = self.ctx.param("read", node, "in")
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
            value = self.define(call("load", add(self.ctx.param("read", view, "in"), offset), **masked))
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
                scalar = self.ctx.param("scalar", node.attrs["arg"], "c", out)
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
            draws = self.ctx.param("draws", "draws", "draws")
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
            if idx.dims is None or 0 in source or loaded:
                # the linear position is the same on both sides of a reshape (empty: no runs to match); a
                # reshaped buffer is loaded at it rather than at its positions regrouped (a division each)
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
            return Index(new, None, idx.mask, level)
        if op is Op.SLICE:
            new = [add(Lit(start), mul(d, Lit(step))) for d, (start, _, step) in zip(dims, a["slices"])]
            return Index(tuple(new), None, idx.mask, level)
        if op is Op.FLIP:
            new = [Bin("-", Bin("-", self.ctx.size(source[i]), ONE), d) if i in a["axes"] else d
                   for i, d in enumerate(dims)]
            return Index(tuple(new), None, idx.mask, level)
        raise CompileError(f"no index rule for {op.label}")

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
        inner, checks = [], []
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
            inner.append(self.clamp(shifted, s))
            checks.append(self.in_range(shifted, s))
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        if not checks:
            return self.value(node.inputs[0], Index(tuple(inner), None, idx.mask, level))
        # the loads beneath skip the padding: a sparse view (a strided scatter's gradient) reads only its
        # real elements
        valid = self.define(both(*checks), "ok")
        inside = self.define(both(idx.mask, valid), "m") if idx.mask is not None else valid
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
        self.emit(Effect(call("record_index", self.ctx.param("flag", node, "flag"), value, bad)))
        return value, dt

    # -- stores ------------------------------------------------------------------------------
    def store(self, node: Node, idx: Index, tile: tuple[Block | int, ...]) -> None:
        value, dt = self.value(node, idx)
        pointer = self.ctx.param("write", node, "out")
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


# -- whole kernels ---------------------------------------------------------------------------

def lower(kernel: FusedKernel, stored: set[int], context: CompileContext) -> KernelIR:
    """The kernel IR of a pointwise, reduce, segmented, scatter_add or GEMM kernel."""
    ctx = Context(stored, context)
    if kernel.kind is KernelKind.POINTWISE:
        functions = [_pointwise(ctx, kernel)]
    elif kernel.kind is KernelKind.SEGMENTED:
        functions = [_segmented(ctx, kernel)]
    elif kernel.kind is KernelKind.REDUCE:
        functions = [_rows(ctx, kernel)]
    elif kernel.kind is KernelKind.SCATTER_ADD:
        functions = _scatter_add(ctx, kernel)
    elif kernel.kind is KernelKind.MATMUL and kernel.core is not None:
        functions = _gemm(ctx, kernel)
    elif kernel.kind is KernelKind.MLP:
        functions = _mlp(ctx, kernel)
    else:
        raise CompileError(f"no generated code for {kernel.kind} kernels")
    for function in functions:
        unbound = unbound_reads(function)
        if unbound:
            raise CompileError(f"kernel {kernel.index} ({kernel.kind}): {', '.join(sorted(unbound))} read where not "
                               "defined (a value of a loop read after it)")
    return KernelIR(str(kernel.kind), _header(kernel), functions)


def unbound_reads(function: Function) -> set[str]:
    """The names `function` reads where they are not defined, by the scoping of a compiled kernel (Triton's): a
    name first assigned inside a loop's body is not defined after the loop; one assigned in one branch of an
    `if` only, not after it. The interpreter runs kernels as Python, where both are defined: this check is what
    tells it apart on a machine without a GPU."""
    unbound: set[str] = set()

    def walk(block: list, scope: set[str]) -> set[str]:
        for s in block:
            if isinstance(s, Loop):
                unbound.update(_names(s.start) - scope, _names(s.stop) - scope, _names(s.step) - scope)
                walk(s.prelude, scope)
                walk(s.body, {*scope, s.var.name})
            elif isinstance(s, Branch):
                unbound.update(_names(s.condition) - scope)
                scope |= walk(s.body, set(scope)) & walk(s.orelse, set(scope))
            else:
                unbound.update(_names(s.value) - scope)
                if isinstance(s, Assign):
                    scope.update(t.name for t in s.targets)
        return scope

    walk(function.body, {p.name for p in function.params} | set(function.constexprs))
    return unbound


def _header(kernel: FusedKernel) -> list[str]:
    numbering = {id(n): i for i, n in enumerate(kernel.reads + kernel.covers)}
    lines = [f"ember fused kernel: {kernel.kind} over {list(kernel.space)}"
             + (f" reducing axes {list(kernel.axes)}" if kernel.axes else "")]
    for n in kernel.reads:
        lines.append(f"  %{numbering[id(n)]} = load {list(n.shape)} {n.dtype.name}")
    for n in kernel.covers:
        args = ", ".join(f"%{numbering[id(i)]}" for i in n.inputs if id(i) in numbering)
        stored = "  -> stored" if n in kernel.outputs else ""
        lines.append(f"  %{numbering[id(n)]} = {n.op.label}({args}) {list(n.shape)} {n.dtype.name}{stored}")
    return lines


def _program(emitter: Emitter, axis: int = 0, name: str = "pid") -> Var:
    return emitter.bind(name, call("program_id", axis=axis))


def _pointwise_body(ctx: Context, kernel: FusedKernel, block: list, tag: str, first_block: Expr,
                    axis: int | None) -> None:
    emitter = Emitter(ctx, kernel, block, tag)
    start = call("cast", first_block, dtype=dtypes.int64) if emitter.big else first_block
    offs = emitter.bind(f"offs{tag}", Bin("+", Bin("*", start, BLOCK), Range(BLOCK)))
    mask = emitter.bind(f"mask{tag}", Bin("<", offs, ctx.size(_threads(kernel, axis))))
    if axis is None:
        for out in kernel.outputs:
            emitter.store(out, Index(None, offs, mask, FULL), (BLOCK,))
        return
    # each element of offs is a position along the other axes, computed for every position along `axis`: what
    # does not vary along it is memoized under the same index, so emitted once
    other = emitter.unravel(offs, kernel.space[:axis] + kernel.space[axis + 1:])
    for position in range(kernel.space[axis]):
        at = Index(other[:axis] + (Lit(position),) + other[axis:], None, mask, FULL)
        for out in kernel.outputs:
            emitter.store(out, at, (BLOCK,))


# A heavy pointwise kernel (more nodes than POINTWISE_HEAVY) may compute all positions along an axis this short
# in one thread (an image's channels): what does not vary along that axis (sample positions, the index
# arithmetic of gathers) is then computed once for all of them. It does so where that saves at least
# 1 - UNROLL_SHARE (a tenth) of the statements a thread would run for those positions one by one (loads and
# index arithmetic shared by the positions cost more than the statements repeated for each: NV12 to planar RGB
# saves 12% of its statements and a fifth of its time).
POINTWISE_UNROLL = 4
UNROLL_SHARE = 0.9


def unrolled_axis(ctx: Context, kernel: FusedKernel) -> int | None:
    """The axis of a pointwise kernel's space that each thread computes whole, or None: the last short axis
    but the innermost, where unrolling it pays (both forms are emitted and their statements counted)."""
    key = ("unrolled", id(kernel))
    if key in ctx.decisions:
        return ctx.decisions[key]
    # not the innermost axis: positions along it are neighbours in memory, which threads side by side store at once
    inner = max((d for d, s in enumerate(kernel.space) if s != 1), default=0)
    short = [d for d, s in enumerate(kernel.space) if 2 <= s <= POINTWISE_UNROLL and d < inner]
    axis = None
    if short and len(kernel.covers) > POINTWISE_HEAVY and all(o.shape == kernel.space for o in kernel.outputs):
        params, names = list(ctx.params), dict(ctx.names)  # the trial's parameters are not the kernel's
        plain: list = []
        unrolled: list = []
        _pointwise_body(ctx, kernel, plain, "", Var("pid"), None)
        _pointwise_body(ctx, kernel, unrolled, "", Var("pid"), short[-1])
        ctx.params[:], ctx.names = params, names
        if _statements(unrolled) <= UNROLL_SHARE * kernel.space[short[-1]] * _statements(plain):
            axis = short[-1]
    ctx.decisions[key] = axis
    return axis


def _statements(block: list) -> int:
    return sum(_statements(s.prelude) + _statements(s.body) if isinstance(s, Loop) else
               _statements(s.body) + _statements(s.orelse) if isinstance(s, Branch) else 1 for s in block)


def _threads(kernel: FusedKernel, axis: int | None) -> int:
    """The positions a pointwise kernel's programs cover: its elements, less an unrolled axis."""
    return math.prod(kernel.space) // (1 if axis is None else kernel.space[axis])


def _pointwise(ctx: Context, kernel: FusedKernel) -> Function:
    body: list = []
    pid = _program(Emitter(ctx, kernel, body))
    axis = unrolled_axis(ctx, kernel)
    _pointwise_body(ctx, kernel, body, "", pid, axis)
    numel = _threads(kernel, axis)
    block = pointwise_block(numel, len(kernel.covers), ctx.settings.multiprocessors)
    grid = -(-numel // block)
    if _latency_bound(ctx, grid):
        body[:] = hoist_loads(body)
    return ctx.function("", body, {"BLOCK": block}, grid, 4)


def _latency_bound(ctx: Context, programs: int) -> bool:
    """Whether a kernel's programs are too few to fill the GPU: no other programs' warps hide a load's
    latency, so each load paid in turn adds up (an optimizer's update of a few small tensors)."""
    return programs < (ctx.settings.multiprocessors or UNKNOWN_MULTIPROCESSORS)


def hoist_loads(block: list) -> list:
    """The statements of `block` with every load that follows its first store moved above it, where its
    address and mask are computed before: the loads are then in flight together. The target's compiler may
    not move a load above a store itself (it cannot tell the pointers apart), but in a kernel of one element
    per position no load reads what a store wrote: outputs are new values, and an input updated in place is
    read at the element its store writes, by the same thread, which a hoisted load reads first anyway."""
    first = next((i for i, s in enumerate(block) if isinstance(s, Effect)), None)
    # an index check's record writes only its flag, which no load reads
    if first is None or any(isinstance(s, Effect) and s.value.fn not in ("store", "record_index") for s in block) \
            or any(isinstance(s, (Loop, Branch)) for s in block):
        return block
    assigned = Counter(t.name for s in block[first:] if isinstance(s, Assign) for t in s.targets)
    later = set(assigned)
    moved, rest = [], []
    touched: set[str] = set()  # names the statements left in place read or assign, so far
    for s in block[first:]:
        targets = {t.name for t in s.targets} if isinstance(s, Assign) else set()
        if (isinstance(s, Assign) and _loads(s.value) and not _names(s.value) & later and not targets & touched
                and all(assigned[t] == 1 for t in targets)):
            moved.append(s)
            later -= targets  # what reads it may move up too
        else:
            rest.append(s)
            touched |= targets | _names(s.value)
    return block[:first] + moved + rest


def hoist_invariant_loads(loop: Loop, fits: Callable[[list[Assign]], bool]) -> None:
    """Move the loads in `loop`'s body that read the same elements on every iteration (a bias, a per-column
    scale: nothing they read is assigned in the loop) into its prelude. The target's compiler leaves them in
    place (it cannot tell them from the elements the loop stores), so every iteration would wait on each
    again; in an MLP kernel that is a load's latency per layer and row tile, on the chain's critical path.
    Such a load reads no element the loop writes: the loop's stores are at its tiles' rows, and an output
    written in place over an input is one read at the element each store writes, never a row-independent
    view of it. `fits`: whether the registers can hold the values that would move, all of them; else none
    move."""
    assigned = Counter(t.name for s in _flat(loop.body) if isinstance(s, Assign) for t in s.targets)
    variant = set(assigned) | {loop.var.name}
    moved, kept = [], []
    touched: set[str] = set()  # the names the statements left in the loop read or assign, so far
    for s in loop.body:
        targets = {t.name for t in s.targets} if isinstance(s, Assign) else set()
        if (isinstance(s, Assign) and _loads(s.value) and not _names(s.value) & variant
                and all(assigned[t] == 1 for t in targets) and not targets & touched):
            moved.append(s)
            variant -= targets  # what reads it alone may move too
        else:
            kept.append(s)
            touched |= targets | set().union(*map(_names, _flat_exprs(s)))
    if moved and fits(moved):
        loop.prelude += moved
        loop.body[:] = kept


def drop_unread(block: list) -> None:
    """Remove from `block` (and the loops and branches in it) every assignment of values nothing reads."""
    while True:
        read = set().union(*(_names(e) for s in block for e in _flat_exprs(s)))
        if not _prune(block, read):
            return


def _prune(block: list, read: set[str]) -> bool:
    kept = [s for s in block if not isinstance(s, Assign) or any(t.name in read for t in s.targets)]
    pruned = len(kept) < len(block)
    block[:] = kept
    for s in block:
        inner = (s.prelude, s.body) if isinstance(s, Loop) else (s.body, s.orelse) if isinstance(s, Branch) else ()
        pruned = any([_prune(b, read) for b in inner]) or pruned
    return pruned


def _flat_exprs(s) -> list[Expr]:
    """The expressions statement `s` evaluates, those of the statements inside it too."""
    return [e for t in _flat([s]) for e in ((t.value,) if isinstance(t, (Assign, Effect)) else
                                            (t.start, t.stop, t.step) if isinstance(t, Loop) else (t.condition,))]


def _flat(block: list) -> list:
    """The statements of `block`, those inside its loops and branches too."""
    out = []
    for s in block:
        out.append(s)
        if isinstance(s, Loop):
            out += _flat(s.prelude) + _flat(s.body)
        elif isinstance(s, Branch):
            out += _flat(s.body) + _flat(s.orelse)
    return out


def _loads(e: Expr) -> bool:
    """Whether `e` loads from memory (a load, or a value computed from one)."""
    return (isinstance(e, Call) and e.fn == "load") or any(_loads(c) for c in e.children())


def _names(e: Expr) -> set[str]:
    """The names of the variables `e` reads."""
    if isinstance(e, Var):
        return {e.name}
    return set().union(*(_names(c) for c in e.children()))


# A pointwise kernel computing more nodes than this per element (gathers and the index arithmetic that places
# them: image sampling) gives each program a quarter of POINTWISE_BLOCK: its many live values per element
# otherwise take so many registers that few programs fit on an SM
POINTWISE_HEAVY = 64
POINTWISE_PROGRAMS_PER_SM = 4  # a small kernel's programs shrink (to 128 elements, one per thread) to fill the GPU


def pointwise_block(numel: int, nodes: int, multiprocessors: int) -> int:
    """Elements per program of a pointwise kernel computing `nodes` nodes at each of `numel` elements."""
    block = POINTWISE_BLOCK if nodes <= POINTWISE_HEAVY else POINTWISE_BLOCK // 4
    while block > 128 and multiprocessors and -(-numel // block) < POINTWISE_PROGRAMS_PER_SM * multiprocessors:
        block //= 2
    return block


def _segmented(ctx: Context, kernel: FusedKernel) -> Function:
    """Many independent pointwise kernels in one launch: program ids are split into ranges."""
    body: list = []
    pid = _program(Emitter(ctx, kernel, body))
    total = 0
    branches = body
    axes = [unrolled_axis(ctx, part) for part in kernel.segments]
    block = pointwise_block(sum(_threads(part, a) for part, a in zip(kernel.segments, axes)),
                            max(len(part.covers) for part in kernel.segments), ctx.settings.multiprocessors)
    for k, part in enumerate(kernel.segments):
        blocks = -(-_threads(part, axes[k]) // block)
        begin = total
        total += blocks
        bound = ctx.param("bound", total, "end")
        branch = Branch(Bin("<", pid, bound),
                        comment=f"segment {k}: {', '.join(o.op.label for o in part.outputs)} over {list(part.space)}")
        branches.append(branch)
        branches = branch.orelse
        first = pid if begin == 0 else Bin("-", pid, ctx.param("bound", begin, "end"))
        _pointwise_body(ctx, part, branch.body, f"_{k}", first, axes[k])
        if _latency_bound(ctx, total):
            branch.body[:] = hoist_loads(branch.body)
    return ctx.function("", body, {"BLOCK": block}, total, 4)


def _rows(ctx: Context, kernel: FusedKernel) -> Function:
    return RowKernel(ctx, kernel).lower()


class RowKernel:
    """A row kernel: each program holds BLOCK_M rows; reductions over the row run in registers, in one
    tile when a row fits (persistent) or in a loop over chunks of BLOCK_N columns, one loop per phase."""

    def __init__(self, ctx: Context, kernel: FusedKernel):
        self.ctx, self.kernel = ctx, kernel
        space, axes = kernel.space, kernel.axes
        m, n = kernel.rows, kernel.cols
        self.kept = [i for i in range(len(space)) if i not in axes]
        self.trailing = tuple(axes) == tuple(range(len(space) - len(axes), len(space)))
        if self.trailing:  # rows are contiguous in memory: a program takes few, long rows
            block_n = min(next_pow2(n), ROW_TILE)
            if next_pow2(n) > ROW_TILE:  # a row that does not fit is walked in small chunks (registers)
                block_n = LOOP_CHUNK
            block_m = max(1, min(ROW_TILE // block_n, next_pow2(m), 64)) if block_n != LOOP_CHUNK else 1
        else:  # the kept axes are the contiguous ones: wide along them, so loads coalesce
            block_m = min(next_pow2(m), 128)
            block_n = max(1, min(next_pow2(n), ROW_TILE // block_m))
        self.block_m, self.block_n = block_m, block_n
        self.persistent = next_pow2(n) <= block_n
        self.body: list = []
        self.emitter = emitter = Emitter(ctx, kernel, self.body)
        pid = _program(emitter)
        first_row = call("cast", pid, dtype=dtypes.int64) if emitter.big else pid
        self.rows = emitter.bind("rows", Bin("+", Bin("*", first_row, BLOCK_M), Range(BLOCK_M, 0, 2)))
        self.rmask = emitter.bind("rmask", Bin("<", self.rows, ctx.size(m)))
        emitter.row_index = Index(None, self.rows, self.rmask, ROW)
        emitter.unravel(self.rows, tuple(space[i] for i in self.kept))  # before any loop: every phase uses it
        self.n_size = ctx.size(n)
        self.cols: Var | None = None  # the columns of the chunk being computed, and their mask
        self.mask: Var | None = None

    def lower(self) -> Function:
        if self.persistent:
            self.open_chunk(ZERO)
        for phase in self.phases():
            self.reduce(phase)
        levels = self.kernel.levels
        full_outputs = [o for o in self.kernel.outputs if levels[id(o)] == FULL]
        if full_outputs:
            self.open_loop()
            for o in full_outputs:
                self.emitter.store(o, self.full_index(), (BLOCK_M, BLOCK_N))
            self.close_loop()
        for o in self.kernel.outputs:
            if levels[id(o)] == ROW:
                self.emitter.store(o, self.emitter.row_index, (BLOCK_M, 1))
        grid = -(-self.kernel.rows // self.block_m)
        warps = 4 if self.block_m * self.block_n <= 2048 else 8
        return self.ctx.function("", self.body, {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}, grid, warps)

    def full_index(self) -> Index:
        """The index of the chunk's elements in the kernel's space."""
        space, emitter = self.kernel.space, self.emitter
        row_dims = emitter.unravel(self.rows, tuple(space[i] for i in self.kept))
        col_dims = emitter.unravel(self.cols, tuple(space[i] for i in self.kernel.axes))
        dims: list[Expr] = [ZERO] * len(space)
        for i, d in zip(self.kept, row_dims):
            dims[i] = d
        for i, d in zip(self.kernel.axes, col_dims):
            dims[i] = d
        linear = Bin("+", Bin("*", self.rows, self.n_size), self.cols) if self.trailing else None
        return Index(tuple(dims), linear, self.mask, FULL)

    def open_chunk(self, start: Expr) -> None:
        self.cols = self.emitter.bind("cols", add(start, Range(BLOCK_N, 1, 2)))
        self.mask = self.emitter.bind("mask", Bin("&", self.rmask, Bin("<", self.cols, self.n_size)))

    def open_loop(self) -> None:
        """A loop over the row's chunks (nothing when the row is one tile)."""
        if self.persistent:
            return
        loop = Loop(Var("start"), ZERO, self.n_size, BLOCK_N)
        self.emitter.emit(loop)
        self.emitter.loop, self.emitter.block = loop, loop.body
        self.open_chunk(loop.var)

    def close_loop(self) -> None:
        """Back at the program's level: values computed inside the loop are out of scope, except the
        reductions' results and the row-level values hoisted before it."""
        emitter = self.emitter
        emitter.block = self.body
        if self.persistent:
            return
        emitter.loop = None
        emitter.memo = {k: v for k, v in emitter.memo.items() if k[0] in emitter.reduced or k in emitter.hoisted}
        emitter.unravelled = {k: v for k, v in emitter.unravelled.items() if k[0] == self.rows}

    def phases(self) -> list[list[Node]]:
        """The reductions grouped into loops over the row: one that reads no result of the reductions
        before it in the current loop joins that loop, so independent sums (batch norm's backward)
        share one pass over their inputs; one that reads such a result starts the next loop."""
        inside = {id(n) for n in self.kernel.covers}
        reducing = {id(r) for r in self.kernel.reductions}

        def reduced_below(node: Node) -> frozenset[int]:
            """The kernel's reductions that `node`'s value reads, directly or through nodes inside."""
            stack, found, seen = [node], set(), set()
            while stack:
                n = stack.pop()
                for x in n.inputs:
                    if id(x) in seen or id(x) not in inside:
                        continue
                    seen.add(id(x))
                    if id(x) in reducing:
                        found.add(id(x))
                    else:
                        stack.append(x)
            return frozenset(found)

        phases: list[list[Node]] = []
        current: set[int] = set()
        for r in self.kernel.reductions:
            if phases and not (reduced_below(r) & current):
                phases[-1].append(r)
            else:
                phases.append([r])
                current = set()
            current.add(id(r))
        return phases

    def reduce(self, phase: list[Node]) -> None:
        """One loop over the row that accumulates every reduction of `phase`."""
        emitter = self.emitter
        accs = []
        for r in phase:
            arg_reduction = r.op in (Op.ARGMAX, Op.ARGMIN)
            dt = compute_dtype(r.inputs[0].dtype if arg_reduction else r.dtype)
            acc_dt = dtypes.int32 if dt is dtypes.bool_ else dt
            acc = Var(emitter.fresh("acc"), frozenset({"m"}))
            arg = Var(emitter.fresh("arg"), frozenset({"m"})) if arg_reduction else None
            start_value = identity(r.op, dt)
            emitter.emit(Assign((acc,), call("full", start_value, shape=(BLOCK_M, 1), dtype=acc_dt)))
            if arg:
                emitter.emit(Assign((arg,), call("zeros", shape=(BLOCK_M, 1), dtype=dtypes.int64)))
            accs.append((r, dt, acc_dt, start_value, acc, arg))
        self.open_loop()
        for r, _, acc_dt, start_value, acc, arg in accs:
            self.accumulate(r, start_value, acc_dt, acc, arg)
        emitter.block = self.body
        for r, dt, acc_dt, _, acc, arg in accs:
            result = arg if arg else acc
            if acc_dt is not dt and not arg:  # a bool max or min, accumulated in int32
                result = emitter.define(Bin("!=", acc, ZERO))
            emitter.reduced[id(r)] = result
        self.close_loop()

    def accumulate(self, r: Node, start_value, acc_dt, acc: Var, arg: Var | None) -> None:
        """Fold the chunk's values of `r`'s input into its accumulator (and, for an arg reduction, the
        column of the best)."""
        emitter = self.emitter
        value, _ = emitter.value(r.inputs[0], self.full_index())
        tile = emitter.define(call("where", self.mask,
                                   Bin("+", value, call("zeros", shape=(BLOCK_M, BLOCK_N), dtype=acc_dt)),
                                   start_value), "t")
        combine = r.op.label
        if r.op is Op.SUM:
            emitter.emit(Assign((acc,), Bin("+", acc, call("reduce", tile, combine="sum", axis=1, drop="n"))))
        elif r.op is Op.PROD:
            emitter.emit(Assign((acc,), Bin("*", acc, call("reduce", tile, combine="prod", axis=1, drop="n"))))
        elif r.op in (Op.MAX, Op.MIN):
            part = call("reduce", tile, combine=combine, axis=1, drop="n", nan="propagate")
            emitter.emit(Assign((acc,), call("combine", acc, part, combine=combine)))
        else:  # the chunk's best (value, column), then the best of it and the rows' best so far
            columns = emitter.define(Bin("+", self.cols, call("zeros", shape=(BLOCK_M, BLOCK_N),
                                                              dtype=dtypes.int32)), "j")
            best, where = Var(emitter.fresh("b"), acc.varies), Var(emitter.fresh("w"), acc.varies)
            emitter.emit(Assign((best, where), call("reduce2", tile, columns, combine=combine, axis=1, drop="n")))
            emitter.emit(Assign((acc, arg), call("combine", acc, arg, best, call("cast", where, dtype=dtypes.int64),
                                                 combine=combine)))


def _scatter_add(ctx: Context, kernel: FusedKernel) -> list[Function]:
    """Copy the base into the output, then add each source element at its index atomically."""
    node = kernel.outputs[0]
    base, index, src = node.inputs
    axis = node.attrs["axis"]
    init = FusedKernel(KernelKind.POINTWISE, node.shape, (), [node], {id(node): FULL}, covers=kernel.covers,
                       reads=kernel.reads)
    # the first launch writes the base (its cone inlined) into the output
    init_ctx = Context(ctx.stored, ctx.settings)
    copy_body: list = []
    emitter = Emitter(init_ctx, init, copy_body)
    pid = _program(emitter)
    offs = emitter.bind("offs", Bin("+", Bin("*", pid, BLOCK), Range(BLOCK)))
    mask = emitter.bind("mask", Bin("<", offs, init_ctx.size(node.numel)))
    value, dt = emitter.value(base, Index(None, offs, mask, OTHER))
    pointer = init_ctx.param("write", node, "out")
    copied = call("cast", Bin("+", value, call("zeros", shape=(BLOCK,), dtype=dt)), dtype=node.dtype)
    emitter.emit(Effect(call("store", Bin("+", pointer, offs), copied, mask=mask)))
    first = init_ctx.function("_init", copy_body, {"BLOCK": POINTWISE_BLOCK}, -(-node.numel // POINTWISE_BLOCK), 4)
    body: list = []
    emitter = Emitter(ctx, init, body)
    pid = _program(emitter)
    offs = emitter.bind("offs", Bin("+", Bin("*", pid, BLOCK), Range(BLOCK)))
    mask = emitter.bind("mask", Bin("<", offs, ctx.size(index.numel)))
    at = Index(None, offs, mask, OTHER)
    picked, _ = emitter.value(index, at)
    addend, _ = emitter.value(src, at)
    dims = list(emitter.dims(at, index.shape))
    valid = emitter.bind("valid", emitter.in_range(picked, node.shape[axis]))
    dims[axis] = emitter.clamp(picked, node.shape[axis])
    target = emitter.linear(Index(tuple(dims), None, mask, OTHER), node.shape)
    pointer = ctx.param("write", node, "out")
    # an index out of range adds nothing (at a clamped address, so the access stays in bounds)
    added = call("cast", call("where", valid, addend, ZERO), dtype=node.dtype)
    emitter.emit(Effect(call("atomic", add(pointer, target), added, mask=mask, combine="sum")))
    second = ctx.function("_scatter", body, {"BLOCK": POINTWISE_BLOCK}, -(-index.numel // POINTWISE_BLOCK), 4)
    return [first, second]


def _gemm(ctx: Context, kernel: FusedKernel) -> list[Function]:
    """A tiled GEMM over the core's output: each program computes a BLOCK_M x BLOCK_N tile, walking K
    in BLOCK_K steps; operand tiles come through the mainloop (prologue), the accumulator through
    the epilogue. Tiles are visited in groups of GROUP_M rows, so neighbouring programs share the
    operand tiles they load while those are still in L2.

    A GEMM whose K splits (see gemm_splits) is two functions: the first's programs each walk a share of
    K and store their partial tile (and partial operand sums) in float32 scratch; the second adds each
    tile's partials and runs the epilogue."""
    core = kernel.core
    a, b = core.inputs
    *batch, m, n = core.shape
    k = a.shape[-1]
    body: list = []
    mainloop = Emitter(ctx, kernel, body)
    M, N, K = ctx.size(m), ctx.size(n), ctx.size(k)
    block_k = GEMM_BLOCK["ka"]
    tile = _gemm_tile(mainloop, M, N, Block("GROUP_M", ""))
    rm, rn, mask_m, mask_n = tile.rm, tile.rn, tile.mask_m, tile.mask_n
    batch_dims: tuple[Expr, ...] = ()
    if batch:
        batch_dims = mainloop.unravel(mainloop.bind("batch", _wide(mainloop, call("program_id", axis=1))),
                                      tuple(batch))
    acc = mainloop.bind("acc", call("zeros", shape=GEMM_TILE, dtype=dtypes.float32))
    summed = {id(r): summed_operand(core, r) for r in operand_sums(kernel)}  # operands summed along K on the way
    sums = {key: mainloop.define(call("zeros", shape=_sum_shape(position), dtype=dtypes.float32), "sum")
            for key, position in summed.items()}
    splits = 1 if batch or not ctx.settings.split_k else gemm_splits(m, n, k, ctx.settings.multiprocessors)
    k_begin, k_end = ZERO, K
    if splits > 1:  # this program walks its share of K: whole BLOCK_K steps, the last share shorter
        steps = mainloop.bind("k_steps", call("cdiv", call("cdiv", K, block_k), Lit(splits)))
        k_begin = mainloop.bind("k_begin", Bin("*", Bin("*", call("program_id", axis=1), steps), block_k))
        k_end = mainloop.bind("k_end", call("minimum", Bin("+", k_begin, Bin("*", steps, block_k)), K))
    before_loop = dict(mainloop.unravelled)  # names defined inside the loop are out of scope after it
    loop = Loop(Var("start"), k_begin, k_end, block_k)
    mainloop.emit(loop)
    mainloop.block = loop.body
    start = _wide(mainloop, loop.var)  # K times a row's stride may pass int32 in a big kernel
    ka = mainloop.bind("ka", Bin("+", start, Range(GEMM_BLOCK["ka"], 1, 2)))
    kb = mainloop.bind("kb", Bin("+", start, Range(GEMM_BLOCK["kb"], 0, 2)))
    mask_ka = mainloop.bind("mask_ka", Bin("<", ka, k_end))
    mask_kb = mainloop.bind("mask_kb", Bin("<", kb, k_end))
    mask_a = mainloop.bind("mask_a", Bin("&", mask_m, mask_ka))
    mask_b = mainloop.bind("mask_b", Bin("&", mask_kb, mask_n))
    mask = Var("mask", frozenset({"rm", "rn"}))
    masks = {mask_a: {"rm": mask_m, "ka": mask_ka}, mask_b: {"kb": mask_kb, "rn": mask_n},
             mask: {"rm": mask_m, "rn": mask_n}}
    mainloop.mask_parts = masks
    tile_a, layout_a = mainloop.operand(a, Index((*batch_dims, rm, ka), None, mask_a, OTHER), core.dtype)
    tile_b, layout_b = mainloop.operand(b, Index((*batch_dims, kb, rn), None, mask_b, OTHER), core.dtype)
    dot = ctx.settings.dot_precision(core.dtype)
    precision = {"precision": dot} if core.dtype is dtypes.float32 else {}
    mainloop.emit(Assign((acc,), call("dot", tile_a, tile_b, acc, **precision)))
    for key, position in summed.items():
        axis, operand, drop = (1, tile_a, "ka") if position == 0 else (0, tile_b, "kb")
        part = call("reduce", call("cast", operand, dtype=dtypes.float32), combine="sum", axis=axis, drop=drop)
        mainloop.emit(Assign((sums[key],), Bin("+", sums[key], part)))
    if splits > 1:
        partials = _store_partials(ctx, Emitter(ctx, kernel, body), splits, acc, tile, summed, sums)
        first = ctx.function("_partials", body, {"BLOCK_M": 0, "BLOCK_N": 0, "BLOCK_K": 0, "GROUP_M": 0}, 0, 4)
        first.gemm, first.splits = (1, m, n, k), splits
        first.layout, first.precision = layout_a + layout_b, dot
        return [first, _finishing(ctx, [kernel], splits, [partials], "")]
    _epilogue(ctx, kernel, Emitter(ctx, kernel, body), tile, acc, sums, batch_dims, before_loop, mainloop.count)
    function = ctx.function("", body, {"BLOCK_M": 0, "BLOCK_N": 0, "BLOCK_K": 0, "GROUP_M": 0}, 0, 4)
    function.gemm = (math.prod(batch), m, n, k)
    function.layout = layout_a + layout_b
    function.precision = dot
    return [function]


def _epilogue(ctx: Context, kernel: FusedKernel, epilogue: Emitter, tile: _Tile, acc: Var, sums: dict[int, Var],
              batch_dims: tuple[Expr, ...] = (), unravelled: dict | None = None, count: int = 0) -> None:
    """A GEMM kernel's epilogue over its output tile, the core's value in `acc` and its operand sums in `sums`:
    the sums' outputs, the outputs (stored from registers) and the epilogue's reductions across tiles."""
    core = kernel.core
    summed = {id(r): summed_operand(core, r) for r in operand_sums(kernel)}
    rm, rn, mask_m, mask_n = tile.rm, tile.rn, tile.mask_m, tile.mask_n
    mask = Var("mask", frozenset({"rm", "rn"}))
    epilogue.count = count
    epilogue.unravelled = dict(unravelled or {})  # names defined inside a mainloop are out of scope after it
    epilogue.accumulator = acc
    epilogue.mask_parts = {mask: {"rm": mask_m, "rn": mask_n}}
    epilogue.tile_axes = frozenset({"rm", "rn"})
    for o in kernel.outputs:  # one row of programs stores what every row of them summed
        r = summed_output(kernel, o)
        if r is None or id(r) not in summed:
            continue
        position, keep = tile.keeps(summed[id(r)])
        pointer = ctx.param("write", o, "out")  # a reshape of the sum: the same positions
        epilogue.emit(Effect(call("store", Bin("+", pointer, position), call("cast", sums[id(r)], dtype=o.dtype),
                                  mask=keep)))
    epilogue.bind("mask", Bin("&", mask_m, mask_n))
    for o in kernel.outputs:
        if summed_output(kernel, o) is None:
            epilogue.store(o, _epilogue_index(epilogue, core, o.shape, batch_dims, rm, rn, mask),
                           GEMM_TILE)
    at = Index((*batch_dims, rm, rn), None, mask, FULL)
    _epilogue_reductions(ctx, kernel, epilogue, at, [r for r in kernel.reductions if id(r) not in summed],
                         {1: (rm, mask_m), 0: (rn, mask_n)})


# a finishing function's rows narrow (down to 16 columns) until its programs fill this many per SM (H100: a 64 x 64
# gradient's 264 partials took 14 us as 64 programs of 64 columns)
FINISHING_PROGRAMS_PER_SM = 2


def _finishing(ctx: Context, kernels: list[FusedKernel], splits: int, partials: list[dict], suffix: str,
               sums: list[tuple[_Sum, Var]] = ()) -> Function:
    """The function finishing GEMMs whose K was summed in `splits` parts (partial tiles and operand sums in the
    scratch buffers `partials`, one dict per GEMM): one program per row and up to 64 columns adds them, then
    runs the epilogue, so the partials' loads spread over many programs (narrower rows where few would run).
    Several GEMMs (an MLP kernel's gradients) share one launch, each its own range of programs; so do an MLP
    kernel's sums over its rows (`sums`, each with its partials), one program each, after them."""
    block_n = 64
    for kernel in kernels:
        m, n = kernel.core.shape
        width = min(max(next_pow2(n), 16), 64)
        while width > 16 and m * -(-n // width) < FINISHING_PROGRAMS_PER_SM * ctx.settings.multiprocessors:
            width //= 2
        block_n = min(block_n, width)
    body: list = []
    parts = [(kernel, scratch) for kernel, scratch in zip(kernels, partials)] + list(sums)
    first_kernel = kernels[0] if kernels else sums[0][0].kernel
    program = _program(Emitter(ctx, first_kernel, body), name="program") if len(parts) > 1 else None
    branches, total = body, 0
    blocks = {"BLOCK_M": 1, "BLOCK_N": block_n, "SPLIT_BLOCK": min(next_pow2(splits), 8192 // block_n)}
    for j, (part, scratch) in enumerate(parts):
        is_sum = isinstance(part, _Sum)
        if is_sum:
            shape, count = [part.kernel.reductions[0].numel], 1
        else:
            m, n = part.core.shape
            shape, count = [m, n], m * -(-n // block_n)
        begin, total = total, total + count
        block = branches  # the last part's programs: the last else
        if program is not None and j < len(parts) - 1:
            what = "sum" if is_sum else "GEMM"
            branch = Branch(Bin("<", program, Lit(total)), comment=f"{what} {j}: {shape}")
            branches.append(branch)
            block, branches = branch.body, branch.orelse
        first = Bin("-", program, Lit(begin)) if begin else program  # None: one GEMM, its program id
        tag = f"_{j}" if program is not None else ""
        if is_sum:  # its own blocks: a wide sum's partials load SUM_SPLIT rows at a time, 8192 elements at most
            width = padded_width(part.value.shape[1])
            blocks[f"SUM_BLOCK{tag}"] = width
            blocks[f"SUM_SPLIT{tag}"] = min(next_pow2(splits), 8192 // width)
            _finish_sum(ctx, part, splits, scratch, block, tag)
        else:
            _finish_tiles(ctx, part, splits, scratch, block, first, tag)
    return ctx.function(suffix, body, blocks, total, 4)


def _finish_sum(ctx: Context, total: _Sum, splits: int, scratch: Var, body: list, tag: str) -> None:
    """One program adds a sum's partials (`splits` rows of its value's columns, SUM_SPLIT rows at a time),
    sums the columns too for a sum of every element, and runs the row kernel's epilogue at its one output row
    (or its row of columns)."""
    f = total.kernel
    (r,) = f.reductions
    width = total.value.shape[1]
    em = Emitter(ctx, f, body, tag)
    em.big = False
    block = Block(f"SUM_BLOCK{tag}", "sc")
    column = em.bind(f"column{tag}", Range(block, 1, 2))
    mask_c = em.bind(f"mask_column{tag}", Bin("<", column, Lit(width)))
    acc = em.bind(f"acc{tag}", call("zeros", shape=(1, block), dtype=dtypes.float32))
    split, mask_split = _over_splits(em, splits, Block(f"SUM_SPLIT{tag}", "s"))
    part = call("load", Bin("+", scratch, Bin("+", Bin("*", split, Lit(width)), column)),
                mask=Bin("&", mask_split, mask_c), other=Lit(0.0))
    em.emit(Assign((acc,), Bin("+", acc, call("reduce", part, combine="sum", axis=0, drop="s"))))
    em.block = body
    if total.per_column:
        em.reduced[id(r)] = acc
        at = Index(None, column, mask_c, ROW)
        tile = (1, block)
    else:
        em.reduced[id(r)] = em.define(call("reduce", acc, combine="sum", axis=1, drop="sc"), "total")
        at = Index(None, ZERO, None, ROW)
        tile = (1, 1)
    em.row_index = at
    for o in f.outputs:
        em.store(o, at, tile)


def _finish_tiles(ctx: Context, kernel: FusedKernel, splits: int, partials: dict, body: list, first: Expr | None,
                  tag: str) -> None:
    """One GEMM's finishing programs: program `first` (or the program id) adds its row's partials and runs the
    epilogue. Its indices stay 32-bit: the partials and the outputs are the GEMM's [M, N], never big."""
    core = kernel.core
    m, n = core.shape
    em = Emitter(ctx, kernel, body, tag)
    em.big = False
    tile = _gemm_tile(em, ctx.size(m), ctx.size(n), None, first)
    acc = Var("acc", frozenset({"rm", "rn"}))
    summed = {id(r): summed_operand(core, r) for r in operand_sums(kernel)}
    sums = {key: Var(f"sum{tag}{i}", frozenset({"rm" if position == 0 else "rn"}))
            for i, (key, position) in enumerate(summed.items())}
    _add_partials(em, splits, acc, tile, summed, sums, partials)
    epilogue = Emitter(ctx, kernel, body, tag)
    epilogue.big = False
    _epilogue(ctx, kernel, epilogue, tile, acc, sums)


def _wide(emitter: Emitter, x: Expr) -> Expr:
    return call("cast", x, dtype=dtypes.int64) if emitter.big else x


@dataclass(frozen=True)
class _Tile:
    """A GEMM program's output tile of the M x N output: its rows rm and columns rn, and their masks."""

    pid_m: Var
    pid_n: Var
    rm: Var
    rn: Var
    mask_m: Var
    mask_n: Var
    M: Expr
    N: Expr

    def keeps(self, position: int) -> tuple[Var, Expr]:
        """Where a sum along K of operand `position` (0: per row, 1: per column) is kept, and the mask of the
        programs that store it: one column of tiles stores the row sums, one row of tiles the column sums."""
        if position == 0:
            return self.rm, Bin("&", Bin("<", self.rm, self.M), Bin("==", self.pid_n, ZERO))
        return self.rn, Bin("&", Bin("<", self.rn, self.N), Bin("==", self.pid_m, ZERO))


def _gemm_tile(emitter: Emitter, M: Expr, N: Expr, group: Expr | None, program: Expr | None = None) -> _Tile:
    """The program's output tile, tiles visited in groups of `group` rows (or row by row); `program`: the
    program's index among the GEMM's (default: its id)."""
    bind = emitter.bind
    pid = _program(emitter) if program is None else bind("pid", program)
    tiles_n = bind("tiles_n", call("cdiv", N, GEMM_BLOCK["rn"]))
    if group is None:
        pid_m, pid_n = bind("pid_m", Bin("//", pid, tiles_n)), bind("pid_n", Bin("%", pid, tiles_n))
    else:
        tiles_m = bind("tiles_m", call("cdiv", M, GEMM_BLOCK["rm"]))
        group_size = bind("group_size", Bin("*", group, tiles_n))
        first_m = bind("first_m", Bin("*", Bin("//", pid, group_size), group))
        group_rows = bind("group_rows", call("minimum", Bin("-", tiles_m, first_m), group))
        pid_m = bind("pid_m", Bin("+", first_m, Bin("%", Bin("%", pid, group_size), group_rows)))
        pid_n = bind("pid_n", Bin("//", Bin("%", pid, group_size), group_rows))
    rm = bind("rm", Bin("+", Bin("*", _wide(emitter, pid_m), GEMM_BLOCK["rm"]), Range(GEMM_BLOCK["rm"], 0, 2)))
    rn = bind("rn", Bin("+", Bin("*", _wide(emitter, pid_n), GEMM_BLOCK["rn"]), Range(GEMM_BLOCK["rn"], 1, 2)))
    return _Tile(pid_m, pid_n, rm, rn, bind("mask_m", Bin("<", rm, M)), bind("mask_n", Bin("<", rn, N)), M, N)


def _sum_shape(position: int) -> tuple:
    return (GEMM_BLOCK["rm"], 1) if position == 0 else (1, GEMM_BLOCK["rn"])


# A GEMM with fewer output tiles than SMs and a long K (a weight gradient: K is the batch) splits its K loop
# over up to SPLIT_PROGRAMS_PER_SM programs per SM, each walking SPLIT_DEPTH of K, or, where K is too short for
# SPLIT_MIN such shares, SPLIT_MIN shares of at least SPLIT_MIN_DEPTH (H100, a 5-layer MLP's training step at
# 2^18 rows: 4 per SM and shares of 1024, against 2 and 512, take the step's GPU time from 0.255 / 0.399 / 0.966 ms
# to 0.242 / 0.391 / 0.802 ms at widths 32 / 64 / 128; shares of 2048, or 8 per SM, do worse)
SPLIT_PROGRAMS_PER_SM = 4
SPLIT_DEPTH = 1024
SPLIT_MIN_DEPTH = 512
SPLIT_MIN = 4  # fewer splits than this are not worth the combining
SPLIT_TILE = 64  # the tile edge the decision assumes (the smallest tuned candidates')
SPLIT_BLOCK = Block("SPLIT_BLOCK", "s")  # the splits of a tile whose partials the finishing function loads at once


def gemm_splits(m: int, n: int, k: int, multiprocessors: int) -> int:
    """Into how many programs a 2-d GEMM splits each output tile's K loop: 1 (no split) unless its tiles leave
    most of the GPU idle and K is long enough to share."""
    tiles = -(-m // SPLIT_TILE) * -(-n // SPLIT_TILE)
    if not tiles or not multiprocessors or tiles >= multiprocessors:
        return 1
    shares = k // SPLIT_DEPTH if k >= SPLIT_MIN * SPLIT_DEPTH else min(SPLIT_MIN, k // SPLIT_MIN_DEPTH)
    splits = min(SPLIT_PROGRAMS_PER_SM * multiprocessors // tiles, shares)
    return splits if splits >= SPLIT_MIN else 1


def _store_partials(ctx: Context, emitter: Emitter, splits: int, acc: Var, tile: _Tile, summed: dict[int, int],
                    sums: dict[int, Var]) -> dict:
    """A split program stores its partial tile, and its partial operand sums, in float32 scratch at its
    split's place: [splits, M, N] and [splits, M or N]. Every program stores its whole tile (zeros for an
    empty share of K), so nothing needs clearing between runs. Returns the scratch buffers by key."""
    split = emitter.bind("split", call("program_id", axis=1))
    buffers = {}
    for key, size, position, mask in _partial_parts(emitter, tile, summed):
        buffers[key] = _scratch(ctx, emitter.kernel, key, splits * size)
        value = acc if key == "partial" else sums[key]
        emitter.emit(Effect(call("store", Bin("+", buffers[key], Bin("+", Bin("*", split, Lit(size)), position)),
                                 value, mask=mask)))
    return buffers


def _scratch(ctx: Context, kernel: FusedKernel, key, elements: int) -> Var:
    """The float32 scratch buffer of a GEMM's partials: its tiles' ("partial") or an operand sum's (its key)."""
    return ctx.param("scratch", ("partial" if key == "partial" else "sum", elements, key, id(kernel.core)), "scratch")


def _partial_parts(emitter: Emitter, tile: _Tile, summed: dict[int, int]) -> list[tuple]:
    """What a split GEMM's programs keep per split, as (key, elements per split, position, mask): the tile
    ("partial", [M, N]), and each operand sum (its key, [M] or [N])."""
    rows_n, cols_n = emitter.kernel.core.shape
    parts = [("partial", rows_n * cols_n, Bin("+", Bin("*", tile.rm, tile.N), tile.rn),
              Bin("&", tile.mask_m, tile.mask_n))]
    for key, position in summed.items():
        parts.append((key, rows_n if position == 0 else cols_n, *tile.keeps(position)))
    return parts


def _add_partials(emitter: Emitter, splits: int, acc: Var, tile: _Tile, summed: dict[int, int],
                  sums: dict[int, Var], buffers: dict) -> None:
    """The finishing program's tile: the sum of its splits' partial tiles (and partial operand sums). Its tile
    is one row (BLOCK_M = 1): SPLIT_BLOCK splits of it load as one [SPLIT_BLOCK, BLOCK_N] block, so many
    loads are in flight, and their sum along the splits is the row."""
    emitter.emit(Assign((acc,), call("zeros", shape=GEMM_TILE, dtype=dtypes.float32)))
    for key, position in summed.items():
        emitter.emit(Assign((sums[key],), call("zeros", shape=_sum_shape(position), dtype=dtypes.float32)))
    split, mask_split = _over_splits(emitter, splits, SPLIT_BLOCK)

    for key, size, position, mask in _partial_parts(emitter, tile, summed):
        total = acc if key == "partial" else sums[key]
        part = call("load", Bin("+", buffers[key], Bin("+", Bin("*", split, Lit(size)), position)),
                    mask=Bin("&", mask_split, mask), other=Lit(0.0))
        emitter.emit(Assign((total,), Bin("+", total, call("reduce", part, combine="sum", axis=0, drop="s"))))


def _over_splits(emitter: Emitter, splits: int, block: Block) -> tuple[Var, Var]:
    """A loop over a finishing program's `splits` partials, `block` of them at a time, entered (the emitter's
    block is its body): the splits of this step, and their mask."""
    loop = Loop(Var("first_split"), ZERO, Lit(splits), block)
    emitter.emit(loop)
    emitter.block = loop.body
    split = emitter.bind("split", Bin("+", loop.var, Range(block, 0, 2)))
    return split, emitter.bind("mask_split", Bin("<", split, Lit(splits)))


MLP_PROGRAMS_PER_SM = 2
# An MLP kernel hoists the loads every row tile repeats (biases) out of its loop only while the weight gradients
# it sums in registers hold at most this many elements: a 64-wide backward kernel's two 64 x 64 gradients take
# every register there is (255 a thread), and hoisting made it spill
MLP_HOIST_GRADIENT_ELEMENTS = 2048
# ... and only while what it hoists holds at most this many elements: a bias is held across the loop in the
# accumulators' layout, about a sixth of its width in registers of each thread (as Triton compiles for sm_90). A
# 64-wide network's 272 bias elements took 168 -> 212 registers and, on an H100, the kernel 0.172 -> 0.146 ms; a
# 128-wide one's 528 took 164 -> 252 registers and made it 9% slower
MLP_HOISTED_ELEMENTS = 320
UNKNOWN_MULTIPROCESSORS = 132  # the SMs a kernel plans for where the GPU's size is not known


def _mlp(ctx: Context, kernel: FusedKernel) -> list[Function]:
    """A chain of narrow GEMMs in one kernel: a program takes BLOCK_M rows through every layer. A layer's
    whole weight is one tile (its widths padded to W0, W1, ...; zeros outside), so each dot is one step; its
    epilogue (bias, activation) runs on the accumulator in registers and, cast to the operand type, is the
    next layer's operand. Only the input rows, the weights, the last layer's outputs and the intermediates
    other kernels read (kernel.layers says which layer writes each) touch memory. When the weights fit on
    chip, programs are persistent: each loads the weights once, then walks row tiles.

    The weight gradients the kernel absorbed (dot(P^T, Q) over its rows) are summed by every program over
    the row tiles it walks, in registers, each as soon as the layers it reads are computed, then stored as
    one partial per program; a second function adds each gradient's partials and runs its epilogue."""
    cores = kernel.cores
    m = cores[0].shape[0]
    widths = mlp_widths(kernel)
    # each gradient's dot lays its two operand tiles out in shared memory, as a written intermediate does
    padded, rows, warps, hold = mlp_blocks(widths, cores[0].dtype.itemsize,
                                           written_intermediates(kernel) + 2 * len(kernel.absorbed), kernel.streamed)
    tiles = -(-m // rows)
    programs = tiles
    sms = ctx.settings.multiprocessors
    if (hold and sms) or kernel.absorbed or kernel.summed:  # as many programs as the GPU holds at once, no more
        programs = min(tiles, MLP_PROGRAMS_PER_SM * (sms or UNKNOWN_MULTIPROCESSORS))
    walks = programs < tiles
    hold = hold and walks
    body: list = []
    em = Emitter(ctx, kernel, body)
    block_m = GEMM_BLOCK["rm"]
    cols = [Block(f"W{i}", f"c{i}") for i in range(len(widths))]  # a layer's width along a tile's columns
    ks = [Block(f"W{i}", f"k{i}") for i in range(len(widths))]  # ... and along a weight tile's rows
    em.blocks = {"rm": block_m, **{b.axis: b for b in cols + ks}}
    M = ctx.size(m)
    pid = _program(em)
    c = [em.bind(f"col{i}", Range(cols[i], 1, 2)) for i in range(len(widths))]
    # a column mask only where a width is padded: whole tiles load and store unmasked along their columns
    mask_c = [em.bind(f"mask_col{i}", Bin("<", c[i], Lit(w))) if w != padded[i] else None
              for i, w in enumerate(widths)]
    masks: dict[Var, dict[str, Expr]] = {}  # each mask by its axes' own masks: a load along fewer axes (a
    # bias) takes only theirs

    def tile_mask(name: str, parts: dict[str, Expr | None]) -> Expr | None:
        given = {axis: mask for axis, mask in parts.items() if mask is not None}
        if len(given) < 2:
            return next(iter(given.values()), None)
        mask = em.bind(name, both(*given.values()))
        masks[mask] = given
        return mask

    def weight(layer: int) -> Var:
        core = cores[layer]
        k = em.bind(f"k{layer}", Range(ks[layer], 0, 2))
        mask_k = em.bind(f"mask_k{layer}", Bin("<", k, Lit(widths[layer]))) if mask_c[layer] is not None else None
        mask_w = tile_mask(f"mask_w{layer}", {f"k{layer}": mask_k, f"c{layer + 1}": mask_c[layer + 1]})
        em.mask_parts = masks
        return em.operand(core.inputs[1], Index((k, c[layer + 1]), None, mask_w, OTHER), core.dtype)[0]

    # held: every weight tile loaded once, before the row tiles are walked; else each before its dot (so only
    # one is held on chip at a time)
    weights = [weight(layer) for layer in range(len(cores))] if hold else []
    gradients = _gradient_placement(kernel, widths)
    for j, grad in enumerate(gradients):  # each gradient's accumulator ([P's columns, Q's]) and operand sums
        grad.blocks = (Block(f"W{grad.columns[0]}", f"ga{j}"), Block(f"W{grad.columns[1]}", f"gb{j}"))
        grad.total = em.bind(f"grad{j}", call("zeros", shape=grad.blocks, dtype=dtypes.float32))
        for r in operand_sums(grad.kernel):
            grad.sums[id(r)] = em.bind(f"grad{j}_sum{len(grad.sums)}",
                                       call("zeros", shape=(1, cols[grad.summed_column(r)]), dtype=dtypes.float32))
    sums = _sum_placement(kernel, widths)
    for j, total in enumerate(sums):  # each sum's accumulator: one per column of its range
        total.total = em.bind(f"sum{j}", call("zeros", shape=(1, cols[total.column]), dtype=dtypes.float32))
    tile_index: Expr = pid
    if walks:  # pipelined when the weights are held; else the weights' loads would be buffered per stage
        loop = Loop(Var("tile"), pid, Lit(tiles), Lit(programs), stages=None if hold else 1)
        em.emit(loop)
        em.block = loop.body
        tile_index = loop.var
    start = call("cast", tile_index, dtype=dtypes.int64) if em.big else tile_index
    rm = em.bind("rm", Bin("+", Bin("*", start, block_m), Range(block_m, 0, 2)))
    mask_m = em.bind("mask_m", Bin("<", rm, M))
    masks[mask_m] = {"rm": mask_m}
    # the mask of the tile of width i (the input's, then each layer's output's), by i
    layer_mask = {0: tile_mask("mask_x", {"rm": mask_m, "c0": mask_c[0]})}
    for i in range(1, len(widths)):
        layer_mask[i] = tile_mask(f"mask{i}", {"rm": mask_m, f"c{i}": mask_c[i]})
    em.mask_parts = masks
    first_tile: Var | None = None

    def gradient_operand(x: Node, column: int, dtype: DType) -> Var:
        """x's tile at the tile's rows and column range `column`, zero outside it (the input: its tile)."""
        if x is cores[0].inputs[0]:
            return first_tile
        value, _ = em.value(x, Index((rm, c[column]), None, layer_mask[column], FULL))
        return _operand_cast(em, value, dtype, (block_m, cols[column]), layer_mask[column], "g")

    for layer, core in enumerate(cores):
        a, dtype = core.inputs[0], core.dtype
        if layer == 0:  # the input rows, with the ops producing them applied as they are loaded
            tile, _ = em.operand(a, Index((rm, c[0]), None, layer_mask[0], OTHER), dtype)
            first_tile = tile
        else:  # the previous layer's epilogue, in registers; padded columns zeroed (the weights' are too)
            value, _ = em.value(a, Index((rm, c[layer]), None, layer_mask[layer], FULL))
            tile = _operand_cast(em, value, dtype, (block_m, cols[layer]), mask_c[layer])
        acc = em.bind(f"acc{layer}", call("zeros", shape=(block_m, cols[layer + 1]), dtype=dtypes.float32))
        w = weights[layer] if hold else weight(layer)
        em.emit(Assign((acc,), call("dot", tile, w, acc, **_precision(ctx, dtype))))
        em.accumulators[id(core)] = acc
        em.tile_axes = frozenset({"rm", f"c{layer + 1}"})
        for o in kernel.outputs:  # what this layer writes: an intermediate other kernels read, or the result
            if kernel.layers.get(id(o)) == layer:
                em.store(o, Index((rm, c[layer + 1]), None, layer_mask[layer + 1], FULL), (block_m, cols[layer + 1]))
        for grad in gradients:
            if grad.ready != layer:
                continue
            core = grad.kernel.core
            tiles = [gradient_operand(x, column, core.dtype) for x, column in zip(grad.operands, grad.columns)]
            em.emit(Assign((grad.total,), call("dot", call("trans", tiles[0]), tiles[1], grad.total,
                                               **_precision(ctx, core.dtype))))
            for r in operand_sums(grad.kernel):
                operand = tiles[summed_operand(core, r)]
                part = call("reduce", call("cast", operand, dtype=dtypes.float32), combine="sum", axis=0, drop="rm")
                em.emit(Assign((grad.sums[id(r)],), Bin("+", grad.sums[id(r)], part)))
        for total in sums:
            if total.ready != layer:
                continue
            column = total.column
            value, _ = em.value(total.value, Index((rm, c[column]), None, layer_mask[column], FULL))
            value = call("cast", call("where", layer_mask[column], value, ZERO), dtype=dtypes.float32)
            part = call("reduce", value, combine="sum", axis=0, drop="rm")
            em.emit(Assign((total.total,), Bin("+", total.total, part)))
    constexprs = {"BLOCK_M": rows, **{f"W{i}": p for i, p in enumerate(padded)}}
    em.block = body
    partials = []  # each gradient's scratch: one partial tile (and operand sums) per program
    for grad in gradients:
        a, b = grad.kernel.core.shape
        ra, rb = (Range(block, position, 2) for position, block in enumerate(grad.blocks))
        scratch = {"partial": _scratch(ctx, grad.kernel, "partial", programs * a * b)}
        em.emit(Effect(call("store", add(scratch["partial"], add(mul(pid, Lit(a * b)), add(mul(ra, Lit(b)), rb))),
                            grad.total, mask=Bin("&", Bin("<", ra, Lit(a)), Bin("<", rb, Lit(b))))))
        for r in operand_sums(grad.kernel):
            column = grad.summed_column(r)
            size = widths[column]
            scratch[id(r)] = _scratch(ctx, grad.kernel, id(r), programs * size)
            em.emit(Effect(call("store", add(scratch[id(r)], add(mul(pid, Lit(size)), c[column])), grad.sums[id(r)],
                                mask=Bin("<", c[column], Lit(size)))))
        partials.append(scratch)
    sum_partials = []  # each sum's scratch: its columns' partials, one row per program
    for total in sums:
        size = widths[total.column]
        scratch = _scratch(ctx, total.kernel, id(total.kernel.reductions[0]), programs * size)
        em.emit(Effect(call("store", add(scratch, add(mul(pid, Lit(size)), c[total.column])), total.total,
                            mask=Bin("<", c[total.column], Lit(size)))))
        sum_partials.append(scratch)
    drop_unread(body)  # the values a clamp after the cast left unread
    # hoisted values hold registers across the loop, as the accumulators of summed gradients do
    if walks and sum(padded[a] * padded[b] for a, b in (g.columns for g in gradients)) <= MLP_HOIST_GRADIENT_ELEMENTS:
        widths_of = {f"c{i}": p for i, p in enumerate(padded)}  # a column axis's padded width

        def fits(moved: list[Assign]) -> bool:
            axes = [s.targets[0].axes for s in moved]
            if not all(axis in widths_of for a in axes for axis in a):
                return False
            return sum(math.prod(widths_of[axis] for axis in a) for a in axes) <= MLP_HOISTED_ELEMENTS
        hoist_invariant_loads(loop, fits)
    functions = [ctx.function("", body, constexprs, programs, warps)]
    if gradients or sums:  # every gradient's and sum's partials added, and its epilogue run, by one launch
        functions.append(_finishing(ctx, [grad.kernel for grad in gradients], programs, partials, "_finish",
                                    list(zip(sums, sum_partials))))
    return functions


def _operand_cast(em: Emitter, value: Expr, dtype: DType, shape: tuple, mask: Expr | None,
                  stem: str = "x") -> Var:
    """A layer's epilogue value cast to a dot's operand type (the next layer's, or a summed gradient's). Clamps
    at constants that end it (a ReLU, where(x <= 0, 0, x); clamp's where(x < lo, lo, x) and where(x > hi, hi,
    x); maximum or minimum with a constant) are applied after the cast, to half values, two to a register: half
    the instructions; a ReLU applied first is the conversion's own (lib.relu_to_f16): none. Rounding is
    monotonic and keeps a constant the type holds, so the values are the same, NaN included; only a zero's sign
    may differ, which the sums the tile feeds (dots; a bias gradient's column sums; each from +0) cannot show.
    float16 only: Triton's interpreter, which runs these kernels without a GPU, computes bfloat16 minimum and
    maximum wrongly. `mask`: the rows and columns in range, outside which the tile is zero."""
    clamps = []
    while dtype is dtypes.float16 and (clamp := _clamp(em, value)) is not None and _representable(clamp[2], dtype):
        clamps.append(clamp)
        value = clamp[1]
    if not clamps:
        return em.define(call("cast", value if mask is None else call("where", mask, value, ZERO), dtype=dtype), stem)
    relu_first = clamps[-1][0] == "max" and clamps[-1][2] == 0  # the conversion's own: one instruction
    tile: Expr = call("relu_cast" if relu_first else "cast", value, dtype=dtype)
    clamps = clamps[:-1] if relu_first else clamps
    if clamps:
        tile = em.define(tile, "h")
    for combine, _, bound in reversed(clamps):
        limit = call("full", Lit(float(bound)), shape=shape, dtype=dtype)
        tile = call("combine", tile, limit, combine=combine)
    return em.define(tile if mask is None else call("where", mask, tile, call("zeros", shape=shape, dtype=dtype)),
                     stem)


def _clamp(em: Emitter, value: Expr) -> tuple[str, Expr, object] | None:
    """("max" or "min", x, c) where `value` is the larger or the smaller of x and a constant c (NaN wins)."""
    e = em.definitions.get(value.name) if isinstance(value, Var) else None
    if not isinstance(e, Prim):
        return None
    if e.op in (Op.MAXIMUM, Op.MINIMUM):
        x, c = e.args if isinstance(e.args[1], Lit) else e.args[::-1]
        return ("max" if e.op is Op.MAXIMUM else "min", x, c.value) if isinstance(c, Lit) else None
    if e.op is not Op.WHERE:
        return None
    test, c, x = e.args
    compare = em.definitions.get(test.name) if isinstance(test, Var) else None
    if not isinstance(c, Lit) or not isinstance(compare, Prim) or compare.op not in (Op.LE, Op.LT):
        return None
    if compare.args == (x, c):  # where(x <= c, c, x): at least c (NaN compares false: x)
        return "max", x, c.value
    return ("min", x, c.value) if compare.args == (c, x) else None  # where(c <= x, c, x): at most c


def _representable(value, dtype: DType) -> bool:
    """Whether the number `value` is exactly a value of the floating-point `dtype`."""
    return type(value) in (int, float) and not math.isnan(value) and float(dtype.np.type(value)) == value


def _precision(ctx: Context, dtype: DType) -> dict:
    """A dot's precision option: float32 tiles take the user's setting (TF32 or exact)."""
    return {"precision": ctx.settings.dot_precision(dtype)} if dtype is dtypes.float32 else {}


@dataclass
class _Gradient:
    """A weight gradient an MLP kernel sums: the GEMM kernel it absorbed, the layer after which its operands
    are computed, the column ranges (layer widths) P and Q are evaluated along, and, once emitted, its
    accumulator (its tile's blocks) and operand sums."""

    kernel: FusedKernel
    ready: int
    columns: tuple[int, int]
    blocks: tuple[Block, Block] | None = None
    total: Var | None = None
    sums: dict[int, Var] = field(default_factory=dict)

    @property
    def operands(self) -> tuple[Node, Node]:
        return self.kernel.core.inputs[0].inputs[0], self.kernel.core.inputs[1]

    def summed_column(self, reduction: Node) -> int:
        """The column range of the operand a sum reduces (a bias gradient: P's)."""
        return self.columns[summed_operand(self.kernel.core, reduction)]


def _gradient_placement(kernel: FusedKernel, widths: list[int]) -> list[_Gradient]:
    """Where an MLP kernel sums each gradient it absorbed: the layer after which its operands are all
    computed, and P's and Q's column ranges (see `_placer`)."""
    place = _placer(kernel, widths)
    placed = []
    for g in kernel.absorbed:
        (ready_p, p_column), (ready_q, q_column) = place(g.core.inputs[0].inputs[0]), place(g.core.inputs[1])
        placed.append(_Gradient(g, max(ready_p, ready_q), (p_column, q_column)))
    return placed


@dataclass
class _Sum:
    """A sum over an MLP kernel's rows that it absorbed (`fusion.Planner.absorb_sums`): the row kernel whose
    reduction it is, the value summed, the layer after which that value is computed, its column range, whether
    the sum keeps each column apart, and, once emitted, its accumulator."""

    kernel: FusedKernel
    value: Node
    ready: int
    column: int
    per_column: bool
    total: Var | None = None


def _sum_placement(kernel: FusedKernel, widths: list[int]) -> list[_Sum]:
    """Where an MLP kernel sums each value over its rows: after the layers it reads, along the column range of
    the layer it is elementwise connected to."""
    place = _placer(kernel, widths)
    placed = []
    for f in kernel.summed:
        (r,) = f.reductions
        value, _, _ = summed_views(r)
        ready, column = place(value)
        placed.append(_Sum(f, value, ready, column, r.numel > 1))
    return placed


def _placer(kernel: FusedKernel, widths: list[int]):
    """The function placing a value an MLP kernel computes at its rows: (the last layer whose result computing
    it reads, the column range it is evaluated along). A value is evaluated along the column range of the layer
    whose result it is elementwise connected to (so it shares that layer's values and masks), else along the
    first of its width; the kernel's input is its first tile (column 0)."""
    cores = kernel.cores
    layer_of = {id(core): i for i, core in enumerate(cores)}
    covered = {id(n) for n in kernel.covers}
    users: dict[int, list[Node]] = {}
    for n in kernel.covers:
        for i in n.inputs:
            users.setdefault(id(i), []).append(n)

    def elementwise(n: Node) -> bool:
        return n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY)

    def place(x: Node) -> tuple[int, int]:
        if x is cores[0].inputs[0]:
            return 0, 0
        ready, stack, seen = 0, [x], set()
        while stack:  # the layers whose results computing x reads
            n = stack.pop()
            if id(n) in seen or id(n) not in covered:
                continue
            seen.add(id(n))
            if id(n) in layer_of:
                ready = max(ready, layer_of[id(n)])
                continue
            stack.extend(n.inputs)
        joined, stack, seen = [], [x], set()
        while stack:  # the layers x is elementwise connected to, at its own shape
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if id(n) in layer_of:
                joined.append(layer_of[id(n)])
            near = list(n.inputs) if elementwise(n) else []
            near += [u for u in users.get(id(n), []) if elementwise(u)]
            # not through a constant: one zero may feed every layer's activation
            stack.extend(v for v in near if id(v) in covered and v.shape == x.shape and v.op.kind is not Kind.LEAF)
        column = max(joined) + 1 if joined else widths.index(x.shape[1])
        return ready, column

    return place


def _epilogue_index(emitter: Emitter, core: Node, shape: tuple[int, ...], batch_dims: tuple[Expr, ...],
                    rm: Var, rn: Var, mask: Var) -> Index:
    """Where the tile's elements sit in an output of the epilogue: the core's shape, or a reshape of it
    (the planner checked that element i of one is element i of the other)."""
    *batch, m, n = core.shape
    if shape == core.shape:
        return Index((*batch_dims, rm, rn), None, mask, FULL)
    if not batch and shape and shape[-1] == n:  # rows regrouped: one division per row, not per element
        return Index((*emitter.unravel(rm, shape[:-1]), rn), None, mask, FULL)
    linear = emitter.linear(Index((*batch_dims, rm, rn), None, mask, FULL), core.shape)
    return Index(None, linear, mask, FULL)


def _epilogue_reductions(ctx: Context, kernel: FusedKernel, epilogue: Emitter, at: Index, reductions: list[Node],
                         kept: dict[int, tuple[Var, Var]]) -> None:
    """Rows or columns of an epilogue value reduced across tiles: each program reduces its tile and
    combines the result atomically into the output, which the runtime fills with the identity first."""
    for r in reductions:
        (axis,) = r.attrs["axes"]
        value, dt = epilogue.value(r.inputs[0], at)
        tile = epilogue.define(call("where", at.mask, Bin("+", value, call("zeros", shape=GEMM_TILE, dtype=dt)),
                                    identity(r.op, dt)), "t")
        part = epilogue.define(call("reduce", tile, combine=r.op.label, axis=axis, drop="rn" if axis == 1 else "rm"),
                               "part")
        position, keep = kept[axis]
        for o in kernel.outputs:
            if summed_output(kernel, o) is r:
                pointer = ctx.param("write", o, "out")
                epilogue.emit(Effect(call("atomic", Bin("+", pointer, position), part, mask=keep,
                                          combine=r.op.label)))


GEMM_TILE = (GEMM_BLOCK["rm"], GEMM_BLOCK["rn"])


def epilogue_reduction_outputs(kernel: FusedKernel) -> list[tuple[Node, Op]]:
    """The outputs a GEMM kernel reduces into atomically, with their reductions: the runtime fills them
    with the reduction's identity before each launch."""
    sums = operand_sums(kernel)
    return [(o, r.op) for o in kernel.outputs if (r := summed_output(kernel, o)) is not None and r not in sums]
