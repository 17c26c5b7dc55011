"""The row pattern: kernels that reduce rows of their space along some axes (softmax, norms, cross entropy and
every reduction), with the values the reductions read (FULL level) and those computed from their results
(ROW level, or FULL again by broadcast).

Planning: a stored reduction read by exactly one row kernel over its own space, at ROW level, is computed in
that kernel instead of being stored (`pull_reductions`). Lowering: a program per block of rows, each reduction
accumulated over the row in registers, a row that does not fit one tile walked in loops of chunks; what reads
the reductions' results stored after them (`RowKernel`). Where the kept axes are the contiguous ones (a column
reduction) a program holds a block of kept positions and walks the reduced ones; how wide that block is, and into
how many parts `compiler/passes.py` splits a column reduction too narrow to fill the GPU, is this pattern's rule
(`column_block`, `column_parts`).
"""

from __future__ import annotations

import math

from ember import dtypes
from ember.compiler.emit import ZERO, Context, Emitter, Index, identity, next_pow2, program_index
from ember.compiler.fused import FULL, ROW, FusedKernel, KernelKind, Pattern, Stage
from ember.compiler.kernel import Assign, Bin, Block, Expr, Function, Lit, Loop, Range, Var, add, call
from ember.compiler.planner import Planner
from ember.compiler.rewrite import loads_first
from ember.dtypes import compute_dtype
from ember.ir import Kind, Node, Op

ROW_TILE = 4096  # elements of a row kernel's tile; rows longer than this are reduced in a loop
# reductions one loop keeps a full tile of partial results for (COLUMN_TILE or LOOP_CHUNK float32s: 32 or 8 registers
# a thread); more share the tile, narrowed
TILE_ACCUMULATORS = 4

LOOP_CHUNK = 1024  # columns per step of that loop

# a kernel reducing leading axes (a column sum: the kept axes are contiguous) holds a block of KEPT_BLOCK kept
# positions and walks the reduced ones COLUMN_TILE // KEPT_BLOCK at a time, with 4 warps: wide, short tiles keep
# many rows of loads in flight (H200, a layer norm's weight gradient over 32768 x 4096 bf16: 0.53 ms at 128 x 32
# with 8 warps, 0.20 ms at 512 x 8 with 4). It keeps a partial result per element of its tile and reduces the tile
# once, after the loop: a reduction across the tile's rows at every step would cross warps (shared memory and a
# barrier per step). Blocks narrow (down to MIN_KEPT_BLOCK) until the programs fill COLUMN_WAVES waves of the SMs.
KEPT_BLOCK = 512
COLUMN_TILE = 4096
COLUMN_WARPS = 4
MIN_KEPT_BLOCK = 32
COLUMN_WAVES = 4
COLUMN_SPLIT_WAVES = 2
# a column reduction with too few kept positions for that is split (compiler/passes.py): each of its partial
# results reduces at least COLUMN_MIN_PART_BYTES of input per program and COLUMN_MIN_PART rows
COLUMN_MIN_PART_BYTES = 16 * 1024
COLUMN_MIN_PART = 64
ASSUMED_MULTIPROCESSORS = 132  # where the GPU is not known (an H100's or H200's)


def column_block(kept: int, multiprocessors: int) -> int:
    """Kept positions per program of a column kernel over `kept` positions: KEPT_BLOCK, halved (down to
    MIN_KEPT_BLOCK) while the programs would not fill COLUMN_WAVES waves of the GPU's multiprocessors."""
    waves = COLUMN_WAVES * (multiprocessors or ASSUMED_MULTIPROCESSORS)
    block = min(next_pow2(kept), KEPT_BLOCK)
    while block > MIN_KEPT_BLOCK and -(-kept // block) < waves:
        block //= 2
    return block


def column_parts(length: int, kept: int, itemsize: int, multiprocessors: int) -> int:
    """Into how many parts a column reduction of `length` rows into `kept` contiguous positions is split: where
    unsplit it would fill fewer than COLUMN_SPLIT_WAVES waves of the multiprocessors, enough parts that its partial
    stage (a column kernel over parts x kept positions, in blocks that narrow to MIN_KEPT_BLOCK) fills COLUMN_WAVES,
    few enough that each of its programs reads COLUMN_MIN_PART_BYTES and COLUMN_MIN_PART rows. 1: not split."""
    multiprocessors = multiprocessors or ASSUMED_MULTIPROCESSORS
    if not kept or -(-kept // MIN_KEPT_BLOCK) >= COLUMN_SPLIT_WAVES * multiprocessors:
        return 1
    waves = COLUMN_WAVES * multiprocessors
    wanted = -(-waves * MIN_KEPT_BLOCK // kept)
    rows_per_program = max(COLUMN_MIN_PART, -(-COLUMN_MIN_PART_BYTES // (MIN_KEPT_BLOCK * itemsize)))
    parts = min(wanted, length // rows_per_program)
    if parts < 2:
        return 1
    # rather a few parts fewer that divide the rows evenly than padding (a mask and a clamp per load)
    return next((p for p in range(parts, parts // 2, -1) if length % p == 0), parts)


def column_rows_together(kept: int) -> int:
    """How many rows a split column reduction into `kept` contiguous positions reads as one row: where kept is
    narrower than MIN_KEPT_BLOCK (3 channels), enough that their positions fill blocks of MIN_KEPT_BLOCK exactly
    (32 rows of 3, 96 positions), so the blocks' loads are contiguous and aligned; 1 otherwise."""
    return MIN_KEPT_BLOCK // math.gcd(kept, MIN_KEPT_BLOCK) if 0 < kept < MIN_KEPT_BLOCK else 1


BLOCK_M, BLOCK_N = Block("BLOCK_M", "m"), Block("BLOCK_N", "n")  # a row kernel's tile


def pull_reductions(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """A stored reduction that exactly one row kernel reads, at ROW level over the reduction's own space and axes,
    is computed in that kernel (still written where it is an output)."""
    by_root = {id(k.root): k for k in kernels}
    refs = {id(k): planner.references(k) for k in kernels}
    for r in reversed(planner.nodes):
        if r.op.kind is not Kind.REDUCE or id(r) not in planner.stored or id(r) in planner.given:
            continue
        readers = [k for k in kernels if id(r) in refs[id(k)]]
        if len(readers) != 1:
            continue
        (k,) = readers
        space, axes = r.inputs[0].shape, tuple(r.attrs["axes"])
        if refs[id(k)][id(r)] != {ROW} or (k.space, k.axes) != (space, axes) or k.kind is not KernelKind.REDUCE:
            continue
        own = by_root.get(id(r))
        k.reductions.append(r)
        k.reductions.sort(key=lambda n: planner.position[id(n)])
        if id(r) in planner.output_ids:
            k.outputs.append(r)
            k.levels[id(r)] = ROW
        else:
            planner.stored.discard(id(r))
        if own is not None and own is not k:
            kernels.remove(own)
            del refs[id(own)]
        refs[id(k)] = planner.references(k)
    return kernels


def lower_rows(ctx: Context, kernel: FusedKernel) -> Function:
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
        # a walked row or column keeps a tile of partial results per reduction of a loop: the tile narrows so that
        # they fit the registers
        self.phase_list = self.phases()
        shares = next_pow2(-(-max(map(len, self.phase_list), default=1) // TILE_ACCUMULATORS))
        if self.trailing:  # rows are contiguous in memory: a program takes few, long rows
            looped = next_pow2(n) > ROW_TILE  # a row that does not fit is walked in small chunks (registers)
            block_n = max(LOOP_CHUNK // shares, min(LOOP_CHUNK, 128)) if looped else min(next_pow2(n), ROW_TILE)
            block_m = 1 if looped or block_n == LOOP_CHUNK else max(1, min(ROW_TILE // block_n, next_pow2(m), 64))
        else:  # the kept axes are the contiguous ones: wide along them, so loads coalesce
            block_m = column_block(m, ctx.settings.multiprocessors)
            block_n = max(1, min(next_pow2(n), COLUMN_TILE // block_m // shares))
        self.block_m, self.block_n = block_m, block_n
        self.persistent = next_pow2(n) <= block_n
        self.body: list = []
        self.emitter = emitter = Emitter(ctx, kernel, self.body)
        pid = program_index(emitter)
        first_row = call("cast", pid, dtype=dtypes.int64) if emitter.big else pid
        first = emitter.bind("first", Bin("*", first_row, BLOCK_M))
        self.rows = emitter.bind("rows", Bin("+", first, Range(BLOCK_M, 0, 2)))
        self.rmask = emitter.bind("rmask", Bin("<", self.rows, ctx.size(m)))
        emitter.row_index = Index(None, self.rows, self.rmask, ROW)
        kept_shape = tuple(space[i] for i in self.kept)
        outer = self.block_positions(first_row, kept_shape)
        if outer is not None:
            emitter.unravelled[(self.rows, kept_shape)] = outer
        emitter.unravel(self.rows, kept_shape)  # before any loop: every phase uses it
        self.n_size = ctx.size(n)
        self.cols: Var | None = None  # the columns of the chunk being computed, and their mask
        self.mask: Var | None = None

    def lower(self) -> Function:
        if self.persistent:
            self.open_chunk(ZERO)
        phases = list(self.phase_list)
        while phases:
            if len(phases) > 1 and self.online(phases[0], phases[1]):
                self.reduce_online(phases[0][0], phases[1][0])
                phases = phases[2:]
            else:
                self.reduce(phases.pop(0))
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
        if self.persistent:
            self.body[:] = loads_first(self.body)
        grid = -(-self.kernel.rows // self.block_m)
        warps = 4 if self.block_m * self.block_n <= 2048 else 8
        if not self.trailing:
            warps = COLUMN_WARPS
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

    def block_positions(self, number: Expr, shape: tuple[int, ...]) -> tuple[Expr, ...] | None:
        """The positions of block `number` in the kept dimensions `shape` where the block of rows lies inside one
        run of the innermost one (its size a multiple of the block's): the outer positions are then the same for
        every row of the block, scalars computed once from its first row, so what varies only along them and the
        columns (a row statistic read by a column sum) is loaded and computed once per column, not per element.
        None otherwise (every position unravelled per row)."""
        inner = max((d for d, s in enumerate(shape) if s != 1), default=None)
        if inner is None or all(s == 1 for s in shape[:inner]) or shape[inner] % self.block_m:
            return None
        em, blocks = self.emitter, Lit(shape[inner] // self.block_m)
        # from the block's number, so Triton sees that the block starts at a multiple of BLOCK_M (its first row
        # % the size would hide that, and loads along the rows would not coalesce)
        within = em.bind("within", Bin("+", Bin("*", Bin("%", number, blocks), BLOCK_M), Range(BLOCK_M, 0, 2)))
        outer = em.unravel(em.bind("outer", Bin("//", number, blocks)), shape[:inner])
        return (*outer, within, *(ZERO for _ in shape[inner + 1:]))

    def open_chunk(self, start: Expr) -> None:
        emitter = self.emitter
        self.cols = emitter.bind("cols", add(start, Range(BLOCK_N, 1, 2)))
        cmask = emitter.bind("cmask", Bin("<", self.cols, self.n_size))
        self.mask = emitter.bind("mask", Bin("&", self.rmask, cmask))
        # a load that varies along the columns only (a value per reduced position) needs only their mask
        emitter.mask_parts[self.mask] = {"m": self.rmask, "n": cmask}

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
        """One loop over the row that accumulates every reduction of `phase`. A column kernel, and a row kernel
        that walks its rows in chunks, keeps a partial result per element of its tile (`spread`) and reduces the
        tile once, after the loop: a reduction across the tile at every step would cross warps (shared memory and
        barriers) between one chunk's loads and the next's."""
        emitter = self.emitter
        accs = []
        for r in phase:
            arg_reduction = r.op in (Op.ARGMAX, Op.ARGMIN)
            spread = not (self.trailing and self.persistent) and not arg_reduction
            dt = compute_dtype(r.inputs[0].dtype if arg_reduction else r.dtype)
            acc_dt = dtypes.int32 if dt is dtypes.bool_ else dt
            acc = Var(emitter.fresh("acc"), frozenset({"m", "n"} if spread else {"m"}))
            arg = Var(emitter.fresh("arg"), frozenset({"m"})) if arg_reduction else None
            start_value = identity(r.op, dt)
            shape = (BLOCK_M, BLOCK_N) if spread else (BLOCK_M, 1)
            emitter.emit(Assign((acc,), call("full", start_value, shape=shape, dtype=acc_dt)))
            if arg:
                emitter.emit(Assign((arg,), call("zeros", shape=(BLOCK_M, 1), dtype=dtypes.int64)))
            accs.append((r, dt, acc_dt, start_value, acc, arg))
        self.open_loop()
        for r, _, acc_dt, start_value, acc, arg in accs:
            self.accumulate(r, start_value, acc_dt, acc, arg)
        emitter.block = self.body
        for r, dt, acc_dt, _, acc, arg in accs:
            result = arg if arg else acc
            if "n" in acc.varies:
                result = emitter.define(call("reduce", acc, combine=r.op.label, axis=1, drop="n",
                                             **self.nan_option(r)), "total")
            if acc_dt is not dt and not arg:  # a bool max or min, accumulated in int32
                result = emitter.define(Bin("!=", result, ZERO))
            emitter.reduced[id(r)] = result
        self.close_loop()

    def online(self, first: list[Node], second: list[Node]) -> bool:
        """Whether a walked row's phases are a max of a float32 value, then the sum of exp(value - that max) alone
        (softmax's and log_softmax's statistics, a language model's loss over its vocabulary): both are then
        accumulated in one pass over the row (`reduce_online`) instead of two."""
        if self.persistent or not self.trailing or len(first) != 1 or len(second) != 1:
            return False
        (top,), (total,) = first, second
        if top.op is not Op.MAX or total.op is not Op.SUM or compute_dtype(top.dtype) is not dtypes.float32 or \
                total.dtype is not dtypes.float32 or total.inputs[0].op is not Op.EXP:
            return False
        shifted = total.inputs[0].inputs[0]
        if shifted.op is not Op.SUB or shifted.inputs[0] is not top.inputs[0]:
            return False
        spread = shifted.inputs[1]
        while spread.op in (Op.EXPAND, Op.RESHAPE):
            spread = spread.inputs[0]
        return spread is top

    def reduce_online(self, top: Node, total: Node) -> None:
        """One loop for a max and the sum of exp(value - max) (`online`): each position of the tile keeps the
        largest value it has seen and its sum of exponentials relative to it, rescaled when a larger one comes;
        after the loop the tile's maxima are reduced and each sum rescaled to the row's. As the two passes would,
        NaN wins, and a row of -inf sums to NaN (exp(-inf - -inf))."""
        emitter, tile_shape, dt = self.emitter, (BLOCK_M, BLOCK_N), dtypes.float32
        lowest, zero = Lit(-math.inf), Lit(0.0)
        high = Var(emitter.fresh("acc"), frozenset({"m", "n"}))
        summed = Var(emitter.fresh("acc"), frozenset({"m", "n"}))
        emitter.emit(Assign((high,), call("full", lowest, shape=tile_shape, dtype=dt)))
        emitter.emit(Assign((summed,), call("full", zero, shape=tile_shape, dtype=dt)))

        def exp(x: Expr) -> Expr:
            return call("exp2", Bin("*", x, Lit(math.log2(math.e), dt)))

        def finite(x: Expr) -> Expr:  # the shift exponentials are taken against: 0 where nothing is seen yet
            return call("where", Bin("==", x, lowest), zero, x)

        self.open_loop()
        value, _ = emitter.value(top.inputs[0], self.full_index())
        tile = emitter.define(call("where", self.mask, Bin("+", value, call("zeros", shape=tile_shape, dtype=dt)),
                                   lowest), "t")
        higher = emitter.define(call("combine", high, tile, combine="max"), "high")
        shift = emitter.define(finite(higher), "shift")
        emitter.emit(Assign((summed,), Bin("+", Bin("*", summed, exp(Bin("-", high, shift))),
                                           exp(Bin("-", tile, shift)))))
        emitter.emit(Assign((high,), higher))
        emitter.block = self.body
        row_max = emitter.define(call("reduce", high, combine="max", axis=1, drop="n", nan="propagate"), "total")
        rescaled = Bin("*", summed, exp(Bin("-", high, finite(row_max))))
        row_sum = emitter.define(call("reduce", rescaled, combine="sum", axis=1, drop="n"), "total")
        emitter.reduced[id(top)] = row_max
        emitter.reduced[id(total)] = emitter.define(call("where", Bin("==", row_max, lowest), Lit(math.nan), row_sum))
        self.close_loop()

    @staticmethod
    def nan_option(r: Node) -> dict:
        """A max or min keeps a NaN it meets (as torch's do)."""
        return {"nan": "propagate"} if r.op in (Op.MAX, Op.MIN) else {}

    def accumulate(self, r: Node, start_value, acc_dt, acc: Var, arg: Var | None) -> None:
        """Fold the chunk's values of `r`'s input into its accumulator (and, for an arg reduction, the
        column of the best)."""
        emitter = self.emitter
        value, _ = emitter.value(r.inputs[0], self.full_index())
        tile = emitter.define(call("where", self.mask,
                                   Bin("+", value, call("zeros", shape=(BLOCK_M, BLOCK_N), dtype=acc_dt)),
                                   start_value), "t")
        combine = r.op.label
        if "n" in acc.varies:  # elementwise into the tile of partial results
            if r.op is Op.SUM:
                folded = Bin("+", acc, tile)
            elif r.op is Op.PROD:
                folded = Bin("*", acc, tile)
            else:
                folded = call("combine", acc, tile, combine=combine)
            emitter.emit(Assign((acc,), folded))
        elif r.op is Op.SUM:
            emitter.emit(Assign((acc,), Bin("+", acc, call("reduce", tile, combine="sum", axis=1, drop="n"))))
        elif r.op is Op.PROD:
            emitter.emit(Assign((acc,), Bin("*", acc, call("reduce", tile, combine="prod", axis=1, drop="n"))))
        elif r.op in (Op.MAX, Op.MIN):
            part = call("reduce", tile, combine=combine, axis=1, drop="n", **self.nan_option(r))
            emitter.emit(Assign((acc,), call("combine", acc, part, combine=combine)))
        else:  # the chunk's best (value, column), then the best of it and the rows' best so far
            columns = emitter.define(Bin("+", self.cols, call("zeros", shape=(BLOCK_M, BLOCK_N),
                                                              dtype=dtypes.int32)), "j")
            best, where = Var(emitter.fresh("b"), acc.varies), Var(emitter.fresh("w"), acc.varies)
            emitter.emit(Assign((best, where), call("reduce2", tile, columns, combine=combine, axis=1, drop="n")))
            emitter.emit(Assign((acc, arg), call("combine", acc, arg, best, call("cast", where, dtype=dtypes.int64),
                                                 combine=combine)))


PATTERN = Pattern("rows", ((Stage.CLAIM, pull_reductions),), lowers=lambda k: k.kind is KernelKind.REDUCE,
                  lower=lambda ctx, kernel: [lower_rows(ctx, kernel)])
