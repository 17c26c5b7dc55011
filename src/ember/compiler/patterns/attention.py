"""The attention pattern: softmax(q @ kᵀ · scale, masked) @ v as one kernel (ATTENTION, ember/ops/attention.py), and
its backward as one kernel of two launches (ATTENTION_GRAD).

Planning: an attention node's results (its output and its rows' log-sum-exp; the gradients to q, k and v) are
computed by one kernel wherever they are pending together: the kernels rooted at the results of one node's inputs
and attributes become one (`group_results`). Its operands are views of stored values (the planner stores the base
of each), so a split of a QKV projection, a head transpose or a broadcast is folded into the kernel's loads.

Lowering (as FlashAttention-2 computes it):
- forward: a program per block of BLOCK_M queries of one head walks the keys and values in tiles of BLOCK_N, the
  scores of a tile in registers (in base 2: exp2 of scores scaled by log2(e)), the row maximum and sum updated
  online, the weighted values accumulated and rescaled; the L x S scores are never stored. Causal: the tiles past
  a block's last query are not visited. It stores the output and, where the backward wants it, each row's
  log-sum-exp. Dropout multiplies the weights after their row sum, by a factor computed from the counter-based
  generator at each score's position (the backward computes the same).
- backward: the first launch holds a block of keys and values per program and walks the queries, computing the
  weights again from the stored log-sum-exp (dV += Pᵀ dO, dK += dSᵀ Q); the second holds a block of queries and walks
  the keys (dQ += dS K), where dS = P · (dO Vᵀ - rowsum(dO · O)) and the row sums are an input, a row reduction of
  the planner's own.

Tiles: each launch's block sizes, warps and pipeline stages are one of a few candidates (CANDIDATES, the measured
default first), all served by one source: the blocks are constexprs, the programs per head are computed from them,
and what the source decides from a block size (which loads are masked, which causal spans are walked) holds for
every candidate. The runtime times the candidates on a launch's first run on a GPU and keeps the fastest
(runtime/launcher.py, `_TunedLaunch`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ember import dtypes
from ember.compiler.emit import ZERO, Context, Emitter, Index, both, next_pow2, widened
from ember.compiler.fused import FULL, OTHER, FusedKernel, KernelKind, Pattern, Stage
from ember.compiler.kernel import (
    Assign,
    Bin,
    Block,
    Effect,
    Expr,
    Function,
    LaunchConfig,
    Lit,
    Loop,
    ParamKind,
    Range,
    Var,
    add,
    call,
)
from ember.compiler.planner import Planner
from ember.ir import Node, Op

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_M, BLOCK_N = Block("BLOCK_M", "m"), Block("BLOCK_N", "n")  # queries, keys of a tile
BLOCK_D, BLOCK_E = Block("BLOCK_D", "d"), Block("BLOCK_E", "e")  # the head dims of q and k, of v


def group_results(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """One kernel for the results of one attention (its output and log-sum-exp; its three gradients)."""
    out, groups = [], {}
    for k in kernels:
        if k.kind is not KernelKind.ATTENTION:
            out.append(k)
            continue
        node = k.root
        key = (node.op, tuple(map(id, node.inputs)), tuple((a, v) for a, v in node.attrs.items() if a != "result"))
        if key in groups:
            groups[key].outputs.append(node)
            groups[key].levels[id(node)] = FULL
        else:
            groups[key] = k
            out.append(k)
    return out


class _Problem:
    """One attention's shapes and attributes, as its kernels see them."""

    def __init__(self, node: Node):
        self.q, self.k, self.v = node.inputs[:3]
        if node.op is Op.ATTENTION_GRAD:
            self.do, self.lse, self.delta = node.inputs[3:6]
        extra = node.inputs[6 if node.op is Op.ATTENTION_GRAD else 3:]
        self.mask = extra[0] if node.attrs["mask"] is not None else None
        self.dropout = node.attrs["dropout"]
        self.draws = extra[-1] if self.dropout > 0 else None  # a RAND leaf, computed where it is read
        self.additive = node.attrs["mask"] == "add"
        self.causal, self.safe, self.scale = node.attrs["causal"], node.attrs["safe"], node.attrs["scale"]
        self.batch = self.q.shape[:-2]
        self.heads = math.prod(self.batch)
        self.length, self.width = self.q.shape[-2:]
        self.keys, self.v_width = self.k.shape[-2], self.v.shape[-1]
        self.dtype = self.q.dtype

    def blocks(self, m: int, n: int) -> dict[str, int]:
        """The tile's block sizes: at most the problem's (a power of two of at least 16), the head dims padded."""
        def edge(block: int, size: int) -> int:
            return max(16, min(block, next_pow2(size)))
        return {"BLOCK_M": edge(m, self.length), "BLOCK_N": edge(n, self.keys),
                "BLOCK_D": max(16, next_pow2(self.width)), "BLOCK_E": max(16, next_pow2(self.v_width))}


class _Tiles:
    """The statements of one launch: its program's head and block, its loads and stores, and the scores of a tile
    of queries and keys as the forward and both backward loops compute them."""

    def __init__(self, ctx: Context, kernel: FusedKernel, launch: str):
        """The launch ("forward", "keys": dK and dV, "queries": dQ) of the attention `kernel` computes: its problem,
        the configurations its one source serves (see `configs`: the default first), and each program's head and
        the first position of the block it holds (of keys for "keys", else of queries)."""
        self.ctx, self.p = ctx, _Problem(kernel.root)
        problem = self.p
        self.configs = configs(ctx, problem, launch)
        self.constexprs = self.configs[0].constexprs  # the default's; the head dims' blocks are every candidate's
        self.largest = {name: max(c.constexprs[name] for c in self.configs) for name in self.constexprs}
        held = BLOCK_N if launch == "keys" else BLOCK_M
        self.body: list = []
        self.em = em = Emitter(ctx, kernel, self.body)
        em.blocks = {"m": BLOCK_M, "n": BLOCK_N, "d": BLOCK_D, "e": BLOCK_E}
        size = problem.keys if launch == "keys" else problem.length
        # computed from the constexpr block (so folded by Triton), not written: one source for every configuration
        programs = em.bind("programs", Bin("//", Bin("-", Bin("+", Lit(size), held), Lit(1)), held))
        pid = em.bind("pid", call("program_id", axis=0))
        block = em.bind("block", Bin("%", pid, programs))
        head = em.bind("head", widened(em, Bin("//", pid, programs)))
        self.head_dims = em.unravel(head, problem.batch) if problem.batch else ()
        self.first = em.bind("first", Bin("*", block, held))
        self.precision = {"precision": ctx.settings.dot_precision(problem.dtype)} \
            if problem.dtype is dtypes.float32 else {}

    # -- loads and stores ----------------------------------------------------------------------
    def positions(self, start: Expr, block: Block, axis: int, size: int, stem: str) -> tuple[Var, Expr | None]:
        """start + 0..block-1 laid along `axis` of a 2-d tile, and the mask of those within `size` (None: all)."""
        at = self.em.bind(stem, Bin("+", start, Range(block, axis, 2)))
        # every start is a multiple of the block: whole blocks stay within a size the block divides; the blocks are
        # powers of two, so a size the largest candidate's divides, every candidate's divides
        if size % self.largest[block.name] == 0:
            return at, None
        inside = self.em.bind(f"{stem}_ok", Bin("<", at, Lit(size)))
        return at, inside

    def tile(self, node: Node, rows: Var, rows_ok: Expr | None, width: int, block: Block) -> Var:
        """A [rows, block] tile of `node` (..., rows, width) in the problem's dtype, zero outside."""
        cols = Range(block, 1, 2)
        cols_ok = Bin("<", cols, Lit(width)) if width != self.constexprs[block.name] else None
        mask = both(*[m for m in (rows_ok, cols_ok) if m is not None]) if rows_ok is not None or cols_ok is not None \
            else None
        value, _ = self.em.operand(node, Index((*self.head_dims, rows, cols), None, mask, OTHER), self.p.dtype)
        return value

    def row_values(self, node: Node, rows: Var, rows_ok: Expr | None) -> Expr:
        """A float32 value per row of `node` (..., L), laid as `rows` are."""
        value, _ = self.em.value(node, Index((*self.head_dims, rows), None, rows_ok, OTHER))
        return value

    def store(self, node: Node, value: Expr, rows: Var, rows_ok: Expr | None, width: int | None = None,
              block: Block | None = None) -> None:
        """Store a tile of `node` (..., rows, width), or with `width` None one value per row of `node` (..., rows)."""
        dims: tuple[Expr, ...] = (*self.head_dims, rows)
        masks = [rows_ok] if rows_ok is not None else []
        if width is not None:
            cols = Range(block, 1, 2)
            dims += (cols,)
            if width != self.constexprs[block.name]:
                masks.append(Bin("<", cols, Lit(width)))
        offset = self.em.linear(Index(dims, None, None, OTHER), node.shape)
        tile = (self.em.blocks[next(iter(rows.axes))], block if width is not None else 1)
        if offset.axes != frozenset(d.axis for d in tile if isinstance(d, Block)):  # a size-1 dim: broadcast
            offset = Bin("+", offset, call("zeros", shape=tile, dtype=dtypes.int32))
        pointer = self.ctx.param(ParamKind.WRITE, node, "out")
        masked = {"mask": both(*masks)} if masks else {}
        self.em.emit(Effect(call("store", add(pointer, offset), call("cast", value, dtype=node.dtype), **masked)))

    # -- scores ----------------------------------------------------------------------------------
    def scores(self, a: Var, b: Var, queries: Var, queries_ok: Expr | None, keys: Var, keys_ok: Expr | None,
               shape: tuple[Block, Block], diagonal: bool) -> Var:
        """The scores of a tile in base 2, -inf where a key is not attended to: a @ bᵀ scaled (a [.., D] tile of
        queries and b of keys, or the other way round), masked, with `queries` and `keys` laid along the tile's
        axes."""
        em, p = self.em, self.p
        s = em.define(call("dot", a, call("trans", b), call("zeros", shape=shape, dtype=dtypes.float32),
                           **self.precision), "qk")
        s = em.define(Bin("*", s, Lit(p.scale * LOG2E, dtypes.float32)), "s")
        valid = [m for m in (queries_ok, keys_ok) if m is not None]
        if diagonal:
            valid.append(Bin("<=", keys, queries))
        if p.mask is not None:
            given, _ = em.value(p.mask, self.score_index(queries, queries_ok, keys, keys_ok))
            if p.additive:
                s = em.define(Bin("+", s, Bin("*", given, Lit(LOG2E, dtypes.float32))), "s")
            else:
                valid.append(given)
        if valid:
            s = em.define(call("where", both(*valid), s, Lit(-math.inf, dtypes.float32)), "s")
        return s

    def score_index(self, queries: Var, queries_ok: Expr | None, keys: Var, keys_ok: Expr | None) -> Index:
        """The index of a tile of scores in a (..., L, S) value (a mask, the dropout's draws), masked to the positions
        in range; the mask split by axis, so a value broadcast along one axis is loaded along the other alone."""
        em = self.em
        bounds = {axis: m for axis, m in (("m", queries_ok), ("n", keys_ok)) if m is not None}
        inside = None
        if bounds:
            inside = em.define(both(*bounds.values()), "inside")
            em.mask_parts[inside] = bounds
        return Index((*self.head_dims, queries, keys), None, inside, OTHER)

    def kept(self, queries: Var, queries_ok: Expr | None, keys: Var, keys_ok: Expr | None) -> Var | None:
        """The dropout's factor at each position of a tile: 1 / (1 - p) where the draw keeps the weight, else 0, as
        `dropout()` decides (draw >= p); None without dropout. The draws are the counter-based generator's at the
        positions' linear index, the same numbers forward and backward."""
        p, em = self.p, self.em
        if p.draws is None:
            return None
        draw, _ = em.value(p.draws, self.score_index(queries, queries_ok, keys, keys_ok))
        return em.define(call("where", Bin(">=", draw, Lit(p.dropout, dtypes.float32)),
                              Lit(1 / (1 - p.dropout), dtypes.float32), Lit(0.0, dtypes.float32)), "kept")

    def walk(self, spans: list[tuple[Expr, Expr, bool]], step: Block, body: Callable[[Var, bool, str], None]) -> None:
        """One loop over [start, stop) in steps of `step` per span, its body emitted by `body(position, diagonal,
        tag)`: `diagonal` where the causal mask cuts through the span's tiles (elsewhere every key is attended to,
        and the mask is not computed). What one loop computes is not read by the next (its names are its own)."""
        em = self.em
        memo, unravelled = dict(em.memo), dict(em.unravelled)
        for n, (start, stop, diagonal) in enumerate(spans):
            em.memo, em.unravelled = dict(memo), dict(unravelled)
            tag = "" if n == 0 else f"_{n}"
            loop = Loop(Var("start" + tag), start, stop, step)  # pipelined by the launch's stages
            em.emit(loop)
            em.block = loop.body
            body(loop.var, diagonal, tag)
            em.block = self.body
        em.memo, em.unravelled = memo, unravelled

    def spans(self, first: Var, held: Block, streamed: Block, size: int, before: bool) -> list[tuple[Expr, Expr, bool]]:
        """The spans a causal launch walks, for a program holding the block from `first` (of `held`) and streaming
        tiles of `streamed` over `size` positions: keys before the block's queries (`before`) or queries after the
        block's keys, whole tiles that need no mask, and the tiles the diagonal crosses; one masked span where the
        tiles do not line up with the block (the same for every candidate configuration, see `configs`)."""
        p, blocks = self.p, self.constexprs
        if not p.causal:
            return [(ZERO, Lit(size), False)]
        end = self.em.bind("end", call("minimum", Bin("+", first, held), Lit(size)))
        if before:  # keys 0 .. first-1 are attended to by every query of the block; then the diagonal
            if blocks[held.name] % blocks[streamed.name]:
                return [(ZERO, end, True)]
            middle = self.em.bind("middle", call("minimum", first, Lit(size)))
            return [(ZERO, middle, False), (middle, end, True)]
        begin = self.em.bind("begin", Bin("*", Bin("//", first, streamed), streamed))  # queries from the diagonal on
        if blocks[held.name] % blocks[streamed.name]:
            return [(begin, Lit(size), True)]
        return [(begin, end, True), (end, Lit(size), False)]

    def function(self, suffix: str) -> Function:
        """The launch's function: its default configuration, its alternatives, and its work (the multiply-adds of
        one of its dots over every head, whether timing the alternatives is worth it)."""
        self.em.block = self.body
        default, p = self.configs[0], self.p
        function = self.ctx.function(suffix, self.body, dict(default.constexprs), default.grid, default.num_warps)
        return dataclasses.replace(function, num_stages=default.num_stages, alternatives=tuple(self.configs),
                                   work=p.heads * p.length * p.keys * max(p.width, p.v_width))


# Candidate (BLOCK_M, BLOCK_N, warps, stages) per launch and widest head dim (padded): the forward's block of queries
# and tile of keys; the dK/dV launch's tile of queries and block of keys; the dQ launch's block of queries and tile of
# keys. The first of each list is the default, measured on an H200 (bfloat16, T 1024 and 4096, causal and not:
# benchmarks/RESULTS.md; 256 is not measured); the others are timed against it on a GPU (see configs). Every
# candidate's held block is at least its streamed tile, so a causal launch walks the same spans under each.
CANDIDATES = {
    "forward": {
        64: [(128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 3), (64, 32, 4, 4)],
        128: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3)],
        256: [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
    },
    "keys": {
        64: [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3)],
        128: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
        256: [(32, 64, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2), (64, 64, 8, 1)],
    },
    "queries": {
        64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 3)],
        128: [(128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
        256: [(64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
    },
}
NOMINAL_SHARED_MEMORY = 227 * 1024  # an H100's, where the device is not known


def configs(ctx: Context, p: _Problem, launch: str) -> list[LaunchConfig]:
    """The configurations one launch of problem `p` may run with, the default first (see CANDIDATES), each with
    its programs (a block of the held positions per program, for every head). A float32 problem halves the tile
    it streams; blocks are fitted to the problem (`_Problem.blocks`); a candidate's stages are dropped while its
    tiles overflow shared memory, and a candidate that overflows at one stage is dropped (never the default).
    Candidates the fitting made equal are kept once; for a causal problem, only those whose held block is a
    multiple of the streamed one where the default's is, so the source walks the same spans under each."""
    widest = max(16, next_pow2(max(p.width, p.v_width)))
    streamed, held = ("BLOCK_M", "BLOCK_N") if launch == "keys" else ("BLOCK_N", "BLOCK_M")
    size = p.keys if launch == "keys" else p.length
    limit = ctx.settings.shared_memory or NOMINAL_SHARED_MEMORY

    def shared(blocks: dict[str, int], stages: int) -> int:
        """Bytes of shared memory the tiles take: `stages` streamed tiles in flight beside the held block."""
        edge = blocks["BLOCK_D"] + blocks["BLOCK_E"]
        return (stages * blocks[streamed] + blocks[held]) * edge * p.dtype.itemsize

    def lined_up(config: LaunchConfig) -> bool:
        """Whether the streamed tiles line up with the held block (see `_Tiles.spans`)."""
        return config.constexprs[held] % config.constexprs[streamed] == 0

    chosen: list[LaunchConfig] = []
    for m, n, warps, stages in CANDIDATES[launch][min((w for w in CANDIDATES[launch] if w >= widest), default=256)]:
        if p.dtype.itemsize == 4:
            m, n = (m, n // 2) if launch != "keys" else (m // 2, n)
        blocks = p.blocks(m, n)
        while stages > 1 and shared(blocks, stages) > limit:
            stages -= 1
        config = LaunchConfig(blocks, -(-size // blocks[held]) * p.heads, warps, stages)
        if not chosen or config not in chosen and shared(blocks, stages) <= limit and (
                not p.causal or lined_up(config) == lined_up(chosen[0])):
            chosen.append(config)
    return chosen


def lower_attention(ctx: Context, kernel: FusedKernel) -> list[Function]:
    results = {o.attrs["result"]: o for o in kernel.outputs}
    if kernel.root.op is Op.ATTENTION:
        return [_forward(ctx, kernel, results.get("out"), results.get("lse"))]
    functions = []
    if "dk" in results or "dv" in results:
        functions.append(_key_grads(ctx, kernel, results.get("dk"), results.get("dv")))
    if "dq" in results:
        functions.append(_query_grad(ctx, kernel, results["dq"]))
    return functions


def _forward(ctx: Context, kernel: FusedKernel, out: Node | None, lse: Node | None) -> Function:
    t = _Tiles(ctx, kernel, "forward")
    p, em, first, f32 = t.p, t.em, t.first, dtypes.float32
    rows, rows_ok = t.positions(first, BLOCK_M, 0, p.length, "rows")
    q = t.tile(p.q, rows, rows_ok, p.width, BLOCK_D)
    m_i = em.bind("m_i", call("full", Lit(-math.inf, f32), shape=(BLOCK_M, 1), dtype=f32))
    l_i = em.bind("l_i", call("zeros", shape=(BLOCK_M, 1), dtype=f32))
    acc = em.bind("acc", call("zeros", shape=(BLOCK_M, BLOCK_E), dtype=f32))

    def step(start: Var, diagonal: bool, tag: str) -> None:
        keys, keys_ok = t.positions(start, BLOCK_N, 0, p.keys, "keys" + tag)
        cols, cols_ok = t.positions(start, BLOCK_N, 1, p.keys, "cols" + tag)
        k = t.tile(p.k, keys, keys_ok, p.width, BLOCK_D)
        s = t.scores(q, k, rows, rows_ok, cols, cols_ok, (BLOCK_M, BLOCK_N), diagonal)
        m_new = em.define(call("maximum", m_i, call("reduce", s, combine="max", axis=1, drop="n")), "m_new")
        # a row with no key yet keeps a maximum of 0, so exp2 of -inf - 0 gives weights 0, not NaN
        m_safe = em.define(call("where", Bin("==", m_new, Lit(-math.inf, f32)), Lit(0.0, f32), m_new), "m_safe")
        alpha = em.define(call("exp2", Bin("-", m_i, m_safe)), "alpha")
        weights = em.define(call("exp2", Bin("-", s, m_safe)), "p")
        row_sum = call("reduce", weights, combine="sum", axis=1, drop="n")
        em.emit(Assign((l_i,), Bin("+", Bin("*", l_i, alpha), row_sum)))
        v = t.tile(p.v, keys, keys_ok, p.v_width, BLOCK_E)
        kept = t.kept(rows, rows_ok, cols, cols_ok)  # dropout: after the row sum, which normalises all weights
        dropped = weights if kept is None else em.define(Bin("*", weights, kept), "p")
        em.emit(Assign((acc,), call("dot", call("cast", dropped, dtype=p.dtype), v, Bin("*", acc, alpha),
                                    **t.precision)))
        em.emit(Assign((m_i,), m_new))

    t.walk(t.spans(first, BLOCK_M, BLOCK_N, p.keys, before=True), BLOCK_N, step)
    empty = Bin("==", l_i, Lit(0.0, f32))
    if out is not None:
        # a row no key is left to: 0 / 0 is NaN as a softmax over -inf alone gives, or zeros where `safe`
        total = em.define(call("where", empty, Lit(1.0, f32), l_i), "total") if p.safe or p.keys == 0 else l_i
        t.store(out, Bin("/", acc, total), rows, rows_ok, p.v_width, BLOCK_E)
    if lse is not None:  # natural log; a row with no key: +inf (weights 0 in the backward) where safe, else NaN
        log_sum = Bin("*", Bin("+", m_i, call("log2", l_i)), Lit(LN2, f32))
        fill = Lit(math.inf if p.safe else math.nan, f32)
        t.store(lse, call("where", empty, fill, log_sum), rows, rows_ok)
    return t.function("")


def _key_grads(ctx: Context, kernel: FusedKernel, dk: Node | None, dv: Node | None) -> Function:
    """dK and dV: a program per block of keys walks the queries that attend to them."""
    t = _Tiles(ctx, kernel, "keys")
    p, em, first, f32 = t.p, t.em, t.first, dtypes.float32
    keys, keys_ok = t.positions(first, BLOCK_N, 0, p.keys, "keys")
    k = t.tile(p.k, keys, keys_ok, p.width, BLOCK_D)
    v = t.tile(p.v, keys, keys_ok, p.v_width, BLOCK_E)
    dk_acc = em.bind("dk", call("zeros", shape=(BLOCK_N, BLOCK_D), dtype=f32))
    dv_acc = em.bind("dv", call("zeros", shape=(BLOCK_N, BLOCK_E), dtype=f32))

    def step(start: Var, diagonal: bool, tag: str) -> None:
        queries, queries_ok = t.positions(start, BLOCK_M, 0, p.length, "queries" + tag)
        q = t.tile(p.q, queries, queries_ok, p.width, BLOCK_D)
        do = t.tile(p.do, queries, queries_ok, p.v_width, BLOCK_E)
        cols, cols_ok = t.positions(start, BLOCK_M, 1, p.length, "cols" + tag)
        s = t.scores(k, q, cols, cols_ok, keys, keys_ok, (BLOCK_N, BLOCK_M), diagonal)  # sᵀ: keys by queries
        lse = t.row_values(p.lse, cols, cols_ok)
        weights = em.define(call("exp2", Bin("-", s, Bin("*", lse, Lit(LOG2E, f32)))), "pt")  # 0 past the queries
        kept = t.kept(cols, cols_ok, keys, keys_ok)
        dropped = weights if kept is None else em.define(Bin("*", weights, kept), "pt")
        em.emit(Assign((dv_acc,), call("dot", call("cast", dropped, dtype=p.dtype), do, dv_acc, **t.precision)))
        dpt = em.define(call("dot", v, call("trans", do), call("zeros", shape=(BLOCK_N, BLOCK_M), dtype=f32),
                             **t.precision), "dpt")
        if kept is not None:  # the gradient of the kept weights
            dpt = em.define(Bin("*", dpt, kept), "dpt")
        delta = t.row_values(p.delta, cols, cols_ok)
        dst = em.define(Bin("*", weights, Bin("-", dpt, delta)), "dst")
        em.emit(Assign((dk_acc,), call("dot", call("cast", dst, dtype=p.dtype), q, dk_acc, **t.precision)))

    # queries before the block's first key attend to none of its keys
    t.walk(t.spans(first, BLOCK_N, BLOCK_M, p.length, before=False), BLOCK_M, step)
    if dk is not None:
        t.store(dk, Bin("*", dk_acc, Lit(p.scale, f32)), keys, keys_ok, p.width, BLOCK_D)
    if dv is not None:
        t.store(dv, dv_acc, keys, keys_ok, p.v_width, BLOCK_E)
    return t.function("_dkv")


def _query_grad(ctx: Context, kernel: FusedKernel, dq: Node) -> Function:
    """dQ: a program per block of queries walks the keys they attend to."""
    t = _Tiles(ctx, kernel, "queries")
    p, em, first, f32 = t.p, t.em, t.first, dtypes.float32
    rows, rows_ok = t.positions(first, BLOCK_M, 0, p.length, "rows")
    q = t.tile(p.q, rows, rows_ok, p.width, BLOCK_D)
    do = t.tile(p.do, rows, rows_ok, p.v_width, BLOCK_E)
    lse2 = em.define(Bin("*", t.row_values(p.lse, rows, rows_ok), Lit(LOG2E, f32)), "lse2")
    delta = t.row_values(p.delta, rows, rows_ok)
    dq_acc = em.bind("dq", call("zeros", shape=(BLOCK_M, BLOCK_D), dtype=f32))

    def step(start: Var, diagonal: bool, tag: str) -> None:
        keys, keys_ok = t.positions(start, BLOCK_N, 0, p.keys, "keys" + tag)
        cols, cols_ok = t.positions(start, BLOCK_N, 1, p.keys, "cols" + tag)
        k = t.tile(p.k, keys, keys_ok, p.width, BLOCK_D)
        v = t.tile(p.v, keys, keys_ok, p.v_width, BLOCK_E)
        s = t.scores(q, k, rows, rows_ok, cols, cols_ok, (BLOCK_M, BLOCK_N), diagonal)
        weights = em.define(call("exp2", Bin("-", s, lse2)), "p")
        dp = em.define(call("dot", do, call("trans", v), call("zeros", shape=(BLOCK_M, BLOCK_N), dtype=f32),
                            **t.precision), "dp")
        kept = t.kept(rows, rows_ok, cols, cols_ok)
        if kept is not None:
            dp = em.define(Bin("*", dp, kept), "dp")
        ds = em.define(Bin("*", weights, Bin("-", dp, delta)), "ds")
        em.emit(Assign((dq_acc,), call("dot", call("cast", ds, dtype=p.dtype), k, dq_acc, **t.precision)))

    t.walk(t.spans(first, BLOCK_M, BLOCK_N, p.keys, before=True), BLOCK_N, step)
    t.store(dq, Bin("*", dq_acc, Lit(p.scale, f32)), rows, rows_ok, p.width, BLOCK_D)
    return t.function("_dq")


PATTERN = Pattern("attention", ((Stage.CLAIM, group_results),), lowers=lambda k: k.kind is KernelKind.ATTENTION,
                  lower=lower_attention)
