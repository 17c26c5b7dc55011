"""Generated GEMM kernels (run by Triton's interpreter in CI) against torch and the reference backend,
and the GEMM planner's choices: what the mainloop (prologue) recomputes, what the epilogue takes,
where an operand's sum along K goes, which form (generated or split) runs, and how a problem is
tuned and remembered.

Inputs are random and never zero; results are compared with torch in float64 on the same (rounded)
values, or with the reference backend ("cpu") where the computation draws random numbers."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import plan_unfused

import ember
import ember.nn.functional as F
from ember.compiler.fused import summed_operand
from ember.explain import plan

pytestmark = pytest.mark.usefixtures("cuda_backend")

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
RTOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}

@pytest.fixture(autouse=True, scope="module")
def fresh_cache(tmp_path_factory):
    """These tests plan and store into a cache directory of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("ember-cache")))
        yield


# -- helpers ---------------------------------------------------------------------------------------

def random(rng, *shape, dtype: str = "float32", low: float = -1.0, high: float = 1.0) -> np.ndarray:
    """Random values of `dtype`, kept away from zero (|x| >= 0.05)."""
    drawn = rng.uniform(low, high, size=shape)
    drawn = np.where(np.abs(drawn) < 0.05, np.copysign(0.05, drawn) + drawn, drawn)
    return drawn.astype(NUMPY_DTYPES[dtype])


def on(device: str, *arrays: np.ndarray, grad: bool = False) -> list[ember.Tensor]:
    return [ember.tensor(a, device=device, requires_grad=grad) for a in arrays]


def t64(array: np.ndarray) -> torch.Tensor:
    """The exact values of an array of any float dtype, in float64, for the reference."""
    return torch.from_numpy(np.asarray(array).astype(np.float64))


def values(tensor) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float64)
    if isinstance(tensor, torch.Tensor):
        return tensor.detach().numpy().astype(np.float64)
    return tensor.numpy().astype(np.float64)


def assert_matches(got, want, dtype: str = "float32", what: str = "value") -> None:
    """Element-wise within `RTOL[dtype]` of the reference, and within it of the reference's scale
    (a long sum of products rounds to its magnitude, not to each small element's)."""
    got, want = values(got), values(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    rtol = RTOL[dtype]
    scale = float(np.abs(want).max()) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def sections(lines: list[str]) -> dict[str, list[str]]:
    """explain's lines of one kernel by section ("mainloop", "core", "epilogue", "decision"): a section's
    title stands on its first line only."""
    found: dict[str, list[str]] = defaultdict(list)
    current = None
    for line in lines[1:]:
        title = line[2:11].strip()
        if title:
            current = title
        found[current].append(line[12:])
    return found


def only_gemm(p) -> tuple:
    """The one kernel of a plan, which must be a generated GEMM, and its explain sections."""
    assert [k.kind.value for k in p.kernels] == ["matmul"], str(p)
    (k,) = p.kernels
    assert k.core is not None, str(p)
    return k, sections(p.describe(k))


def layout(p, kernel) -> str:
    """How the generated GEMM loads its operands: per operand "n", "t" (transposed in place) or "p" (a
    prologue computes it)."""
    return p.sources[id(kernel)].launches[0].layout


# -- bare GEMMs ---------------------------------------------------------------------------------

SIZES = [  # (M, N, K)
    pytest.param((1, 17, 33), id="1x17x33"),
    pytest.param((17, 1, 5), id="17x1x5"),
    pytest.param((1000, 17, 9), id="1000x17x9"),
    pytest.param((5, 1000, 17), id="5x1000x17"),
    pytest.param((33, 17, 1000), id="33x17x1000"),
    pytest.param((17, 33, 1), id="17x33x1"),
]
GEMM_DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("mnk", SIZES)
def test_a_bare_gemm_at_odd_sizes_is_one_generated_kernel(mnk, dtype, rng):
    m, n, k = mnk
    a, b = random(rng, m, k, dtype=dtype), random(rng, k, n, dtype=dtype)
    x, w = on("cuda", a, b)
    out = x @ w
    kernel, _ = only_gemm(plan(out))
    assert kernel.core.dtype.name == dtype
    assert out.dtype.name == dtype
    assert_matches(out, t64(a) @ t64(b), dtype)


@pytest.mark.parametrize("shapes", [((0, 3), (3, 4)), ((3, 0), (0, 4))], ids=["no-rows", "no-inner"])
def test_an_empty_gemm_gives_an_empty_or_zero_result(shapes, rng):
    a, b = (random(rng, *s) for s in shapes)
    x, w = on("cuda", a, b)
    assert_matches(x @ w, t64(a) @ t64(b))


# -- transposed operands --------------------------------------------------------------------------

TRANSPOSES = {  # name: (A's storage shape, B's storage shape, product, layout)
    "a.mT @ b": ((9, 7), (9, 5), lambda a, b: a.mT @ b, "tn"),
    "a @ b.mT": ((7, 9), (5, 9), lambda a, b: a @ b.mT, "nt"),
    "a.mT @ b.mT": ((9, 7), (5, 9), lambda a, b: a.mT @ b.mT, "tt"),
}


@pytest.mark.parametrize("case", TRANSPOSES)
def test_transposed_operands_are_loaded_in_place_with_no_transpose_kernel(case, rng):
    a_shape, b_shape, product, expected_layout = TRANSPOSES[case]
    a, b = random(rng, *a_shape), random(rng, *b_shape)
    out = product(*on("cuda", a, b))
    p = plan(out)
    kernel, _ = only_gemm(p)
    assert layout(p, kernel) == expected_layout
    assert_matches(out, product(t64(a), t64(b)))


# -- batched matmul -------------------------------------------------------------------------------

BATCHED = {  # name: (A's shape, B's shape)
    "3-d @ 3-d": ((3, 7, 5), (3, 5, 9)),
    "4-d @ 2-d": ((2, 3, 7, 5), (5, 9)),
    "broadcast batches": ((2, 1, 7, 5), (3, 5, 9)),
    "2-d @ 3-d": ((7, 5), (2, 5, 9)),
}


@pytest.mark.parametrize("case", BATCHED)
def test_a_batched_matmul_broadcasts_its_batch_in_one_generated_kernel(case, rng):
    a_shape, b_shape = BATCHED[case]
    a, b = random(rng, *a_shape), random(rng, *b_shape)
    out = ember.matmul(*on("cuda", a, b))
    only_gemm(plan(out))
    assert_matches(out, torch.matmul(t64(a), t64(b)))


def test_a_batched_gemm_takes_a_prologue_on_a_broadcast_operand_and_a_bias_epilogue(rng):
    a, b, bias = random(rng, 2, 3, 7, 5), random(rng, 5, 9), random(rng, 9)
    x, w, c = on("cuda", a, b, bias)
    out = F.relu(x) @ w.tanh() + c
    only_gemm(plan(out))
    assert_matches(out, torch.relu(t64(a)) @ torch.tanh(t64(b)) + t64(bias))


# -- prologues in the mainloop --------------------------------------------------------------------

def _prologue_cases(rng):
    """name: (arrays, ember function, torch float64 reference function)"""
    x, w, scale, shift = random(rng, 20, 24), random(rng, 24, 19), random(rng, 24), random(rng, 24)
    return {
        "activation": ((x, w), lambda a, b: F.relu(a) @ b, lambda a, b: torch.relu(a) @ b),
        "cast": ((x.astype(np.float16), w), lambda a, b: a.to(ember.float32) @ b, lambda a, b: a @ b),
        "scale and shift": ((x, w, scale, shift), lambda a, b, s, t: F.relu(a * s + t) @ b,
                            lambda a, b, s, t: torch.relu(a * s + t) @ b),
        "second operand": ((x, w), lambda a, b: a @ F.relu(b), lambda a, b: a @ torch.relu(b)),
        "both operands": ((x, w), lambda a, b: a.exp() @ b.sigmoid(), lambda a, b: a.exp() @ b.sigmoid()),
    }


PROLOGUES = ["activation", "cast", "scale and shift", "second operand", "both operands"]


@pytest.mark.parametrize("case", PROLOGUES)
def test_a_cheap_operand_producer_is_recomputed_in_the_mainloop(case, rng):
    arrays, fn, reference = _prologue_cases(rng)[case]
    out = fn(*on("cuda", *arrays))
    p = plan(out)
    kernel, explained = only_gemm(p)
    assert explained["mainloop"], str(p)
    assert explained["decision"] and all("recomputed in the mainloop" in d for d in explained["decision"]), str(p)
    assert "p" in layout(p, kernel)
    assert_matches(out, reference(*(t64(a) for a in arrays)))


def test_a_dropout_mask_is_drawn_in_the_mainloop_as_the_reference_backend_draws_it(rng):
    a, b = random(rng, 20, 24), random(rng, 24, 19)
    results = {}
    for device in ("cuda", "cpu"):
        ember.manual_seed(11)
        x, w = on(device, a, b)
        results[device] = F.dropout(x, 0.5, training=True) @ w
    p = plan(results["cuda"])
    _, explained = only_gemm(p)
    assert any("rand(" in line for line in explained["mainloop"]), str(p)
    assert "recomputed in the mainloop" in explained["decision"][0], str(p)
    ember.manual_seed(11)
    mask = F.dropout(on("cpu", a)[0], 0.5, training=True).numpy() != 0  # the same draw, on its own
    assert 0.3 < mask.mean() < 0.7
    assert_matches(results["cuda"], results["cpu"])
    assert_matches(results["cuda"], t64(np.where(mask, a * 2, 0)) @ t64(b))


@pytest.mark.parametrize("case", ["transposed", "broadcast"])
def test_explain_shows_a_prologue_read_through_a_view_in_the_mainloop(case, rng):
    if case == "transposed":
        a, b = random(rng, 20, 24), random(rng, 19, 24)
        out = on("cuda", a)[0] @ on("cuda", b)[0].tanh().mT
        expected = t64(a) @ torch.tanh(t64(b)).mT
    else:
        a, b = random(rng, 2, 7, 5), random(rng, 5, 9)
        out = on("cuda", a)[0] @ on("cuda", b)[0].tanh()
        expected = t64(a) @ torch.tanh(t64(b))
    p = plan(out)
    kernel, explained = only_gemm(p)
    assert layout(p, kernel).endswith("p")  # the kernel does compute it in the mainloop
    assert_matches(out, expected)
    assert any("tanh(" in line for line in explained["mainloop"]), str(p)
    # the batch is folded into the rows of one GEMM; the epilogue stores them in the batched shape
    assert all("reshape(" in line for line in explained["epilogue"]), str(p)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_gemm_fuses_a_prologue_and_an_epilogue_when_the_dot_is_wide_enough(dtype, rng):
    a, b, bias = random(rng, 20, 24, dtype=dtype), random(rng, 24, 130, dtype=dtype), random(rng, 130, dtype=dtype)
    x, w, c = on("cuda", a, b, bias)
    out = F.gelu(F.relu(x) @ w + c)
    p = plan(out)
    kernel, explained = only_gemm(p)
    assert explained["mainloop"] and explained["epilogue"], str(p)
    assert "recomputed in the mainloop" in kernel.decisions[0], str(p)
    assert out.dtype.name == dtype
    assert_matches(out, torch.nn.functional.gelu(torch.relu(t64(a)) @ t64(b) + t64(bias)), dtype)


# -- a rejected prologue ----------------------------------------------------------------------------

def test_a_prologue_that_would_read_more_than_it_saves_is_stored(rng):
    arrays = [random(rng, 64, 64) for _ in range(4)] + [random(rng, 64, 16)]
    a, b, c, d, w = on("cuda", *arrays)
    out = (a + b + c + d) @ w
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == ["pointwise", "matmul"], str(p)
    gemm = p.kernels[1]
    assert len(gemm.decisions) == 1 and "stored: recomputing it would read" in gemm.decisions[0], str(p)
    assert not sections(p.describe(gemm))["mainloop"], str(p)
    ta, tb, tc, td, tw = (t64(x) for x in arrays)
    assert_matches(out, (ta + tb + tc + td) @ tw)


def test_a_prologue_that_would_slow_a_large_half_precision_dot_is_stored():
    # planned, not run: GELU's ops, applied once per output tile across N = 8192, would take more of the
    # tensor cores' time than storing the operand costs
    x, w = ember.randn(8192, 4096, device="cuda").to(ember.bfloat16), ember.randn(4096, 8192, device="cuda")
    out = F.gelu(x.float()).to(ember.bfloat16) @ w.to(ember.bfloat16)
    p = plan(out)
    gemm = next(k for k in p.kernels if k.core is not None)
    assert any("of the dot's time" in d and "stored" in d for d in gemm.decisions), str(p)


def test_a_cheap_prologue_of_a_small_half_precision_gemm_is_recomputed(rng):
    # a small GEMM is bound by latency: a kernel of its own for exp() costs more than recomputing it
    a, b = random(rng, 20, 24, dtype="float16"), random(rng, 24, 19, dtype="float16")
    x, w = on("cuda", a, b)
    out = x.exp() @ w
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == ["matmul"], str(p)
    assert "recomputed in the mainloop" in p.kernels[0].decisions[0], str(p)
    assert_matches(out, torch.exp(torch.from_numpy(a.astype(np.float32))).double() @ t64(b), "float16")


# -- epilogues ------------------------------------------------------------------------------------

def _epilogue_cases(rng):
    """name: (arrays, ember function, torch float64 reference, output dtype)"""
    x, w, bias = random(rng, 20, 24), random(rng, 24, 19), random(rng, 19)
    residual, other = random(rng, 20, 19), random(rng, 19, 20)
    return {
        "bias and gelu": ((x, w, bias), lambda a, b, c: F.gelu(a @ b + c),
                          lambda a, b, c: torch.nn.functional.gelu(a @ b + c), "float32"),
        "residual": ((x, w, residual), lambda a, b, r: a @ b + r, lambda a, b, r: a @ b + r, "float32"),
        "cast": ((x, w), lambda a, b: (a @ b).to(ember.float16), lambda a, b: (a @ b).half().double(), "float16"),
        "transposed read": ((x, w, other), lambda a, b, o: (a @ b) * o.mT, lambda a, b, o: (a @ b) * o.mT,
                            "float32"),
    }


@pytest.mark.parametrize("case", ["bias and gelu", "residual", "cast", "transposed read"])
def test_pointwise_consumers_of_the_product_run_in_the_epilogue(case, rng):
    arrays, fn, reference, dtype = _epilogue_cases(rng)[case]
    out = fn(*on("cuda", *arrays))
    p = plan(out)
    kernel, explained = only_gemm(p)
    assert explained["epilogue"] and not explained["mainloop"], str(p)
    assert kernel.outputs[0].dtype.name == dtype and out.dtype.name == dtype
    assert_matches(out, reference(*(t64(a) for a in arrays)), dtype)


def test_the_pre_activation_and_the_activation_are_stored_by_one_gemm(rng):
    a, b, bias = random(rng, 20, 24), random(rng, 24, 19), random(rng, 19)
    x, w, c = on("cuda", a, b, bias)
    h = x @ w + c
    g = F.gelu(h)
    p = plan(h, g)
    kernel, _ = only_gemm(p)
    assert len(kernel.outputs) == 2, str(p)
    with ember.explain.capture() as plans:
        ember.realize(h, g)
    assert len(plans) == 1 and len(plans[0].kernels) == 1, "\n".join(map(str, plans))
    th = t64(a) @ t64(b) + t64(bias)
    assert_matches(h, th, what="pre-activation")
    assert_matches(g, torch.nn.functional.gelu(th), what="activation")


@pytest.mark.parametrize("hidden,kinds", [(19, ["mlp"]), (190, ["matmul", "matmul"])])
def test_the_next_layers_gemm_reads_the_previous_epilogues_output(rng, hidden, kinds):
    """Narrow layers chain into one MLP kernel (the activation in registers); a layer wider than fits on
    chip reads the previous epilogue's stored output."""
    a, b, v = random(rng, 20, 24), random(rng, 24, hidden), random(rng, hidden, 7)
    x, w, u = on("cuda", a, b, v)
    out = F.relu(x @ w) @ u
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == kinds, str(p)
    assert_matches(out, torch.relu(t64(a) @ t64(b)) @ t64(v))


def test_row_and_column_reductions_of_the_epilogue_are_combined_across_tiles(rng):
    # 150 x 140 spans several tiles each way, so the partial reductions of the tiles must be combined
    a, b, bias = random(rng, 150, 24), random(rng, 24, 140), random(rng, 140)
    x, w, c = on("cuda", a, b, bias)
    h = F.gelu(x @ w + c)
    rows, cols, squares = h.sum(1), h.amax(0), (h * h).sum(1, keepdim=True)
    p = plan(h, rows, cols, squares)
    kernel, explained = only_gemm(p)
    assert len(kernel.reductions) == 3 and not explained["mainloop"], str(p)
    with ember.explain.capture() as plans:
        ember.realize(h, rows, cols, squares)
    assert len(plans[0].kernels) == 1
    th = torch.nn.functional.gelu(t64(a) @ t64(b) + t64(bias))
    assert_matches(rows, th.sum(1), what="row sums")
    assert_matches(cols, th.amax(0), what="column maxima")
    assert_matches(squares, (th * th).sum(1, keepdim=True), what="row sums of squares")


def test_an_epilogue_reduction_is_right_when_the_kernel_runs_again(rng):
    # the runtime fills the atomically combined outputs before each launch: a second run does not add
    a, b = random(rng, 40, 24), random(rng, 24, 30)
    x, w = on("cuda", a, b)
    first = (x @ w).sum(0).numpy()
    second = (x @ w).sum(0).numpy()
    np.testing.assert_allclose(second, first, rtol=1e-6)
    assert_matches(ember.tensor(second), (t64(a) @ t64(b)).sum(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mnk", [(1, 17, 33), (17, 1, 5), (70, 150, 24), (5, 40, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_a_heavy_epilogue_runs_over_each_half_of_the_tile(mnk, dtype, rng):
    """Bias, tanh GELU, two stored outputs and reductions of rows and columns: the epilogue runs on the left half of
    the tile's columns, then on the right half; every output element and both halves' partial sums land."""
    m, n, k = mnk
    a, b, bias = random(rng, m, k, dtype=dtype), random(rng, k, n, dtype=dtype), random(rng, n, dtype=dtype)
    x, w, c = on("cuda", a, b, bias)
    h = x @ w + c
    g = F.gelu(h, approximate="tanh")
    rows, cols = g.float().sum(1), g.float().amax(0)
    p = plan(h, g, rows, cols)
    gemm = next(kernel for kernel in p.kernels if kernel.core is not None)
    assert "acc_left, acc_right = tl.split(" in p.sources[id(gemm)].text, str(p)
    assert len(gemm.outputs) >= 2 and gemm.reductions, str(p)
    ember.realize(h, g, rows, cols)  # by the plan above (realized one by one, they would be other graphs)
    th = t64(a) @ t64(b) + t64(bias)
    if dtype == "bfloat16":  # torch rounds the GEMM's result to bfloat16 before the GELU reads it
        th = th.to(torch.bfloat16).double()
    tg = torch.nn.functional.gelu(th, approximate="tanh")
    assert_matches(h, th, dtype, what="pre-activation")
    assert_matches(g, tg, dtype, what="activation")
    assert_matches(rows, tg.sum(1), dtype, what="row sums")
    assert_matches(cols, tg.amax(0), dtype, what="column maxima")


def test_a_light_epilogue_runs_over_the_whole_tile(rng):
    a, b, residual = random(rng, 20, 24), random(rng, 24, 19), random(rng, 20, 19)
    out = (lambda x, w, r: x @ w + r)(*on("cuda", a, b, residual))
    p = plan(out)
    kernel, _ = only_gemm(p)
    assert "tl.split" not in p.sources[id(kernel)].text, str(p)
    assert_matches(out, t64(a) @ t64(b) + t64(residual))


@pytest.mark.parametrize("case", ["softmax", "bfloat16 sum"])
def test_a_reduction_the_tiles_cannot_combine_is_a_kernel_of_its_own(case, rng):
    if case == "softmax":  # the sum needs the max of the whole row first
        a, b = random(rng, 40, 24), random(rng, 24, 30)
        x, w = on("cuda", a, b)
        out = F.softmax(x @ w, dim=1)
        expected, dtype = torch.softmax(t64(a) @ t64(b), dim=1), "float32"
    else:  # atomics combine float32 partial sums only
        a, b = random(rng, 40, 24, dtype="bfloat16"), random(rng, 24, 30, dtype="bfloat16")
        x, w = on("cuda", a, b)
        out = (x @ w).sum(1)
        expected, dtype = (t64(a) @ t64(b)).sum(1), "bfloat16"
    p = plan(out)
    gemm = next(k for k in p.kernels if k.core is not None)
    assert not gemm.reductions and "reduce" in [k.kind.value for k in p.kernels], str(p)
    assert_matches(out, expected, dtype)


# -- the linear layer's backward --------------------------------------------------------------------

def _linear_grads(rng, activation: bool, batch=(50,)):
    xs, ws, bs = random(rng, *batch, 24), random(rng, 17, 24), random(rng, 17)
    gs = random(rng, *batch, 17)
    x, w, b = on("cuda", xs, ws, bs, grad=True)
    y = F.linear(x, w, b)
    if activation:
        y = F.gelu(y)
    y.backward(on("cuda", gs)[0])
    with ember.explain.capture() as plans:
        ember.realize(x.grad, w.grad, b.grad)
    tx, tw, tb = (t64(v).requires_grad_() for v in (xs, ws, bs))
    ty = torch.nn.functional.linear(tx, tw, tb)
    if activation:
        ty = torch.nn.functional.gelu(ty)
    ty.backward(t64(gs))
    for name, got, want in (("dx", x.grad, tx.grad), ("dW", w.grad, tw.grad), ("db", b.grad, tb.grad)):
        assert_matches(got, want, what=name)
    assert len(plans) == 1
    return plans[0]


def test_the_bias_gradient_is_summed_inside_the_weight_gradients_gemm(rng):
    p = _linear_grads(rng, activation=False)
    assert all(k.kind.value == "matmul" and k.core is not None for k in p.kernels), str(p)  # no reduce, no transpose
    (summing,) = [k for k in p.kernels if k.reductions]
    assert summing.core.shape == (17, 24), str(p)  # dW = g^T x, with db = sum of g over the batch
    assert any(line.startswith("%") and "sum(" in line for line in sections(p.describe(summing))["mainloop"]), str(p)


def test_the_activation_derivative_lands_in_a_gemm_of_the_linear_backward(rng):
    p = _linear_grads(rng, activation=True)
    assert len(p.kernels) <= 4, str(p)
    # GEMMs, of which the forward and the input gradient's may be one MLP kernel (the forward recomputed there)
    assert all(k.kind.value in ("matmul", "mlp") for k in p.kernels), str(p)
    # the derivative of gelu (its erf and exp) is computed beside a product, not in a kernel of its own
    explained = [sections(p.describe(k)) for k in p.kernels]
    assert any("exp(" in line for s in explained for line in s["epilogue"] + s["mainloop"]), str(p)
    assert any(k.reductions for k in p.kernels), str(p)


def test_a_batched_linear_backward_gives_torchs_gradients(rng):
    _linear_grads(rng, activation=True, batch=(3, 10))


# -- an operand's sum along K ------------------------------------------------------------------------

SUMS_ALONG_K = {  # name: (A's storage shape, B's storage shape, product, sum, position of the summed operand)
    "first operand": ((20, 24), (24, 19), lambda a, b: a @ b, lambda a, b: a.sum(1), 0),
    "second operand": ((20, 24), (24, 19), lambda a, b: a @ b, lambda a, b: b.sum(0), 1),
    "transposed first operand": ((24, 20), (24, 19), lambda a, b: a.mT @ b, lambda a, b: a.sum(0), 0),
    "transposed second operand": ((20, 24), (19, 24), lambda a, b: a @ b.mT, lambda a, b: b.sum(1), 1),
    "kept dimension": ((20, 24), (24, 19), lambda a, b: a @ b, lambda a, b: b.sum(0, keepdim=True), 1),
}


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("case", SUMS_ALONG_K)
def test_an_operands_sum_along_k_is_taken_in_the_mainloop(case, dtype, rng):
    """In float32 as a reduction in registers; in half precision by the matrix units, as the product with a
    tile of ones."""
    a_shape, b_shape, product, total, position = SUMS_ALONG_K[case]
    a, b = random(rng, *a_shape, dtype=dtype), random(rng, *b_shape, dtype=dtype)
    x, w = on("cuda", a, b)
    out, summed = product(x, w), total(x, w)
    p = plan(out, summed)
    kernel, explained = only_gemm(p)
    assert len(kernel.reductions) == 1 and len(kernel.outputs) == 2, str(p)
    assert any("sum(" in line for line in explained["mainloop"]), str(p)
    assert summed_operand(kernel.core, kernel.reductions[0]) == position
    assert_matches(out, product(t64(a), t64(b)), dtype, what="product")
    assert_matches(summed, total(t64(a), t64(b)), dtype, what="sum")


def test_a_sum_of_an_operand_along_another_axis_than_k_is_a_kernel_of_its_own(rng):
    a, b = random(rng, 20, 24), random(rng, 24, 19)
    x, w = on("cuda", a, b)
    out, summed = x @ w, x.sum(0)
    p = plan(out, summed)
    assert sorted(k.kind.value for k in p.kernels) == ["matmul", "reduce"], str(p)
    ember.realize(out, summed)
    assert_matches(out, t64(a) @ t64(b))
    assert_matches(summed, t64(a).sum(0))


# -- the split form ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["auto", "triton", "cublas"])
def test_every_gemm_backend_computes_the_same_fused_graph(backend, rng, monkeypatch):
    from ember.runtime import cuda

    monkeypatch.setattr(cuda, "gemm_backend", backend)
    a, b, bias = random(rng, 20, 24), random(rng, 24, 19), random(rng, 19)
    x, w, c = on("cuda", a, b, bias)
    out = F.gelu(F.relu(x) @ w + c)
    p = plan(out)
    kernel, explained = only_gemm(p)
    assert explained["mainloop"] and explained["epilogue"], str(p)
    assert [k.kind.value for k in kernel.payload.kernels] == ["pointwise", "matmul", "pointwise"], str(p)
    expected_choice = "cublas" if backend == "cublas" else "triton"  # "auto" times nothing without a GPU
    assert p.gemm_choices[0]["chosen"] == expected_choice
    before = cuda.stats["launches"]
    result = values(out)
    # the generated form is one launch; the split form, its prologue and epilogue kernels around cuBLAS
    assert cuda.stats["launches"] - before == (2 if expected_choice == "cublas" else 1)
    assert_matches(result, torch.nn.functional.gelu(torch.relu(t64(a)) @ t64(b) + t64(bias)))


@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_the_split_weight_gradient_sums_the_bias_gradient_in_a_kernel_of_its_own(backend, rng, monkeypatch,
                                                                                   tmp_path):
    from ember.runtime import cuda

    monkeypatch.setattr(cuda, "gemm_backend", backend)
    # no MLP chains: the forward and input-gradient GEMMs would chain and sum the weight gradient themselves,
    # leaving no split-K GEMM to test
    plan_unfused(monkeypatch, tmp_path)
    p = _linear_grads(rng, activation=True)
    (summing,) = [k for k in p.kernels if k.reductions]
    assert "reduce" in [k.kind.value for k in summing.payload.kernels], str(p)


@pytest.mark.parametrize("shared", [True, False])
def test_an_operand_two_gemms_recompute_is_computed_once_when_both_run_split(shared, rng, monkeypatch, tmp_path):
    """Two GEMMs reading one operand that each recomputes in its mainloop (a cross entropy's logits gradient, read
    by the input's and the weight's gradient GEMMs), both run in their split forms (cuBLAS): the first's split form
    computes the operand, the second reads it instead of computing it again; values as the reference's, fresh
    and read back from disk."""
    from ember.runtime import cuda, launcher, plan_cache

    monkeypatch.setattr(cuda, "gemm_backend", "cublas")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_cache, "_plans", {})
    if not shared:
        monkeypatch.setattr(launcher, "_share_split_forms", lambda plan, steps: None)
    a, w1, w2 = random(rng, 64, 48), random(rng, 48, 32), random(rng, 64, 40)

    def both(x, u, v):
        operand = (x * 1.5).sin() * x
        return operand @ u, operand.t() @ v

    expected = both(*(torch.tensor(t, dtype=torch.float64) for t in (a, w1, w2)))
    for fresh in (True, False):
        if not fresh:
            plan_cache.clear()  # as a new process would start: the plan read back from disk
        outs = both(*on("cuda", a, w1, w2))
        p = plan(*outs)
        assert [len(k.payload.kernels) for k in p.kernels] == [2, 2], str(p)  # each: the operand's kernel, cuBLAS
        before = cuda.stats["launches"]
        ember.realize(*outs)
        got = [o.numpy() for o in outs]
        assert cuda.stats["launches"] - before == (1 if shared else 2)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e.numpy(), rtol=1e-5, atol=1e-5)


def test_gemms_beside_one_another_in_a_parallel_group_share_no_split_forms_operand(rng, monkeypatch, tmp_path):
    """Three GEMMs recompute one operand; where the later two run beside one another in a parallel group of a
    captured graph (on two streams), neither reads the other's split-form result: one could still be writing it.
    Run one after another, both read the first's."""
    from ember.runtime import launcher, plan_cache

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_cache, "_plans", {})
    a, u, v, w = random(rng, 64, 48), random(rng, 48, 256), random(rng, 64, 8), random(rng, 48, 8)

    def three(x, p, q, r):  # (the operand dies with the call: no variable holds it, so it is not stored)
        operand = (x * 1.5).sin() * x
        return operand @ p, operand.t() @ q, operand @ r

    ember.realize(*three(*on("cuda", a, u, v, w)))
    (plan,) = [pl for pl in plan_cache._plans.values() if sum(ck.kernel.core is not None for ck in pl.kernels) == 3]
    gemms = [i for i, ck in enumerate(plan.kernels) if ck.kernel.core is not None]
    device = plan.kernels[gemms[0]].kernel.core.device

    def taken(groups):
        monkeypatch.setattr(plan.schedule, "groups", groups)
        steps = launcher._steps(plan, device, launcher.RunSettings.of(plan))
        return [bool(steps[i].taken) for i in gemms]

    assert taken([]) == [False, True, True]
    assert taken([(gemms[1], gemms[2] + 1)]) == [False, False, False]
    assert taken([(gemms[0], gemms[1] + 1)]) == [False, False, True]


# -- plan caches ------------------------------------------------------------------------------------

def test_a_repeated_gemm_step_hits_the_plan_cache_and_a_new_process_reads_it_from_disk(rng, tmp_path,
                                                                                         monkeypatch):
    from ember.runtime import cuda, plan_cache

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_cache, "_plans", {})
    a, b, bias = random(rng, 20, 24), random(rng, 24, 19), random(rng, 19)
    x, w, c = on("cuda", a, b, bias)

    def step():
        return F.gelu(F.relu(x) @ w + c).realize()

    expected = torch.nn.functional.gelu(torch.relu(t64(a)) @ t64(b) + t64(bias))
    before = dict(cuda.stats)

    def made(what: str) -> int:
        return cuda.stats[what] - before[what]

    for _ in range(3):
        assert_matches(step(), expected)
    assert (made("plans_compiled"), made("plan_hits")) == (1, 2)
    assert list((tmp_path / "plans").glob("*.pkl"))
    plan_cache.clear()  # as a new process would start
    assert_matches(step(), expected)
    assert (made("plans_compiled"), made("plans_loaded")) == (1, 1)
    monkeypatch.setattr(cuda, "gemm_backend", "cublas")  # another form: another plan
    assert_matches(step(), expected)
    assert made("plans_compiled") == 2
    plan_cache.clear()  # the split form read back: it finds the intermediates it stores
    assert_matches(step(), expected)
    assert made("plans_loaded") == 2


# -- autotune, without a GPU ---------------------------------------------------------------------

def _problem(m, n, k, dtype=ember.float32, layout="nn", batch=1, precision="ieee"):
    from ember.compiler.targets.triton import Launch
    from ember.runtime import autotune

    return autotune.Problem.of(Launch("kernel", [], {}, 0, gemm=(batch, m, n, k), precision=precision), dtype, layout)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("mnk", [(1, 1, 1), (17, 33, 5), (1000, 17, 9), (5, 1000, 17), (4096, 4096, 4096),
                                 (33, 17, 1000)])
@pytest.mark.parametrize("dtype", [ember.float32, ember.float16])
def test_the_default_configuration_fits_the_bucketed_problem(mnk, dtype):
    from ember.runtime import autotune

    problem = _problem(*mnk, dtype=dtype)
    for size, bucket in zip(mnk, (problem.m, problem.n, problem.k)):
        assert _is_power_of_two(bucket) and bucket >= max(size, 16)
        assert bucket < 2 * max(size, 16)
    config = autotune.default_config(problem)
    for block, bucket in ((config.block_m, problem.m), (config.block_n, problem.n), (config.block_k, problem.k)):
        assert _is_power_of_two(block) and 16 <= block <= bucket
    assert config.grid(1, *mnk[:2])[0] == math.ceil(mnk[0] / config.block_m) * math.ceil(mnk[1] / config.block_n)


def test_a_problem_key_tells_dtypes_layouts_sizes_batching_and_precision_apart():
    keys = {
        "base": _problem(100, 200, 300).key,
        "same bucket": _problem(128, 129 + 70, 257).key,
        "dtype": _problem(100, 200, 300, dtype=ember.float16).key,
        "layout": _problem(100, 200, 300, layout="tn").key,
        "other layout": _problem(100, 200, 300, layout="nt").key,
        "size": _problem(100, 200, 600).key,
        "batched": _problem(100, 200, 300, batch=4).key,
        "prologue": _problem(100, 200, 300, layout="pn").key,
    }
    assert keys["same bucket"] == keys["base"]
    assert keys["prologue"] == keys["base"]  # a prologue's operand is tuned as a plain one
    distinct = [keys[k] for k in ("base", "dtype", "layout", "other layout", "size", "batched")]
    assert len(set(distinct)) == len(distinct)
    assert _problem(100, 200, 300, precision="tf32").key != keys["base"]  # TF32 and IEEE dots are tuned apart


def test_the_matmul_precision_reaches_the_generated_dot_through_the_compile_context():
    a, b = (ember.randn(64, 32, device="cuda").realize(), ember.randn(32, 48, device="cuda").realize())

    def gemm_source(product):
        p = ember.explain.plan(product)
        (source,) = [p.sources[id(k)] for k in p.kernels if k.core is not None]
        return source

    precision = ember.get_matmul_precision()
    try:
        dots = {}
        for setting in ("highest", "high"):
            ember.set_matmul_precision(setting)
            source = gemm_source(a @ b)
            dots[setting] = (source.launches[0].precision, 'input_precision="tf32"' in source.text)
        assert dots == {"highest": ("ieee", False), "high": ("tf32", True)}
        assert gemm_source(a.half() @ b.half()).launches[0].precision == "ieee"  # only float32 tiles use TF32
    finally:
        ember.set_matmul_precision(precision)


def test_autotuning_is_off_under_the_interpreter_and_with_ember_autotune_0(monkeypatch):
    from ember.runtime import autotune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    for setting, mode in (("1", "1"), ("max", "max"), ("0", "0"), ("off", "0")):
        monkeypatch.setenv("EMBER_AUTOTUNE", setting)
        assert autotune.mode(interpret=False) == mode
    monkeypatch.setenv("EMBER_AUTOTUNE", "1")
    assert autotune.mode(interpret=True) == "0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # explain on a machine without a GPU
    assert autotune.mode(interpret=False) == "0"
    assert not autotune.enabled("0")
    assert autotune.cached("config anything", "0") is None
    problem = _problem(100, 200, 300)
    assert autotune.configs_for(problem, "0") == [autotune.default_config(problem)]  # nothing profiled


def test_a_plans_steps_are_given_the_autotune_mode_read_when_they_are_prepared(monkeypatch, fresh_caches):
    from ember.runtime import autotune, cuda, launcher, plan_cache

    asked = []
    monkeypatch.setattr(autotune, "mode", lambda interpret: asked.append(interpret) or "max")
    a = ember.randn(64, 32, device="cuda").realize()
    for _ in range(3):
        (a @ a.mT).relu().realize()
    steps = [step for plan in plan_cache._plans.values() for step in getattr(plan_cache.prepared(plan), "steps", [])]
    gemms = [step for step in steps if isinstance(step, launcher._GemmStep)]
    assert gemms and all(step.tuning == "max" for step in gemms)
    assert asked and set(asked) == {cuda.TARGET.interpret}  # once per plan prepared, for its runtime target


@pytest.mark.parametrize("mnk", [(512, 512, 512), (4096, 4096, 4096), (8192, 64, 4096), (64, 8192, 1024)])
@pytest.mark.parametrize("dtype", [ember.float16, ember.float32])
def test_the_short_list_is_bounded_fits_the_problem_and_holds_the_default(mnk, dtype):
    from ember.runtime import autotune

    problem = _problem(*mnk, dtype=dtype)
    short = autotune.candidates(problem, "1")
    assert short[0] == autotune.default_config(problem)
    assert 1 <= len(short) <= autotune.SHORT_LIST and len(set(short)) == len(short)
    assert all(c.block_m <= problem.m and c.block_n <= problem.n for c in short)
    assert len(autotune.candidates(problem, "max")) == len(autotune.CANDIDATES)


def test_the_fused_kernel_can_always_fall_back_on_the_default_configuration(monkeypatch):
    """The fastest bare tiles may not fit beside an epilogue: the size-based default is tried after them."""
    from ember.runtime import autotune

    problem = _problem(2048, 2048, 1024, dtype=ember.bfloat16)
    big = [autotune.Config(128, 256, 64, 8, 8, 4), autotune.Config(256, 128, 64, 8, 8, 3)]
    monkeypatch.setattr(autotune, "worth_tuning", lambda p, mode: True)
    monkeypatch.setattr(autotune, "cached_configs", lambda p, mode: [])
    monkeypatch.setattr(autotune, "_remember", lambda key, value: None)
    monkeypatch.setattr(autotune, "_profile_bare", lambda p, mode: [(c, 1.0) for c in big])
    assert autotune.configs_for(problem, "1") == [*big, autotune.default_config(problem)]
    monkeypatch.setattr(autotune, "_profile_bare", lambda p, mode: [(autotune.default_config(p), 1.0)])
    assert autotune.configs_for(problem, "1") == [autotune.default_config(problem)]


def test_gemms_too_small_to_matter_are_not_profiled(monkeypatch):
    """A GEMM of a microsecond takes the size-based configuration and its fused kernel: profiling it would
    spend seconds of compiling on the first step for nothing."""
    from ember.runtime import autotune

    monkeypatch.setattr(autotune, "_profile_bare", lambda problem, mode: pytest.fail(f"profiled {problem}"))
    small = _problem(64, 128, 64)  # under EMBER_AUTOTUNE=1 on a GPU machine
    assert not autotune.worth_tuning(small, "1")
    assert autotune.configs_for(small, "1") == [autotune.default_config(small)]
    assert autotune.worth_tuning(_problem(512, 512, 512), "1") and autotune.worth_tuning(_problem(4096, 4096, 64), "1")


class _Stream:
    """A GPU stream in simulation: the host issues work (a call takes `issue` ms of host time and `work` ms of the
    GPU's); the GPU runs it in order, once issued and once the work before it is done."""

    def __init__(self, issue: float, work: float, cycles_per_ms: float = 1e6):
        self.host = self.gpu = 0.0
        self.issue, self.work, self.cycles_per_ms = issue, work, cycles_per_ms

    def queue(self, ms: float) -> float:
        self.gpu = max(self.gpu, self.host) + ms
        return self.gpu

    def call(self) -> None:
        self.host += self.issue
        self.queue(self.work)

    def install(self, monkeypatch, autotune, sleep: bool) -> None:
        stream = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = stream.queue(0.0)

            def synchronize(self):
                stream.host = max(stream.host, self.at)

            def elapsed_time(self, other):
                return other.at - self.at

        monkeypatch.setattr(autotune.torch.cuda, "Event", Event)
        monkeypatch.setattr(autotune.torch.cuda, "synchronize", lambda: setattr(stream, "host", max(stream.host,
                                                                                                      stream.gpu)))
        monkeypatch.setattr(autotune.torch.cuda, "current_device", lambda: 0)
        if sleep:
            spin = lambda cycles: stream.queue(cycles / stream.cycles_per_ms)  # noqa: E731
            monkeypatch.setattr(autotune.torch.cuda, "_sleep", spin, raising=False)
        else:
            monkeypatch.delattr(autotune.torch.cuda, "_sleep", raising=False)
        monkeypatch.setattr(autotune.time, "perf_counter", lambda: stream.host / 1e3)
        monkeypatch.setattr(autotune, "_spin_rate", {})


@pytest.mark.parametrize("issue,work", [(0.3, 0.1), (0.02, 0.1), (5.0, 0.05)])
def test_a_timing_counts_the_gpus_time_not_the_hosts_time_to_issue_the_calls(issue, work, monkeypatch):
    """A split form issues a call in more host time than its GPU work takes; the steps replay as CUDA graphs, where
    the host's time is not spent, so the choice must compare GPU times: the GPU is held while the calls queue."""
    from ember.runtime import autotune

    stream = _Stream(issue, work)
    stream.install(monkeypatch, autotune, sleep=True)
    assert autotune.time_ms(stream.call) == pytest.approx(work)
    stream = _Stream(issue, work)  # a torch without its spinning kernel: the host's pace where it is the slower
    stream.install(monkeypatch, autotune, sleep=False)
    assert autotune.time_ms(stream.call) == pytest.approx(max(issue, work), rel=0.05)


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    from ember.runtime import autotune

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_entries", None)
    return tmp_path / "autotune" / "gemm.json"


def test_tuning_results_are_written_whole_and_read_back(tuning_cache):
    from ember.runtime import autotune

    autotune._store("config a", {"config": {"block_m": 64}, "ms": 0.5})
    autotune._store("choice b", {"chosen": "cublas"})
    assert json.loads(tuning_cache.read_text()) == {"config a": {"config": {"block_m": 64}, "ms": 0.5},
                                                    "choice b": {"chosen": "cublas"}}
    assert [p.name for p in tuning_cache.parent.iterdir()] == ["gemm.json"]  # no temporary file left
    autotune._entries = None  # as a new process would start
    assert autotune._load()["choice b"] == {"chosen": "cublas"}


def test_a_write_cut_short_leaves_the_previous_tuning_file_intact(tuning_cache, monkeypatch):

    from ember.runtime import autotune

    autotune._store("config a", {"ms": 1.0})
    real_fdopen = os.fdopen

    class CutShort:  # the temporary file a write goes through, which fills up halfway
        def __init__(self, handle, mode):
            self.file = real_fdopen(handle, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            raise OSError("disk full")

    monkeypatch.setattr(os, "fdopen", CutShort)
    with pytest.raises(OSError, match="disk full"):
        autotune._store("config b", {"ms": 2.0})
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert json.loads(tuning_cache.read_text()) == {"config a": {"ms": 1.0}}
    assert list(tuning_cache.parent.iterdir()) == [tuning_cache]  # the temporary file is gone


@pytest.mark.parametrize("content", ["{not json", "[1, 2, 3]", ""])
def test_a_corrupt_tuning_file_is_ignored_and_rewritten(content, tuning_cache):
    from ember.runtime import autotune

    tuning_cache.parent.mkdir(parents=True, exist_ok=True)
    tuning_cache.write_text(content)
    assert autotune._load() == {}
    autotune._store("config a", {"ms": 1.0})
    assert json.loads(tuning_cache.read_text()) == {"config a": {"ms": 1.0}}


def test_explain_names_the_configuration_and_the_form_a_gemm_runs_with(rng, monkeypatch):
    from ember.runtime import cuda

    x, w = on("cuda", random(rng, 20, 24), random(rng, 24, 19))
    out = F.relu(x) @ w
    text = str(plan(out))
    assert "triton GEMM, BLOCK 32x32x32, 4 warps, 3 stages; or cuBLAS + 1 kernel, not yet timed" in text
    monkeypatch.setattr(cuda, "gemm_backend", "cublas")
    assert "forced: cuBLAS + 1 kernel" in str(plan(out))


def test_a_generated_gemm_that_does_not_fit_the_gpu_runs_its_split_form(rng, monkeypatch):
    # an epilogue can need more shared memory than the bare GEMM whose configuration it runs with
    from ember.runtime import launcher

    failing = launcher._run_launches

    def out_of_resource(launches, ck, buffers, sig):
        if ck.kernel.core is not None:
            raise ember.CompileError("kernel failed: out of resource: shared memory, Required: 344064")
        return failing(launches, ck, buffers, sig)

    monkeypatch.setattr(launcher, "_run_launches", out_of_resource)
    a, b, bias = random(rng, 20, 24), random(rng, 24, 19), random(rng, 19)
    x, w, c = on("cuda", a, b, bias)
    out = F.gelu(x @ w + c)
    assert_matches(out, torch.nn.functional.gelu(t64(a) @ t64(b) + t64(bias)))


def test_explain_shows_why_a_producer_shared_by_two_gemms_is_recomputed(rng):
    a, b, c = random(rng, 64, 32), random(rng, 32, 48), random(rng, 32, 40)
    x, w1, w2 = on("cuda", a, b, c)

    def layers():  # the shared activation is not held by a variable, so it need not be stored
        h = F.relu(x * 2.5)
        return h @ w1, h @ w2

    p = plan(*layers())
    assert [k.kind.value for k in p.kernels] == ["matmul", "matmul"], str(p)
    for kernel in p.kernels:
        assert any("read by 2 ops, recomputed by each reader" in d for d in kernel.decisions), str(p)
    first, second = layers()
    h = torch.relu(t64(a) * 2.5)
    assert_matches(first, h @ t64(b))
    assert_matches(second, h @ t64(c))


# -- a long K split over several programs per tile ------------------------------------------------------

@pytest.fixture
def split_k(monkeypatch):
    """Split-K on, whatever the environment says."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")


@pytest.mark.parametrize(("mnk", "sms", "splits"), [
    ((64, 64, 2**18), 132, 256),  # a weight gradient of a 64-wide layer over 2^18 rows: K bounds the split
    ((128, 128, 2**18), 132, 132),  # 4 tiles: SPLIT_PROGRAMS_PER_SM programs per SM in all
    ((16, 64, 8192), 132, 8),  # K bounds the split: each program walks SPLIT_DEPTH
    ((16, 64, 3000), 132, 4),  # too short for SPLIT_MIN shares of SPLIT_DEPTH: SPLIT_MIN of at least SPLIT_MIN_DEPTH
    ((16, 64, 2000), 132, 1),  # too short for SPLIT_MIN shares at all
    ((64, 64, 1024), 132, 1),  # too short to share
    ((2048, 2048, 2**18), 132, 1),  # enough tiles to fill the GPU
    ((64, 64, 2**18), 0, 1),  # the SM count unknown (off the GPU)
    ((0, 64, 2**18), 132, 1),  # no tiles
])
def test_a_gemm_splits_a_long_k_only_where_its_tiles_leave_the_gpu_idle(mnk, sms, splits):
    from ember.compiler.patterns.gemm import gemm_splits

    assert gemm_splits(*mnk, sms) == splits


def test_split_k_is_on_by_default_and_ember_split_k_0_turns_it_off(rng, monkeypatch):
    monkeypatch.delenv("EMBER_SPLIT_K", raising=False)
    g, x = on("cuda", random(rng, 4096, 16, dtype="float16"), random(rng, 4096, 64, dtype="float16"))
    assert "K split" in str(plan(g.mT @ x))
    monkeypatch.setenv("EMBER_SPLIT_K", "0")
    g, x = on("cuda", random(rng, 4096, 16, dtype="float16"), random(rng, 4096, 64, dtype="float16"))
    p = plan(g.mT @ x)
    assert "K split" not in str(p) and p.sources[id(p.kernels[0])].launches[0].splits == 1, str(p)


SPLIT_CASES = [  # (M, N, K): few tiles, a long K; odd sizes leave partial tiles and a short last share
    pytest.param((16, 64, 4096), id="16x64x4096"),
    pytest.param((3, 5, 2049), id="3x5x2049"),
    pytest.param((1, 100, 4099), id="1x100x4099"),
    pytest.param((70, 1, 3000), id="70x1x3000"),
]


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("mnk", SPLIT_CASES)
def test_a_split_k_weight_gradient_with_its_epilogue_and_bias_sum_splits_k(mnk, dtype, rng, split_k):
    """The sum along K of an operand rides in the split GEMM's mainloop, in float32, in every dtype."""
    m, n, k = mnk
    gs, xs, bs = random(rng, k, m, dtype=dtype), random(rng, k, n, dtype=dtype), random(rng, n, dtype=dtype)
    g, x, b = on("cuda", gs, xs, bs)
    out = F.relu(g.mT @ x + b) * 0.3
    summed = x.sum(0)
    p = plan(out, summed)
    assert [k.kind.value for k in p.kernels] == ["matmul"], str(p)
    for kernel in p.kernels:
        splits = p.sources[id(kernel)].launches[0].splits
        assert kernel.core is not None and splits > 1, str(p)
        assert f"K split over {splits} programs per tile" in str(p)
    want = torch.relu(t64(gs).mT @ t64(xs) + t64(bs)) * 0.3
    for _ in range(3):  # every run writes its partials before it adds them: nothing left from the last
        again_out, again_sum = F.relu(g.mT @ x + b) * 0.3, x.sum(0)
        assert_matches(again_out, want, dtype, what="product")
        assert_matches(again_sum, t64(xs).sum(0), dtype, what="sum")


def test_a_linear_layers_gradients_over_a_long_batch_split_k_and_match_torch(rng, split_k, monkeypatch, tmp_path):
    # no MLP chains: the forward and input-gradient GEMMs would chain and sum the weight gradient themselves,
    # leaving no split-K GEMM to test
    plan_unfused(monkeypatch, tmp_path)
    xs, ws, bs, gs = random(rng, 3000, 24), random(rng, 17, 24), random(rng, 17), random(rng, 3000, 17)
    x, w, b = on("cuda", xs, ws, bs, grad=True)
    F.gelu(F.linear(x, w, b)).backward(on("cuda", gs)[0])
    with ember.explain.capture() as plans:
        ember.realize(x.grad, w.grad, b.grad)
    assert "K split over" in str(plans[0]), str(plans[0])
    tx, tw, tb = (t64(v).requires_grad_() for v in (xs, ws, bs))
    torch.nn.functional.gelu(torch.nn.functional.linear(tx, tw, tb)).backward(t64(gs))
    for name, got, want in (("dx", x.grad, tx.grad), ("dW", w.grad, tw.grad), ("db", b.grad, tb.grad)):
        assert_matches(got, want, what=name)
