"""The MLP pattern's lowering: a chain of narrow layers computed in one kernel (`lower_mlp`), each row tile's
activations kept on chip from layer to layer, with the weight gradients and the sums over rows it absorbed
accumulated per program and finished by the GEMM pattern's finishing function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ember import dtypes
from ember.compiler.emit import (
    GEMM_BLOCK,
    UNKNOWN_MULTIPROCESSORS,
    ZERO,
    Context,
    Emitter,
    Index,
    both,
    program_index,
    scratch_buffer,
)
from ember.compiler.fused import FULL, OTHER, FusedKernel, operand_sums, summed_operand, summed_views
from ember.compiler.kernel import (
    Assign,
    Bin,
    Block,
    Effect,
    Expr,
    Function,
    Lit,
    Loop,
    Prim,
    Range,
    Var,
    add,
    call,
    mul,
)
from ember.compiler.patterns.gemm import RowSum, finishing_function
from ember.compiler.patterns.mlp.chain import mlp_blocks, mlp_widths, written_intermediates
from ember.compiler.rewrite import drop_unread, hoist_invariant_loads
from ember.dtypes import DType
from ember.ir import Kind, Node, Op

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


def lower_mlp(ctx: Context, kernel: FusedKernel) -> list[Function]:
    """A chain of narrow GEMMs in one kernel: a program takes BLOCK_M rows through every layer. A layer's
    whole weight is one tile (its widths padded to W0, W1, ...; zeros outside), so each dot is one step; its
    epilogue (bias, activation) runs on the accumulator in registers and, cast to the operand type, is the
    next layer's operand. Only the input rows, the weights, the last layer's outputs and the intermediates
    other kernels read (kernel.payload.layers says which layer writes each) touch memory. When the weights fit on
    chip, programs are persistent: each loads the weights once, then walks row tiles.

    The weight gradients the kernel absorbed (dot(P^T, Q) over its rows) are summed by every program over
    the row tiles it walks, in registers, each as soon as the layers it reads are computed, then stored as
    one partial per program; a second function adds each gradient's partials and runs its epilogue."""
    return _MlpKernel(ctx, kernel).lower()


class _MlpKernel:
    """One MLP kernel being lowered: its blocks and masks, then its row tiles walked through every layer."""

    def __init__(self, ctx: Context, kernel: FusedKernel):
        self.ctx, self.kernel = ctx, kernel
        chain = kernel.payload
        self.cores = cores = kernel.cores
        m = cores[0].shape[0]
        self.widths = widths = mlp_widths(kernel)
        # each gradient's dot lays its two operand tiles out in shared memory, as a written intermediate does
        self.padded, self.rows, self.warps, hold = mlp_blocks(
            widths, cores[0].dtype.itemsize, ctx.settings.shared_memory,
            written_intermediates(kernel) + 2 * len(chain.absorbed), chain.streamed)
        self.tiles = -(-m // self.rows)
        self.programs = self.tiles
        sms = ctx.settings.multiprocessors
        if (hold and sms) or chain.absorbed or chain.summed:  # as many programs as the GPU holds at once, no more
            self.programs = min(self.tiles, MLP_PROGRAMS_PER_SM * (sms or UNKNOWN_MULTIPROCESSORS))
        self.walks = self.programs < self.tiles
        self.hold = hold and self.walks
        self.body: list = []
        self.em = em = Emitter(ctx, kernel, self.body)
        self.block_m = GEMM_BLOCK["rm"]
        self.cols = [Block(f"W{i}", f"c{i}") for i in range(len(widths))]  # a layer's width along a tile's columns
        self.ks = [Block(f"W{i}", f"k{i}") for i in range(len(widths))]  # ... and along a weight tile's rows
        em.blocks = {"rm": self.block_m, **{b.axis: b for b in self.cols + self.ks}}
        self.M = ctx.size(m)
        self.pid = program_index(em)
        self.c = [em.bind(f"col{i}", Range(self.cols[i], 1, 2)) for i in range(len(widths))]
        # a column mask only where a width is padded: whole tiles load and store unmasked along their columns
        self.mask_c = [em.bind(f"mask_col{i}", Bin("<", self.c[i], Lit(w))) if w != self.padded[i] else None
                       for i, w in enumerate(widths)]
        # each mask by its axes' own masks: a load along fewer axes (a bias) takes only theirs
        self.masks: dict[Var, dict[str, Expr]] = {}
        self.first_tile: Var | None = None

    def lower(self) -> list[Function]:
        em, cores = self.em, self.cores
        # held: every weight tile loaded once, before the row tiles are walked; else each before its dot (so only
        # one is held on chip at a time)
        self.weights = [self._weight(layer) for layer in range(len(cores))] if self.hold else []
        self._accumulators()
        self._row_tile()
        for layer, core in enumerate(cores):
            self._layer(layer, core)
        constexprs = {"BLOCK_M": self.rows, **{f"W{i}": p for i, p in enumerate(self.padded)}}
        em.block = self.body
        partials, sum_partials = self._store_partials()
        drop_unread(self.body)  # the values a clamp after the cast left unread
        self._hoist()
        functions = [self.ctx.function("", self.body, constexprs, self.programs, self.warps)]
        if self.gradients or self.sums:  # each gradient's and sum's partials added, its epilogue run, by one launch
            functions.append(finishing_function(self.ctx, [grad.kernel for grad in self.gradients], self.programs,
                                                partials, "_finish", list(zip(self.sums, sum_partials))))
        return functions

    def _tile_mask(self, name: str, parts: dict[str, Expr | None]) -> Expr | None:
        given = {axis: mask for axis, mask in parts.items() if mask is not None}
        if len(given) < 2:
            return next(iter(given.values()), None)
        mask = self.em.bind(name, both(*given.values()))
        self.masks[mask] = given
        return mask

    def _weight(self, layer: int) -> Var:
        em, core, widths = self.em, self.cores[layer], self.widths
        k = em.bind(f"k{layer}", Range(self.ks[layer], 0, 2))
        mask_k = em.bind(f"mask_k{layer}", Bin("<", k, Lit(widths[layer]))) if self.mask_c[layer] is not None else None
        mask_w = self._tile_mask(f"mask_w{layer}", {f"k{layer}": mask_k, f"c{layer + 1}": self.mask_c[layer + 1]})
        em.mask_parts = self.masks
        return em.operand(core.inputs[1], Index((k, self.c[layer + 1]), None, mask_w, OTHER), core.dtype)[0]

    def _accumulators(self) -> None:
        """Each absorbed gradient's accumulator ([P's columns, Q's]) and operand sums, each sum's (one per column
        of its range)."""
        em, cols = self.em, self.cols
        self.gradients = _gradient_placement(self.kernel, self.widths)
        for j, grad in enumerate(self.gradients):
            grad.blocks = (Block(f"W{grad.columns[0]}", f"ga{j}"), Block(f"W{grad.columns[1]}", f"gb{j}"))
            grad.total = em.bind(f"grad{j}", call("zeros", shape=grad.blocks, dtype=dtypes.float32))
            for r in operand_sums(grad.kernel):
                grad.sums[id(r)] = em.bind(f"grad{j}_sum{len(grad.sums)}",
                                           call("zeros", shape=(1, cols[grad.summed_column(r)]), dtype=dtypes.float32))
        self.sums = _sum_placement(self.kernel, self.widths)
        for j, total in enumerate(self.sums):
            total.total = em.bind(f"sum{j}", call("zeros", shape=(1, cols[total.column]), dtype=dtypes.float32))

    def _row_tile(self) -> None:
        """The loop over row tiles (or a program's one tile), its rows and the masks of its tiles of each width."""
        em = self.em
        tile_index: Expr = self.pid
        self.loop = None
        if self.walks:  # pipelined when the weights are held; else the weights' loads would be buffered per stage
            stages = None if self.hold else 1
            self.loop = Loop(Var("tile"), self.pid, Lit(self.tiles), Lit(self.programs), stages=stages)
            em.emit(self.loop)
            em.block = self.loop.body
            tile_index = self.loop.var
        start = call("cast", tile_index, dtype=dtypes.int64) if em.big else tile_index
        self.rm = em.bind("rm", Bin("+", Bin("*", start, self.block_m), Range(self.block_m, 0, 2)))
        mask_m = em.bind("mask_m", Bin("<", self.rm, self.M))
        self.masks[mask_m] = {"rm": mask_m}
        # the mask of the tile of width i (the input's, then each layer's output's), by i
        self.layer_mask = {0: self._tile_mask("mask_x", {"rm": mask_m, "c0": self.mask_c[0]})}
        for i in range(1, len(self.widths)):
            self.layer_mask[i] = self._tile_mask(f"mask{i}", {"rm": mask_m, f"c{i}": self.mask_c[i]})
        em.mask_parts = self.masks

    def _gradient_operand(self, x: Node, column: int, dtype: DType) -> Var:
        """x's tile at the tile's rows and column range `column`, zero outside it (the input: its tile)."""
        if x is self.cores[0].inputs[0]:
            return self.first_tile
        mask = self.layer_mask[column]
        value, _ = self.em.value(x, Index((self.rm, self.c[column]), None, mask, FULL))
        return _operand_cast(self.em, value, dtype, (self.block_m, self.cols[column]), mask, "g")

    def _layer(self, layer: int, core: Node) -> None:
        """A layer's dot on the tile, what it writes, and the gradients and sums whose operands are ready after it."""
        em, ctx, rm, c, cols, block_m, layer_mask = self.em, self.ctx, self.rm, self.c, self.cols, self.block_m, \
            self.layer_mask
        a, dtype = core.inputs[0], core.dtype
        if layer == 0:  # the input rows, with the ops producing them applied as they are loaded
            tile, _ = em.operand(a, Index((rm, c[0]), None, layer_mask[0], OTHER), dtype)
            self.first_tile = tile
        else:  # the previous layer's epilogue, in registers; padded columns zeroed (the weights' are too)
            value, _ = em.value(a, Index((rm, c[layer]), None, layer_mask[layer], FULL))
            tile = _operand_cast(em, value, dtype, (block_m, cols[layer]), self.mask_c[layer])
        acc = em.bind(f"acc{layer}", call("zeros", shape=(block_m, cols[layer + 1]), dtype=dtypes.float32))
        w = self.weights[layer] if self.hold else self._weight(layer)
        em.emit(Assign((acc,), call("dot", tile, w, acc, **_precision(ctx, dtype))))
        em.accumulators[id(core)] = acc
        em.tile_axes = frozenset({"rm", f"c{layer + 1}"})
        for o in self.kernel.outputs:  # what this layer writes: an intermediate other kernels read, or the result
            if self.kernel.payload.layers.get(id(o)) == layer:
                em.store(o, Index((rm, c[layer + 1]), None, layer_mask[layer + 1], FULL), (block_m, cols[layer + 1]))
        for grad in self.gradients:
            if grad.ready != layer:
                continue
            core = grad.kernel.core
            tiles = [self._gradient_operand(x, column, core.dtype) for x, column in zip(grad.operands, grad.columns)]
            em.emit(Assign((grad.total,), call("dot", call("trans", tiles[0]), tiles[1], grad.total,
                                               **_precision(ctx, core.dtype))))
            for r in operand_sums(grad.kernel):
                operand = tiles[summed_operand(core, r)]
                part = call("reduce", call("cast", operand, dtype=dtypes.float32), combine="sum", axis=0, drop="rm")
                em.emit(Assign((grad.sums[id(r)],), Bin("+", grad.sums[id(r)], part)))
        for total in self.sums:
            if total.ready != layer:
                continue
            column = total.column
            value, _ = em.value(total.value, Index((rm, c[column]), None, layer_mask[column], FULL))
            value = call("cast", call("where", layer_mask[column], value, ZERO), dtype=dtypes.float32)
            part = call("reduce", value, combine="sum", axis=0, drop="rm")
            em.emit(Assign((total.total,), Bin("+", total.total, part)))

    def _store_partials(self) -> tuple[list[dict], list[Var]]:
        """Each gradient's scratch (one partial tile, and operand sums, per program) and each sum's (its columns'
        partials, one row per program), stored."""
        ctx, em, pid, c, widths = self.ctx, self.em, self.pid, self.c, self.widths
        partials = []
        for grad in self.gradients:
            a, b = grad.kernel.core.shape
            ra, rb = (Range(block, position, 2) for position, block in enumerate(grad.blocks))
            scratch = {"partial": scratch_buffer(ctx, grad.kernel, "partial", self.programs * a * b)}
            em.emit(Effect(call("store", add(scratch["partial"], add(mul(pid, Lit(a * b)), add(mul(ra, Lit(b)), rb))),
                                grad.total, mask=Bin("&", Bin("<", ra, Lit(a)), Bin("<", rb, Lit(b))))))
            for r in operand_sums(grad.kernel):
                column = grad.summed_column(r)
                size = widths[column]
                scratch[id(r)] = scratch_buffer(ctx, grad.kernel, id(r), self.programs * size)
                em.emit(Effect(call("store", add(scratch[id(r)], add(mul(pid, Lit(size)), c[column])),
                                    grad.sums[id(r)], mask=Bin("<", c[column], Lit(size)))))
            partials.append(scratch)
        sum_partials = []
        for total in self.sums:
            size = widths[total.column]
            scratch = scratch_buffer(ctx, total.kernel, id(total.kernel.reductions[0]), self.programs * size)
            em.emit(Effect(call("store", add(scratch, add(mul(pid, Lit(size)), c[total.column])), total.total,
                                mask=Bin("<", c[total.column], Lit(size)))))
            sum_partials.append(scratch)
        return partials, sum_partials

    def _hoist(self) -> None:
        """Loads every row tile repeats (biases) moved out of the loop, while they and the summed gradients'
        accumulators leave registers to spare (hoisted values hold registers across the loop, as those do)."""
        padded = self.padded
        held = sum(padded[a] * padded[b] for a, b in (g.columns for g in self.gradients))
        if not self.walks or held > MLP_HOIST_GRADIENT_ELEMENTS:
            return
        widths_of = {f"c{i}": p for i, p in enumerate(padded)}  # a column axis's padded width

        def fits(moved: list[Assign]) -> bool:
            axes = [s.targets[0].axes for s in moved]
            if not all(axis in widths_of for a in axes for axis in a):
                return False
            return sum(math.prod(widths_of[axis] for axis in a) for a in axes) <= MLP_HOISTED_ELEMENTS
        hoist_invariant_loads(self.loop, fits)


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
    for g in kernel.payload.absorbed:
        (ready_p, p_column), (ready_q, q_column) = place(g.core.inputs[0].inputs[0]), place(g.core.inputs[1])
        placed.append(_Gradient(g, max(ready_p, ready_q), (p_column, q_column)))
    return placed


def _sum_placement(kernel: FusedKernel, widths: list[int]) -> list[RowSum]:
    """Where an MLP kernel sums each value over its rows: after the layers it reads, along the column range of
    the layer it is elementwise connected to."""
    place = _placer(kernel, widths)
    placed = []
    for f in kernel.payload.summed:
        (r,) = f.reductions
        value, _, _ = summed_views(r)
        ready, column = place(value)
        placed.append(RowSum(f, value, ready, column, r.numel > 1))
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
