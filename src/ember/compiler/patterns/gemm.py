"""The GEMM pattern: a generated matmul (a 2-d or batched `MATMUL` of a GEMM dtype) with the cheap ops that produce
its operands applied to the tiles as they are loaded (its mainloop, or prologue; an operand's sum along K too, the
bias gradient beside a weight gradient), and an epilogue: any pointwise DAG over the accumulator, with broadcast
and full-size loads, several outputs and reductions of its rows or columns (added across tiles atomically).

Planning: an operand whose producers cost more in the mainloop than storing them is stored (`store_operands`);
a GEMM kernel takes the pointwise kernels over its output that read it and the reductions of its operands and
epilogue (`fuse_gemms`); each GEMM kernel carries its split form, the same nodes with a vendor matmul
(`plan_splits`, payload `SplitForm`). Lowering: a tiled matmul (`lower_gemm`); a GEMM whose K splits runs it in
programs that each walk a share of K storing partial tiles, then a finishing function adding them and running
the epilogue (`finishing_function`, which the MLP pattern shares for its weight gradients and row sums).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ember import dtypes
from ember.compiler.emit import (
    GEMM_BLOCK,
    ZERO,
    Context,
    Emitter,
    Index,
    identity,
    next_pow2,
    padded_width,
    program_index,
    scratch_buffer,
    widened,
)
from ember.compiler.fused import (
    FULL,
    MAINLOOP,
    OTHER,
    ROW,
    FusedKernel,
    KernelKind,
    Pattern,
    Payload,
    Stage,
    dot_kind,
    mib,
    operand_sums,
    summed_operand,
    summed_output,
    under_reshapes,
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
from ember.compiler.kernel_graph import KernelGraph
from ember.compiler.planner import Planner
from ember.ir import Kind, Node, Op


# -- planning ------------------------------------------------------------------------------------------------------
def store_operands(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """A generated GEMM's operand whose producers the cost model rejects in its mainloop is stored."""
    for n in planner.nodes:
        if planner.is_gemm(n):
            for position, operand in enumerate(n.inputs):
                if not _prologue_pays(planner, n, position, operand):
                    planner.stored.add(id(planner.view_base(operand)))
    return kernels


def fuse_gemms(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """GEMM kernels take the pointwise kernels over their output space that read them (epilogues), the
    reductions of their epilogues' rows or columns, and the reductions of their operands along K (mainloop)."""
    graph = KernelGraph(planner, kernels)
    refs = graph.refs
    # a reduction that sums some GEMM's operand along K goes to that GEMM's mainloop (where the bias gradient
    # of a training step belongs: beside its weight gradient), not to the epilogue of the GEMM producing it
    cores = [k.core for k in kernels if k.core is not None]
    summing = {id(r) for k in kernels if k.kind is KernelKind.REDUCE for r in k.reductions
               if any(summed_operand(core, r) is not None for core in cores)}
    for gemm in [k for k in kernels if k.core is not None]:
        taken = True
        while taken:  # an epilogue may read another epilogue's output: repeat until none joins
            taken = False
            for other in list(kernels):
                if other is gemm or not _joins(planner, gemm, other, refs, summing):
                    continue
                same_space = other.space == gemm.space
                if not (planner.mergeable(gemm, other, graph) if same_space else graph.acyclic(gemm, other)):
                    continue
                graph.absorb(gemm, other)
                if other.kind is KernelKind.REDUCE:
                    gemm.levels.update({id(o): MAINLOOP for o in other.outputs})
                    refs[id(gemm)] = planner.references(gemm)
                kernels.remove(other)
                taken = True
        core = gemm.core
        read_elsewhere = any(id(core) in r for key, r in refs.items() if key != id(gemm))
        if id(core) not in planner.output_ids and not read_elsewhere and len(gemm.outputs) > 1:
            gemm.outputs.remove(core)  # the accumulator feeds the epilogue in registers only
            del gemm.levels[id(core)]
            planner.stored.discard(id(core))
    return kernels


def _joins(planner: Planner, gemm: FusedKernel, other: FusedKernel, refs: dict, summing: set[int]) -> bool:
    """Whether `other` is an epilogue of `gemm` (pointwise over its output, reading it) or the
    sum of one of its operands along K (`summing`: the reductions that sum some GEMM's operand along K)."""
    if other.kind is KernelKind.POINTWISE and other.space == gemm.space:
        return any(id(o) in refs[id(other)] for o in gemm.outputs)
    if other.kind is KernelKind.POINTWISE and math.prod(other.space) == math.prod(gemm.space):
        return _reads_in_order(planner, other, gemm)
    if other.kind is not KernelKind.REDUCE:
        return False
    if not all(under_reshapes(o) in other.reductions for o in other.outputs):
        return False
    if len(other.reductions) == 1 and summed_operand(gemm.core, other.reductions[0]) is not None:
        return True
    if any(id(r) in summing for r in other.reductions):
        return False
    return _reduces_tiles(planner, other, gemm, refs)


def _reduces_tiles(planner: Planner, kernel: FusedKernel, gemm: FusedKernel, refs: dict) -> bool:
    """Whether a reduce kernel sums (or takes the max or min of) rows or columns of the GEMM's epilogue
    values, each reduction on its own: every tile then reduces its part, combined atomically, which
    needs a float32 result (the accumulator's type)."""
    if kernel.space != gemm.space or len(gemm.space) != 2 or kernel.axes not in ((0,), (1,)):
        return False
    if not any(id(o) in refs[id(kernel)] for o in gemm.outputs):
        return False
    for r in kernel.reductions:
        if r.op not in (Op.SUM, Op.MAX, Op.MIN) or r.dtype is not dtypes.float32:
            return False
        if planner.cone_reaches(r.inputs[0], set(map(id, kernel.reductions))):
            return False  # one reduction needs another's result (softmax, variance): two passes
    return True


def _reads_in_order(planner: Planner, kernel: FusedKernel, gemm: FusedKernel) -> bool:
    """Whether a pointwise kernel over a reshape of the GEMM's output space reads the GEMM's results,
    and only through pointwise ops and reshapes: element i of its space reads element i of theirs
    (a linear layer over [batch, tokens, features], whose GEMM runs over [batch x tokens, features])."""
    results = {id(o): gemm.levels[id(o)] for o in gemm.outputs}
    reaches, seen = False, set()
    stack = [(o, True) for o in kernel.outputs]
    while stack:
        n, in_order = stack.pop()
        if (id(n), in_order) in seen:
            continue
        seen.add((id(n), in_order))
        if id(n) in results and n not in kernel.outputs:
            if not in_order or results[id(n)] != FULL:
                return False
            reaches = True
            continue
        if n not in kernel.outputs and (id(n) in planner.stored or n.op is Op.BUFFER):
            continue
        keeps = in_order and (n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) or n.op is Op.RESHAPE)
        stack.extend((i, keeps) for i in n.inputs)
    return reaches


def _prologue_pays(planner: Planner, mm: Node, position: int, operand: Node) -> bool:
    """Whether a GEMM computes an operand's producers in its mainloop rather than loading it stored.
    The decision is kept for explain."""
    base = planner.view_base(operand)
    if base.op is Op.BUFFER or id(base) in planner.stored:
        return True  # a view of a stored value: strided loads, nothing to decide
    ops, reads = planner.cone(operand)
    if ops == 0:
        return True
    m, k = mm.inputs[0].shape[-2:]
    n = mm.shape[-1]
    costs = planner.costs
    passes = -(-(n if position == 0 else m) // costs.tile)
    own = operand.numel * operand.dtype.itemsize
    read = sum(min(r.numel, operand.numel) * r.dtype.itemsize for r in reads)
    work = ops * operand.numel * passes / costs.alu_rate
    dot = 2 * mm.numel * k / costs.dot(dot_kind(mm.dtype, planner.context))
    share = work / dot if dot else 0.0
    storing = 2 * own / costs.bandwidth + costs.launch_seconds  # a producer kernel's write, the GEMM's read of it
    pays = False
    if read > 2 * own:
        verdict = (f"stored: recomputing it would read {mib(read)} to save writing and reading "
                   f"{mib(own)}")
    elif share > costs.prologue_share and work > storing:
        verdict = (f"stored: {ops} ops x {passes} tile passes would take {share:.0%} of the dot's time "
                   f"(at most {costs.prologue_share:.0%}) and more than storing it costs")
    else:
        pays = True
        verdict = (f"recomputed in the mainloop: reads {mib(read)} instead of writing and reading "
                   f"{mib(own)}; {ops} ops x {passes} tile passes, {share:.0%} of the dot's time")
    planner.decisions[id(mm)].append(f"operand {position} ({ops} ops over {list(operand.shape)}) {verdict}")
    return pays


@dataclass(eq=False)
class SplitForm(Payload):
    """A generated GEMM kernel's vendor form: the same nodes planned with the matmul as a vendor call (operands
    stored, epilogue in kernels of its own), which the runtime times against the fused kernel and runs when it
    is faster; `stored`: the ids of the intermediates it stores, at compile time (a plan loaded from disk has other
    nodes: the compiled kernel's `workspace` holds them)."""

    kernels: list[FusedKernel] = field(default_factory=list)
    stored: set[int] = field(default_factory=set)

    def stored_nodes(self) -> list[Node]:
        return [n for k in self.kernels for n in k.outputs if id(n) in self.stored]


def plan_splits(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """Each generated GEMM kernel's split form, its reads the split plan's inputs."""
    for gemm in kernels:
        if gemm.core is not None:
            nodes = sorted(gemm.reads + gemm.covers, key=lambda n: planner.position[id(n)])
            split, stored = planner.plan_apart(nodes, list(gemm.outputs), {id(n) for n in gemm.reads})
            gemm.payload = SplitForm(split, stored - {id(o) for o in gemm.outputs})
    return kernels


# -- lowering ------------------------------------------------------------------------------------------------------
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
    _epilogue(ctx, kernel, Emitter(ctx, kernel, body), tile, acc, sums, batch_dims, before_loop, mainloop.count,
              halves=_heavy_epilogue(kernel))
    function = ctx.function("", body, {"BLOCK_M": 0, "BLOCK_N": 0, "BLOCK_K": 0, "GROUP_M": 0}, 0, 4)
    function.gemm = (math.prod(batch), m, n, k)
    function.layout = layout_a + layout_b
    function.precision = dot
    return [function]


def _epilogue(ctx: Context, kernel: FusedKernel, epilogue: Emitter, tile: _Tile, acc: Var, sums: dict[int, Var],
              batch_dims: tuple[Expr, ...] = (), unravelled: dict | None = None, count: int = 0,
              halves: bool = False) -> None:
    """A GEMM kernel's epilogue over its output tile, the core's value in `acc` and its operand sums in `sums`:
    the sums' outputs, then the outputs (stored from registers) and the epilogue's reductions across tiles, over
    the whole tile or (`halves`) over its left half and then its right one."""
    core = kernel.core
    summed = {id(r): summed_operand(core, r) for r in operand_sums(kernel)}
    epilogue.count = count
    for o in kernel.outputs:  # one row of programs stores what every row of them summed
        r = summed_output(kernel, o)
        if r is None or id(r) not in summed:
            continue
        position, keep = tile.keeps(summed[id(r)])
        pointer = ctx.param(ParamKind.WRITE, o, "out")  # a reshape of the sum: the same positions
        epilogue.emit(Effect(call("store", Bin("+", pointer, position), call("cast", sums[id(r)], dtype=o.dtype),
                                  mask=keep)))
    if not halves:
        _epilogue_tile(ctx, kernel, epilogue, tile, acc, summed, batch_dims, unravelled, GEMM_TILE)
        return
    parts = (Var(f"acc{epilogue.tag}_left", acc.axes), Var(f"acc{epilogue.tag}_right", acc.axes))
    epilogue.emit(Assign(parts, call("halves", acc, shape=(GEMM_BLOCK["rm"], 2, HALF_N))))
    rn = tile.rn
    for h, part in enumerate(parts):
        em = Emitter(ctx, kernel, epilogue.block, epilogue.tag)
        em.count, em.big, em.blocks = epilogue.count, epilogue.big, {**GEMM_BLOCK, "rn": HALF_N}
        if h == 0:
            rn = em.bind(f"rn{em.tag}_0", Bin("+", Bin("*", widened(em, tile.pid_n), GEMM_BLOCK["rn"]),
                                              Range(HALF_N, 1, 2)))
        else:
            rn = em.bind(f"rn{em.tag}_{h}", Bin("+", rn, HALF_N))
        half = _Tile(tile.pid_m, tile.pid_n, tile.rm, rn, tile.mask_m, em.bind(f"mask_n{em.tag}_{h}",
                     Bin("<", rn, tile.N)), tile.M, tile.N)
        _epilogue_tile(ctx, kernel, em, half, part, summed, batch_dims, unravelled, (GEMM_BLOCK["rm"], HALF_N))
        epilogue.count, unravelled = em.count, em.unravelled  # the rows' positions serve both halves


def _epilogue_tile(ctx: Context, kernel: FusedKernel, epilogue: Emitter, tile: _Tile, acc: Var, summed: dict,
                   batch_dims: tuple[Expr, ...], unravelled: dict | None, shape: tuple) -> None:
    """The outputs and reductions of the epilogue over one tile of the output (`shape`), `acc` the core's value
    there."""
    core = kernel.core
    rm, rn, mask_m, mask_n = tile.rm, tile.rn, tile.mask_m, tile.mask_n
    mask = Var("mask", frozenset({"rm", "rn"}))
    epilogue.unravelled = dict(unravelled or {})  # names defined inside a mainloop are out of scope after it
    epilogue.accumulator = acc
    epilogue.mask_parts = {mask: {"rm": mask_m, "rn": mask_n}}
    epilogue.tile_axes = frozenset({"rm", "rn"})
    epilogue.bind("mask", Bin("&", mask_m, mask_n))
    for o in kernel.outputs:
        if summed_output(kernel, o) is None:
            epilogue.store(o, _epilogue_index(epilogue, core, o.shape, batch_dims, rm, rn, mask), shape)
    at = Index((*batch_dims, rm, rn), None, mask, FULL)
    _epilogue_reductions(ctx, kernel, epilogue, at, [r for r in kernel.reductions if id(r) not in summed],
                         {1: (rm, mask_m), 0: (rn, mask_n)}, shape)


# Half a GEMM tile's columns: an epilogue of many operations (fc1's bias and tanh GELU storing two
# outputs, H200, 8192 x 3072 x 768 in bfloat16) runs over one half of the tile and then the other, its values for
# half the columns live at a time: 117 us against 148 (128 x 128 tiles), 126 against 357 (128 x 256: the whole
# tile's epilogue spilled 508 registers); the bare GEMM takes 68-72 us.
HALF_N = Block("(BLOCK_N // 2)", "rn")

HEAVY_EPILOGUE = 4  # operations an epilogue computes per element from which it runs by halves


def _heavy_epilogue(kernel: FusedKernel) -> bool:
    """Whether the epilogue holds enough values per element (operations, outputs) to run by halves of the tile."""
    computed = sum(1 for n in kernel.epilogue if n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY))
    stored = sum(1 for o in kernel.outputs if summed_output(kernel, o) is None)
    return computed + stored >= HEAVY_EPILOGUE


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
    """A sum over an MLP kernel's rows that it absorbed (`patterns.mlp.planning.absorb_sums`): the row kernel whose
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
                         kept: dict[int, tuple[Var, Var]], shape: tuple) -> None:
    """Rows or columns of an epilogue value reduced across tiles: each program reduces its tile and
    combines the result atomically into the output, which the runtime fills with the identity first."""
    for r in reductions:
        (axis,) = r.attrs["axes"]
        value, dt = epilogue.value(r.inputs[0], at)
        tile = epilogue.define(call("where", at.mask, Bin("+", value, call("zeros", shape=shape, dtype=dt)),
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


PATTERN = Pattern("gemm", ((Stage.STORE, store_operands), (Stage.CLAIM, fuse_gemms), (Stage.FINISH, plan_splits)),
                  lowers=lambda k: k.kind is KernelKind.MATMUL and k.core is not None, lower=lower_gemm)
