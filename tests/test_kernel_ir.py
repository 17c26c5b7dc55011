"""The kernel IR is data: planned kernels are lowered to statements over expression trees that name no
target's syntax, every primitive has a way into it, and the Triton renderer prints it faithfully."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ember
from ember.compiler import emit, fused, fusion, lower, passes, rewrite, signatures
from ember.compiler.context import CompileContext
from ember.compiler.kernel import Assign, Bin, Block, Branch, Call, Effect, Expr, KernelIR, Lit, Loop, Prim, Range, Var
from ember.compiler.patterns import pointwise, rows
from ember.compiler.targets import triton as renderer
from ember.ir import toposort
from ember.ops.index import gather_in_range


def _kernels(build):
    out = build()
    order = toposort([out._node])
    sig = signatures.signature(order, {id(out._node)})
    order, results = passes.expand_composites(order, {id(out._node)})  # as the compiler does first
    lowered = passes.lower(order, {id(n) for n in results}, sig, results=results)
    kernels, stored = fusion.plan(lowered.nodes, lowered.outputs, CompileContext(), fused.NOMINAL_GPU)
    return kernels, stored


def _walk(block):
    for s in block:
        yield s
        if isinstance(s, Loop):
            yield from _walk(s.prelude)
            yield from _walk(s.body)
        if isinstance(s, Branch):
            yield from _walk(s.body)
            yield from _walk(s.orelse)


def _expressions(e: Expr):
    yield e
    for child in e.children():
        yield from _expressions(child)


def _graphs():
    rng = np.random.default_rng(0)

    def t(*shape):
        return ember.tensor(rng.standard_normal(shape).astype(np.float32), device="cuda")

    x, w, b = t(33, 70), t(70, 20), t(20)
    return {
        "pointwise": lambda: (x * 2 + 1).exp(),
        "softmax": lambda: x.softmax(-1),
        "gemm + epilogue + column sum": lambda: ((x.relu() @ w) + b).sum(0),
        "views": lambda: x.T.flip(0)[::2].contiguous() + 1,
        "pad and gather": lambda: ember.nn.functional.pad(x, (1, 2)).gather(
            1, ember.tensor(rng.integers(0, 70, (33, 5)), device="cuda")),
    }


@pytest.mark.parametrize("name", list(_graphs()))
def test_lowered_kernels_hold_statements_and_trees_not_source_text(name):
    kernels, stored = _kernels(_graphs()[name])
    for kernel in kernels:
        if kernel.kind in fused.VENDOR_KINDS and kernel.core is None:
            continue
        ir = lower.lower(kernel, stored, CompileContext())
        assert isinstance(ir, KernelIR) and ir.functions
        for function in ir.functions:
            for statement in _walk(function.body):
                assert isinstance(statement, (Assign, Effect, Loop, Branch))
                values = [statement.value] if isinstance(statement, (Assign, Effect)) else []
                for value in values:
                    for e in _expressions(value):
                        assert isinstance(e, (Var, Lit, Block, Range, Bin, Call, Prim))
                        assert not isinstance(e, Lit) or not isinstance(e.value, str), "text in the kernel IR"


def test_whether_a_value_is_a_tile_is_read_off_the_tree():
    m, n = Block("BLOCK_M", "m"), Block("BLOCK_N", "n")
    rows, cols = Range(m, 0, 2), Range(n, 1, 2)
    size = Var("n0")
    assert not Bin("*", Var("pid"), m).is_tile
    assert Bin("+", Bin("*", Var("pid"), m), rows).axes == {"m"}
    assert Bin("+", Bin("*", rows, size), cols).axes == {"m", "n"}
    reduced = Call("reduce", (Bin("+", rows, cols),), options=(("axis", 1), ("combine", "sum"), ("drop", "n")))
    assert reduced.axes == {"m"}
    assert Call("load", (Bin("+", Var("in0"), Lit(3)),)).axes == frozenset()
    assert Call("zeros", (), (m, 1)).axes == {"m"}


OPERATORS = ["+", "-", "*", "//", "%", "<", "<=", ">=", "==", "!=", "&", "|"]


@pytest.mark.parametrize("outer,left,right", list(itertools.product(OPERATORS, ["+", "*", "<", "&"], ["-", "//", "<"])))
def test_rendered_expressions_keep_the_trees_meaning(outer, left, right):
    """Each tree is evaluated directly and through the text the renderer prints (Python's precedence,
    which Triton shares): parentheses go exactly where the tree needs them."""
    values = {"a": 7, "b": 3, "c": 5, "d": 2}

    def evaluate(e):
        if isinstance(e, Var):
            return values[e.name]
        if isinstance(e, Lit):
            return e.value
        a, b = evaluate(e.a), evaluate(e.b)
        return {"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else 0, "%": a % b if b else 0,
                "<": a < b, "<=": a <= b, ">=": a >= b, "==": a == b, "!=": a != b,
                "&": int(a) & int(b), "|": int(a) | int(b)}[e.op]

    tree = Bin(outer, Bin(left, Var("a"), Var("b")), Bin(right, Var("c"), Var("d")))
    text = renderer.Renderer().expr(tree)
    expected = evaluate(tree)
    if isinstance(expected, int) and outer in ("//", "%") and evaluate(tree.b) == 0:
        return
    assert eval(text, {}, dict(values)) == expected, text  # noqa: S307 - the renderer's own output


def test_a_kernel_is_named_after_its_text_and_the_same_graph_gives_the_same_source():
    build = _graphs()["softmax"]
    sources = []
    for _ in range(2):
        kernels, stored = _kernels(build)
        sources.append([renderer.generate(k, stored, CompileContext()) for k in kernels])
    first, again = sources
    assert [s.text for s in first] == [s.text for s in again]
    for source in first:
        assert f"def {source.name}(" in source.text
        assert source.text.startswith("# ember fused kernel: reduce")


def _row_loops(build) -> list[int]:
    """Per row kernel of the graph, how many loops over the row it runs."""
    kernels, stored = _kernels(build)
    counts = []
    for kernel in kernels:
        if kernel.kind is fused.KernelKind.REDUCE:
            ir = lower.lower(kernel, stored, CompileContext())
            counts.append(sum(isinstance(s, Loop) for f in ir.functions for s in _walk(f.body)))
    return counts


def test_independent_reductions_of_a_row_share_one_pass_and_dependent_ones_take_another():
    rng = np.random.default_rng(1)
    x = ember.tensor(rng.standard_normal((3, 20000)).astype(np.float32), device="cuda")
    # sum, sum of squares and max read no reduction's result: one loop; the stored outputs need no other
    assert _row_loops(lambda: x.sum(-1) + (x * x).sum(-1) + x.amax(-1)) == [1]
    # softmax's normaliser reads the max: one loop for both (each position keeps its running max and sum of
    # exponentials), and the output's loop after it
    assert _row_loops(lambda: x.softmax(-1)) == [2]
    # the variance reads the mean, the sum of |x| does not: two loops
    centred = lambda: x - x.mean(-1, keepdim=True)  # noqa: E731
    assert _row_loops(lambda: (centred() * centred()).sum(-1) + x.abs().sum(-1) + x.mean(-1)) == [2]


def test_reductions_sharing_a_pass_compute_what_separate_passes_do(monkeypatch):
    monkeypatch.setattr(rows, "ROW_TILE", 256)  # rows longer than 256 are reduced in a loop, 128 columns a step
    monkeypatch.setattr(rows, "LOOP_CHUNK", 128)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((5, 700)).astype(np.float32)
    x = ember.tensor(a, device="cuda")
    mean = x.mean(-1, keepdim=True)
    got = ((x - mean).square().sum(-1) + x.abs().sum(-1) * 0.5 + x.amax(-1) - x.amin(-1) + x.argmax(-1)).numpy()
    m = a.mean(-1, keepdims=True, dtype=np.float64)
    want = ((a - m) ** 2).sum(-1) + np.abs(a).sum(-1) * 0.5 + a.max(-1) - a.min(-1) + a.argmax(-1)
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize(("numel", "nodes", "sms", "block"), [
    (2**24, 10, 132, 1024),  # a large, light kernel: POINTWISE_BLOCK elements per program
    (2**24, 200, 132, 256),  # heavy (image sampling): fewer elements per program, fewer registers each
    (54_000, 200, 132, 128),  # too few programs to fill the GPU: one element per thread
    (300_000, 10, 132, 512),
    (54_000, 10, 0, 1024),  # the SM count unknown: left alone
])
def test_a_pointwise_kernels_programs_take_fewer_elements_when_heavy_or_too_few_to_fill_the_gpu(numel, nodes, sms,
                                                                                                block):
    assert pointwise.pointwise_block(numel, nodes, sms) == block


def test_a_flattened_index_unflattened_again_costs_no_division():
    """Gathering at an index that was flattened for the gather and whose result is unflattened back: the
    positions are reused, not recomputed by dividing the linear position."""
    rng = np.random.default_rng(0)
    x = ember.tensor(rng.standard_normal(1000).astype(np.float32), device="cuda")
    index = ember.tensor(rng.integers(0, 1000, (6, 7, 5)).astype(np.int32), device="cuda")
    out = ember.gather(x, 0, ember.minimum(index + 1, 999).reshape(-1)).reshape(6, 7, 5).permute(2, 0, 1) * 2
    (source,) = ember.explain.plan(out).sources.values()
    assert source.text.count("//") == 2, source.text  # unravelling the output's position once, not again
    want = x.numpy()[np.minimum(index.numpy() + 1, 999)].transpose(2, 0, 1) * 2
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def test_a_gather_along_a_size_one_axis_with_indices_out_of_range_beside_another_read(cuda_backend):
    """The gather primitive's out-of-range picks read zero (its loads are masked, whether or not the index was
    checked before); the positions its index flattens to must not leak into another node's loads in the same
    kernel (which have no range check of their own)."""
    buf = ember.tensor(np.arange(5, dtype=np.float32), device="cuda")
    big = ember.tensor(np.arange(20, dtype=np.float32).reshape(4, 5) * 10, device="cuda")
    picks = ember.tensor(np.array([[0], [1], [0], [2], [0]], dtype=np.int32), device="cuda")
    # the index computed in the kernel (a value held by a variable would be stored), and not checked
    out = gather_in_range(buf.reshape(1, 5), 0, ember.minimum(picks, 100).permute(1, 0)).permute(1, 0) + \
        big[3:4, :].reshape(5, 1)
    assert len(ember.explain.plan(out).kernels) == 1, str(ember.explain.plan(out))
    np.testing.assert_array_equal(out.numpy().ravel(), [150, 160, 172, 180, 194])


def test_int32_gather_indices_stay_int32_only_where_every_offset_fits():
    small = ember.gather(ember.zeros(10), 0, ember.tensor(np.int32([1, 2])))
    assert small._node.inputs[1].dtype is ember.int32
    huge = ember.gather(ember.zeros(1, dtype=ember.float16).expand(2**31), 0, ember.tensor(np.int32([1, 2])))
    assert huge._node.inputs[1].dtype is ember.int64


def test_a_gemm_over_more_than_int32_elements_walks_k_in_int64(cuda_backend):
    """A weight gradient over a batch of 2^25 rows: K times a row's stride passes int32."""
    a = ember.tensor(np.ones((1, 64), np.float16), device="cuda")
    g, x = a.expand(2**25 + 8, 64) * 1.5, a.expand(2**25 + 8, 64) * 2.5
    p = ember.explain.plan(g, x, g.mT @ x)
    (gemm,) = [k for k in p.kernels if k.core is not None]
    assert "ka = start.to(tl.int64)" in p.sources[id(gemm)].text


def _heavy(x, depth: int = 30):
    """x times a long chain over its last axis's positions: a pointwise kernel of over POINTWISE_HEAVY nodes
    whose chain does not vary along the other axes."""
    t = ember.arange(x.shape[-1], dtype=ember.float32, device=x.device)
    for _ in range(depth):
        t = (t * 1.01 + 0.3).sin()
    return x * t


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 9), (1, 3, 1, 7), (0, 3, 5, 7), (2, 3, 0, 7), (5, 7), (7, 3),
                                   (1, 3, 1, 1)])
def test_a_heavy_kernel_computes_a_short_axis_whole_in_each_thread_sharing_what_does_not_vary_along_it(shape):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(shape).astype(np.float32)
    out = _heavy(ember.tensor(a, device="cuda"))
    (source,) = ember.explain.plan(out).sources.values()
    code = source.text.split("@triton.jit")[1]
    inner = max((d for d, s in enumerate(shape) if s != 1), default=0)
    short = [s for d, s in enumerate(shape) if 2 <= s <= pointwise.POINTWISE_UNROLL and d < inner]
    # one store per position along the last short axis but the innermost (whose neighbours threads side by side
    # store at once); the chain along the last axis once per thread
    assert code.count("tl.store(") == (short[-1] if short else 1), source.text
    assert code.count("sin(") == 30, source.text
    np.testing.assert_allclose(out.numpy(), _heavy(ember.tensor(a)).numpy(), rtol=1e-5, atol=1e-6)


def test_a_heavy_kernel_whose_every_value_varies_along_its_short_axis_is_not_unrolled(cuda_backend):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 50)).astype(np.float32)
    t = ember.tensor(a, device="cuda")
    for _ in range(30):
        t = (t * 1.01 + 0.3).sin()
    (source,) = ember.explain.plan(t).sources.values()
    assert source.text.split("@triton.jit")[1].count("tl.store(") == 1, source.text
    want = a
    for _ in range(30):
        want = np.sin(want * np.float32(1.01) + np.float32(0.3))
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, atol=1e-5)


def test_segments_of_one_launch_unroll_their_own_short_axes(cuda_backend):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 2, 6)).astype(np.float32), rng.standard_normal((5, 11)).astype(np.float32)
    outs = _heavy(ember.tensor(a, device="cuda")), _heavy(ember.tensor(b, device="cuda"), depth=25)
    p = ember.explain.plan(*outs)
    assert p.launches == 1, str(p)
    for got, x in zip(outs, (a, b)):
        np.testing.assert_allclose(got.numpy(), _heavy(ember.tensor(x), depth=30 if x is a else 25).numpy(),
                                   rtol=1e-5, atol=1e-6)


def _load(address: Expr) -> Call:
    return Call("load", (address,))


def _store(address: Expr, value: Expr) -> Effect:
    return Effect(Call("store", (address, value)))


def test_loads_after_a_store_are_hoisted_above_it_where_their_addresses_are_known():
    a, b, c, d, t = (Var(n) for n in "abcdt")
    body = [Assign((a,), _load(Var("in0"))),
            _store(Var("out0"), a),
            Assign((t,), Bin("+", a, Lit(1))),
            Assign((b,), Call("cast", (_load(Bin("+", Var("in1"), a)),))),  # address known before the store
            Assign((c,), _load(Bin("+", Var("in2"), t))),  # address computed after it: stays
            Assign((d,), _load(Bin("+", Var("in3"), b))),  # its address reads a hoisted load: follows it
            _store(Var("out1"), Bin("+", b, Bin("+", c, d)))]
    hoisted = rewrite.hoist_loads(body)
    assert hoisted == [body[0], body[3], body[5], body[1], body[2], body[4], body[6]]


def test_a_load_reading_a_name_assigned_again_after_the_store_stays_below_it():
    a, b = Var("a"), Var("b")
    body = [Assign((a,), _load(Var("in0"))), _store(Var("out0"), a),
            Assign((a,), Bin("*", a, Lit(2))), Assign((b,), _load(Bin("+", Var("in1"), a))), _store(Var("out1"), b)]
    assert rewrite.hoist_loads(body) == body


def test_only_kernels_too_small_to_fill_the_gpu_hoist_their_loads():
    def first_store_after_loads(size):
        def build():
            xs = [ember.randn(size, device="cuda") for _ in range(3)]
            return xs[0] * 2, xs[1] + xs[2]
        outs = build()
        order = toposort([o._node for o in outs])
        keep = {id(o._node) for o in outs}
        lowered = passes.lower(order, keep, signatures.signature(order, keep))
        kernels, stored = fusion.plan(lowered.nodes, lowered.outputs, CompileContext(), fused.NOMINAL_GPU)
        (kernel,) = [k for k in kernels if k.kind is fused.KernelKind.POINTWISE]
        body = lower.lower(kernel, stored, CompileContext()).functions[0].body
        kinds = ["store" if isinstance(s, Effect) else "load" if isinstance(s, Assign) and emit.reads_memory(s.value)
                 else "" for s in body]
        kinds = [k for k in kinds if k]
        return kinds.index("store") > max(i for i, k in enumerate(kinds) if k == "load")

    assert first_store_after_loads(100)
    assert not first_store_after_loads(1 << 22)


def test_positions_of_a_row_read_by_several_loops_over_it_are_computed_before_them(monkeypatch):
    """A row kernel whose rows are read through a transpose unravels the row's position into two; computed inside
    the first loop over the row, they would be undefined in the next ones on a GPU (Python, the interpreter,
    keeps a loop's names after it): they are computed once, before the loops."""
    monkeypatch.setattr(rows, "ROW_TILE", 256)  # rows longer than 256 are reduced in a loop, 128 columns a step
    monkeypatch.setattr(rows, "LOOP_CHUNK", 128)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 3, 700)).astype(np.float32), rng.standard_normal(700).astype(np.float32)
    x, bias = ember.tensor(a, device="cuda"), ember.tensor(b, device="cuda")
    out = (x.transpose(0, 1) + bias).reshape(12, 700).softmax(-1)
    kernels, stored = _kernels(lambda: out)
    (row,) = [k for k in kernels if k.kind is fused.KernelKind.REDUCE]
    ir = lower.lower(row, stored, CompileContext())
    assert all(not emit.unbound_reads(f) for f in ir.functions)
    (function,) = ir.functions
    loops = [s for s in function.body if isinstance(s, Loop)]
    # softmax: one pass for the max and the sum of exponentials, one for the output
    assert len(loops) == 2 and any("//" in str(s.value) for s in loops[0].prelude if isinstance(s, Assign))
    shifted = (a.transpose(1, 0, 2) + b).reshape(12, 700)
    want = np.exp(shifted - shifted.max(-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_names_a_loop_or_one_branch_defines_are_unbound_after_it():
    from ember.compiler.kernel import Function, Param, ParamKind

    one = Lit(1)
    loop = Loop(Var("k"), Lit(0), Var("n"), one, body=[Assign((Var("inside"),), Bin("+", Var("k"), one))])
    branch = Branch(Var("n"), body=[Assign((Var("both"),), one), Assign((Var("left"),), one)],
                    orelse=[Assign((Var("both"),), one)])
    body = [Assign((Var("before"),), Var("n")), loop, branch,
            Assign((Var("after"),), Bin("+", Bin("+", Var("inside"), Var("before")), Bin("+", Var("both"),
                                                                                          Var("left"))))]
    function = Function("", [Param(ParamKind.SIZE, 4, "n")], {"BLOCK": 16}, body, 1)
    assert emit.unbound_reads(function) == {"inside", "left"}
