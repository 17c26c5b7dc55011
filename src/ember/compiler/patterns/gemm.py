"""The GEMM pattern's lowering: a tiled matmul core with cheap ops fused into its operand loads (prologues) and
its epilogue (pointwise ops, reductions of the tile by atomics), and split-K: programs that each walk a share
of K storing partial tiles, then a finishing function adding them and running the epilogue (`lower_gemm`,
`finishing_function`, which the MLP pattern shares for its weight gradients and row sums).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember import dtypes
from ember.compiler.emit import (
    GEMM_BLOCK,
    ZERO,
    Context,
    Emitter,
    Index,
    identity,
    next_pow2,
    program_index,
    scratch_buffer,
    widened,
)
from ember.compiler.fusion import (
    FULL,
    OTHER,
    ROW,
    FusedKernel,
    operand_sums,
    padded_width,
    summed_operand,
    summed_output,
)
from ember.compiler.kernel import (
    Assign,
    Bin,
    Block,
    Branch,
    Effect,
    Expr,
    Function,
    Lit,
    Loop,
    ParamKind,
    Range,
    Var,
    call,
)
from ember.ir import Node, Op


def lower_gemm(ctx: Context, kernel: FusedKernel) -> list[Function]:
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
        batch_dims = mainloop.unravel(mainloop.bind("batch", widened(mainloop, call("program_id", axis=1))),
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
    start = widened(mainloop, loop.var)  # K times a row's stride may pass int32 in a big kernel
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
        return [first, finishing_function(ctx, [kernel], splits, [partials], "")]
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
        pointer = ctx.param(ParamKind.WRITE, o, "out")  # a reshape of the sum: the same positions
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


def finishing_function(ctx: Context, kernels: list[FusedKernel], splits: int, partials: list[dict], suffix: str,
               sums: list[tuple[RowSum, Var]] = ()) -> Function:
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
    program = program_index(Emitter(ctx, first_kernel, body), name="program") if len(parts) > 1 else None
    branches, total = body, 0
    blocks = {"BLOCK_M": 1, "BLOCK_N": block_n, "SPLIT_BLOCK": min(next_pow2(splits), 8192 // block_n)}
    for j, (part, scratch) in enumerate(parts):
        is_sum = isinstance(part, RowSum)
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


def _finish_sum(ctx: Context, total: RowSum, splits: int, scratch: Var, body: list, tag: str) -> None:
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
    pid = program_index(emitter) if program is None else bind("pid", program)
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
    rm = bind("rm", Bin("+", Bin("*", widened(emitter, pid_m), GEMM_BLOCK["rm"]), Range(GEMM_BLOCK["rm"], 0, 2)))
    rn = bind("rn", Bin("+", Bin("*", widened(emitter, pid_n), GEMM_BLOCK["rn"]), Range(GEMM_BLOCK["rn"], 1, 2)))
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
        buffers[key] = scratch_buffer(ctx, emitter.kernel, key, splits * size)
        value = acc if key == "partial" else sums[key]
        emitter.emit(Effect(call("store", Bin("+", buffers[key], Bin("+", Bin("*", split, Lit(size)), position)),
                                 value, mask=mask)))
    return buffers


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


@dataclass
class RowSum:
    """A sum over an MLP kernel's rows that it absorbed (`fusion.Planner.absorb_sums`): the row kernel whose
    reduction it is, the value summed, the layer after which that value is computed, its column range, whether
    the sum keeps each column apart, and, once emitted, its accumulator."""

    kernel: FusedKernel
    value: Node
    ready: int
    column: int
    per_column: bool
    total: Var | None = None


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
                pointer = ctx.param(ParamKind.WRITE, o, "out")
                epilogue.emit(Effect(call("atomic", Bin("+", pointer, position), part, mask=keep,
                                          combine=r.op.label)))


GEMM_TILE = (GEMM_BLOCK["rm"], GEMM_BLOCK["rn"])


def epilogue_reduction_outputs(kernel: FusedKernel) -> list[tuple[Node, Op]]:
    """The outputs a GEMM kernel reduces into atomically, with their reductions: the runtime fills them
    with the reduction's identity before each launch."""
    sums = operand_sums(kernel)
    return [(o, r.op) for o in kernel.outputs if (r := summed_output(kernel, o)) is not None and r not in sums]
