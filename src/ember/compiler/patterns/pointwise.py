"""The pointwise pattern: elementwise work over one space, every value at one element of it (the kernels rooted
at stored values that no other pattern claims, merged and grouped by the generic planner), segmented launches
of such kernels, and scatter-add kernels. It has no planner step of its own.

Lowering: one program per block of elements of the kernel's space (`lower_pointwise`), several pointwise kernels
as ranges of programs of one launch (`lower_segmented`), and scatter-add kernels (an initialising function, then
atomic adds at checked positions: `lower_scatter_add`).
"""

from __future__ import annotations

import math

from ember import dtypes
from ember.compiler.emit import (
    BLOCK,
    HEAVY_BLOCK,
    UNKNOWN_MULTIPROCESSORS,
    ZERO,
    Context,
    Emitter,
    Index,
    flat_exprs,
    next_pow2,
    program_index,
)
from ember.compiler.fused import FULL, OTHER, POINTWISE_HEAVY, FusedKernel, KernelKind, Pattern, element_nodes
from ember.compiler.kernel import (
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
    add,
    call,
)
from ember.compiler.rewrite import hoist_loads

POINTWISE_BLOCK = 1024


def _pointwise_body(ctx: Context, kernel: FusedKernel, block: list, tag: str, first_block: Expr,
                    axis: int | None, tile: Expr = BLOCK, cols: int | None = None) -> None:
    """A pointwise kernel's statements for the programs from `first_block` on: each program computes a flat block
    of elements (`tile` of them), or (`cols`) a tile of ROWS rows by COLS columns of the innermost axis."""
    emitter = Emitter(ctx, kernel, block, tag)
    if cols is not None:
        _row_tile_body(ctx, kernel, emitter, first_block, cols)
        return
    start = call("cast", first_block, dtype=dtypes.int64) if emitter.big else first_block
    offs = emitter.bind(f"offs{tag}", Bin("+", Bin("*", start, tile), Range(tile)))
    mask = emitter.bind(f"mask{tag}", Bin("<", offs, ctx.size(_threads(kernel, axis))))
    if axis is None:
        for out in kernel.outputs:
            emitter.store(out, Index(None, offs, mask, FULL), (tile,))
        return
    # each element of offs is a position along the other axes, computed for every position along `axis`: what
    # does not vary along it is memoized under the same index, so emitted once
    other = emitter.unravel(offs, kernel.space[:axis] + kernel.space[axis + 1:])
    for position in range(kernel.space[axis]):
        at = Index(other[:axis] + (Lit(position),) + other[axis:], None, mask, FULL)
        for out in kernel.outputs:
            emitter.store(out, at, (tile,))


def _row_tile_body(ctx: Context, kernel: FusedKernel, emitter: Emitter, pid: Expr, cols: int) -> None:
    """A program's tile of ROWS rows by `cols` (COLS) columns of the innermost axis, which `cols` divides: the
    positions along it are a contiguous range, and the rows' positions along the other axes are computed once per
    row. Outputs of the space's shape are computed at the row's and the column's positions (a reshape beneath them
    then splits the column alone), others at the flat position, whose unravelling is the same."""
    *outer, inner = kernel.space
    tiles = inner // cols
    start = call("cast", pid, dtype=dtypes.int64) if emitter.big else pid
    row = emitter.bind("row", Bin("+", Bin("*", Bin("//", start, Lit(tiles)), ROWS), Range(ROWS, 0, 2)))
    col = emitter.bind("col", Bin("+", Bin("*", Bin("%", start, Lit(tiles)), COLS), Range(COLS, 1, 2)))
    offs = emitter.bind("offs", Bin("+", Bin("*", row, Lit(inner)), col))
    mask = emitter.bind("mask", Bin("<", row, ctx.size(math.prod(outer))))
    dims = (*emitter.unravel(row, tuple(outer)), col)
    emitter.unravelled[(offs, tuple(kernel.space))] = dims
    for out in kernel.outputs:
        at = Index(dims if out.shape == kernel.space else None, offs, mask, FULL)
        emitter.store(out, at, (ROWS, COLS))


# A pointwise kernel whose flat form divides positions by a size that is not a power of two (unravelling them
# through a permutation, a concatenation) takes tiles of rows instead, where its innermost size is divisible by
# ROW_TILE_MIN or more: the flat form's divided positions are not provably contiguous to the compiler, so its loads
# go element by element. H200, GPT-2's q, k and v gradients ((8, 12, 1024, 64) each, bfloat16) concatenated into
# (8, 1024, 2304): 63 us flat (1.2 TB/s), 24-25 us in tiles of 4-32 rows by 128-512 columns (3.0-3.15 TB/s; a
# contiguous copy of the result, 3.32 TB/s).
ROWS, COLS = Block("ROWS", "r"), Block("COLS", "c")

ROW_TILE_MIN = 64


def row_tile(kernel: FusedKernel, flat: list, block: int) -> int | None:
    """The columns (a power of two dividing the innermost size, at most `block`) of the row tiles a pointwise
    kernel's programs take, or None: flat blocks, where its flat form (the statements `flat`) divides by powers of
    two only."""
    *outer, inner = kernel.space or (1,)
    cols = min(inner & -inner, block)
    if cols < ROW_TILE_MIN or cols == inner or math.prod(outer) == 1:  # (one row: the flat form divides nothing)
        return None
    divisors = {e.b.value for s in flat for top in flat_exprs(s) for e in _subexpressions(top)
                if isinstance(e, Bin) and e.op in ("%", "//") and isinstance(e.b, Lit)}
    return cols if any(isinstance(d, int) and d & (d - 1) for d in divisors) else None


def _subexpressions(e: Expr) -> list[Expr]:
    return [e, *(x for c in e.children() for x in _subexpressions(c))]


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


def lower_pointwise(ctx: Context, kernel: FusedKernel) -> Function:
    body: list = []
    axis = unrolled_axis(ctx, kernel)
    numel = _threads(kernel, axis)
    block = pointwise_block(numel, element_nodes(kernel.covers), ctx.settings.multiprocessors)
    pid = program_index(Emitter(ctx, kernel, body))
    params, names = list(ctx.params), dict(ctx.names)
    _pointwise_body(ctx, kernel, body, "", pid, axis)
    cols = row_tile(kernel, body, block) if axis is None else None
    if cols is not None:  # the flat form and its parameters give way to the row tiles'
        ctx.params[:], ctx.names = params, names
        del body[1:]
        _pointwise_body(ctx, kernel, body, "", pid, axis, cols=cols)
    if cols is None:
        grid, constexprs = -(-numel // block), {"BLOCK": block}
    else:  # whole tiles along the innermost axis, the last tile of rows masked (no more rows than there are)
        rows = min(block // cols, next_pow2(numel // kernel.space[-1]))
        grid, constexprs = -(-numel // kernel.space[-1] // rows) * (kernel.space[-1] // cols), {"ROWS": rows,
                                                                                              "COLS": cols}
    if _latency_bound(ctx, grid):
        body[:] = hoist_loads(body)
    return ctx.function("", body, constexprs, grid, 4)


def _latency_bound(ctx: Context, programs: int) -> bool:
    """Whether a kernel's programs are too few to fill the GPU: no other programs' warps hide a load's
    latency, so each load paid in turn adds up (an optimizer's update of a few small tensors)."""
    return programs < (ctx.settings.multiprocessors or UNKNOWN_MULTIPROCESSORS)


POINTWISE_PROGRAMS_PER_SM = 4  # a small kernel's programs shrink (to 128 elements, one per thread) to fill the GPU


def pointwise_block(numel: int, nodes: int, multiprocessors: int) -> int:
    """Elements per program of a pointwise kernel computing `nodes` nodes at each of `numel` elements."""
    block = POINTWISE_BLOCK if nodes <= POINTWISE_HEAVY else POINTWISE_BLOCK // 4
    while block > 128 and multiprocessors and -(-numel // block) < POINTWISE_PROGRAMS_PER_SM * multiprocessors:
        block //= 2
    return block


def lower_segmented(ctx: Context, kernel: FusedKernel) -> Function:
    """Many independent pointwise kernels in one launch: program ids are split into ranges. Each segment's
    programs take as many elements as the segment would alone in a kernel of the launch's size: a heavy one
    (an image sampling's, or an optimizer's update of a bias computing its step's factors) takes fewer, and does
    not shrink the others' (a large parameter's update, whose loads then move whole vectors)."""
    body: list = []
    pid = program_index(Emitter(ctx, kernel, body))
    total = 0
    branches = body
    axes = [unrolled_axis(ctx, part) for part in kernel.segments]
    threads = sum(_threads(part, a) for part, a in zip(kernel.segments, axes))
    sizes = [pointwise_block(threads, element_nodes(part.covers), ctx.settings.multiprocessors)
             for part in kernel.segments]
    constexprs = {"BLOCK": max(sizes)}
    if min(sizes) < max(sizes):
        constexprs["BLOCK_HEAVY"] = min(sizes)
    for k, part in enumerate(kernel.segments):
        tile = BLOCK if sizes[k] == constexprs["BLOCK"] else HEAVY_BLOCK
        blocks = -(-_threads(part, axes[k]) // sizes[k])
        begin = total
        total += blocks
        bound = ctx.param(ParamKind.BOUND, total, "end")
        branch = Branch(Bin("<", pid, bound),
                        comment=f"segment {k}: {', '.join(o.op.label for o in part.outputs)} over {list(part.space)}")
        branches.append(branch)
        branches = branch.orelse
        first = pid if begin == 0 else Bin("-", pid, ctx.param(ParamKind.BOUND, begin, "end"))
        _pointwise_body(ctx, part, branch.body, f"_{k}", first, axes[k], tile)
        if _latency_bound(ctx, total):
            branch.body[:] = hoist_loads(branch.body)
    return ctx.function("", body, constexprs, total, 4)


def lower_scatter_add(ctx: Context, kernel: FusedKernel) -> list[Function]:
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
    pid = program_index(emitter)
    offs = emitter.bind("offs", Bin("+", Bin("*", pid, BLOCK), Range(BLOCK)))
    mask = emitter.bind("mask", Bin("<", offs, init_ctx.size(node.numel)))
    value, dt = emitter.value(base, Index(None, offs, mask, OTHER))
    pointer = init_ctx.param(ParamKind.WRITE, node, "out")
    copied = call("cast", Bin("+", value, call("zeros", shape=(BLOCK,), dtype=dt)), dtype=node.dtype)
    emitter.emit(Effect(call("store", Bin("+", pointer, offs), copied, mask=mask)))
    first = init_ctx.function("_init", copy_body, {"BLOCK": POINTWISE_BLOCK}, -(-node.numel // POINTWISE_BLOCK), 4)
    body: list = []
    emitter = Emitter(ctx, init, body)
    pid = program_index(emitter)
    offs = emitter.bind("offs", Bin("+", Bin("*", pid, BLOCK), Range(BLOCK)))
    mask = emitter.bind("mask", Bin("<", offs, ctx.size(index.numel)))
    at = Index(None, offs, mask, OTHER)
    picked, _ = emitter.value(index, at)
    addend, _ = emitter.value(src, at)
    dims = list(emitter.dims(at, index.shape))
    valid = emitter.bind("valid", emitter.in_range(picked, node.shape[axis]))
    dims[axis] = emitter.clamp(picked, node.shape[axis])
    if node.numel == 1:  # every element adds at the one address: a block of it, as the values are a block
        target = call("zeros", shape=(BLOCK,), dtype=dtypes.int32)
    else:
        target = emitter.linear(Index(tuple(dims), None, mask, OTHER), node.shape)
    pointer = ctx.param(ParamKind.WRITE, node, "out")
    # an index out of range adds nothing (at a clamped address, so the access stays in bounds)
    added = call("cast", call("where", valid, addend, ZERO), dtype=node.dtype)
    emitter.emit(Effect(call("atomic", add(pointer, target), added, mask=mask, combine="sum")))
    second = ctx.function("_scatter", body, {"BLOCK": POINTWISE_BLOCK}, -(-index.numel // POINTWISE_BLOCK), 4)
    return [first, second]


def lower(ctx: Context, kernel: FusedKernel) -> list[Function]:
    if kernel.kind is KernelKind.SCATTER_ADD:
        return lower_scatter_add(ctx, kernel)
    return [(lower_segmented if kernel.kind is KernelKind.SEGMENTED else lower_pointwise)(ctx, kernel)]


PATTERN = Pattern("pointwise", (), lowers=lambda k: k.kind in (KernelKind.POINTWISE, KernelKind.SEGMENTED,
                                                                KernelKind.SCATTER_ADD), lower=lower)
