"""Reductions against torch: one or several dims, keepdim, empty dims, result dtypes and gradients.

Test ids read `op-dtype-case`; a case names the input shape, the dims reduced and the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import (
    DTYPES,
    FLOATS,
    NUMERIC,
    TORCH,
    check_against_torch,
    check_finite_differences,
    random_array,
)

import ember
from ember.explain import plan

# torch warns when a variance over one element divides by zero; the NaN it gives is what is compared
pytestmark = [pytest.mark.usefixtures("device"),
              pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")]


def _dim_kwargs(dim, keepdim) -> dict:
    return {} if dim is None else {"dim": dim, "keepdim": keepdim}


@dataclass(frozen=True)
class Reduction:
    name: str
    fn: object  # (m, x, dim, keepdim) -> tensor or tuple
    dtypes: tuple
    dims: str  # "any": None, an int or a tuple; "int-or-none"; "int": a single dim is required; "given"
    identity: bool = False  # defined over an empty dim (sum is 0, prod 1, mean NaN...)
    low: float = -2.0
    high: float = 2.0


REDUCTIONS = [
    Reduction("sum", lambda m, x, d, k: m.sum(x, **_dim_kwargs(d, k)), DTYPES, "any", identity=True),
    Reduction("sum-dtype", lambda m, x, d, k: x.sum(**_dim_kwargs(d, k), dtype=m.float64), DTYPES, "any",
              identity=True),
    Reduction("mean", lambda m, x, d, k: m.mean(x, **_dim_kwargs(d, k)), FLOATS, "any", identity=True),
    Reduction("prod", lambda m, x, d, k: m.prod(x) if d is None else m.prod(x, d, keepdim=k), DTYPES, "int-or-none",
              identity=True, low=0.5, high=1.5),
    Reduction("amax", lambda m, x, d, k: m.amax(x, **_dim_kwargs(d, k)), DTYPES, "given"),
    Reduction("amin", lambda m, x, d, k: m.amin(x, **_dim_kwargs(d, k)), DTYPES, "given"),
    Reduction("max", lambda m, x, d, k: m.max(x), DTYPES, "none"),
    Reduction("min", lambda m, x, d, k: x.min(), DTYPES, "none"),
    Reduction("max-dim", lambda m, x, d, k: m.max(x, d, keepdim=k), DTYPES, "int"),
    Reduction("min-dim", lambda m, x, d, k: x.min(dim=d, keepdim=k), DTYPES, "int"),
    Reduction("argmax", lambda m, x, d, k: m.argmax(x, **_dim_kwargs(d, k)), NUMERIC, "int-or-none"),
    Reduction("argmin", lambda m, x, d, k: x.argmin(**_dim_kwargs(d, k)), NUMERIC, "int-or-none"),
    Reduction("var", lambda m, x, d, k: m.var(x, **_dim_kwargs(d, k)), FLOATS, "any", identity=True),
    Reduction("var-biased", lambda m, x, d, k: m.var(x, d, unbiased=False, keepdim=k), FLOATS, "any",
              identity=True),
    Reduction("var-correction", lambda m, x, d, k: m.var(x, d, keepdim=k, correction=0), FLOATS, "any",
              identity=True),
    Reduction("std", lambda m, x, d, k: m.std(x, **_dim_kwargs(d, k)), FLOATS, "any", identity=True),
    Reduction("std-biased", lambda m, x, d, k: x.std(d, unbiased=False, keepdim=k), FLOATS, "any", identity=True),
    Reduction("logsumexp", lambda m, x, d, k: m.logsumexp(x, d, keepdim=k), DTYPES, "given", identity=True),
    Reduction("softmax", lambda m, x, d, k: m.softmax(x, d), FLOATS, "int", identity=True),
    Reduction("softmax-dtype", lambda m, x, d, k: m.softmax(x, d, dtype=m.float64), FLOATS, "int", identity=True),
    Reduction("log_softmax", lambda m, x, d, k: m.log_softmax(x, d), FLOATS, "int", identity=True),
]

CASES = {  # name: (shape, dim, keepdim, layout)
    "all": ((3, 4), None, False, "contiguous"),
    "dim0": ((3, 4), 0, False, "contiguous"),
    "last-keepdim": ((2, 3, 4), -1, True, "contiguous"),
    "middle": ((2, 3, 4), 1, False, "contiguous"),
    "dims": ((2, 3, 4), (0, 2), False, "contiguous"),
    "dims-keepdim": ((2, 3, 4), (0, -1), True, "contiguous"),
    "dims-all": ((2, 3), (1, 0), False, "contiguous"),
    "0d": ((), None, False, "contiguous"),
    "0d-dim": ((), 0, False, "contiguous"),
    "vector": ((7,), 0, True, "contiguous"),
    "empty-kept": ((0, 3), 1, False, "contiguous"),
    "empty-reduced": ((0, 3), 0, False, "contiguous"),
    "empty-reduced-keepdim": ((2, 0), -1, True, "contiguous"),
    "transposed": ((4, 3), 0, False, "transposed"),
    "strided": ((3, 4), -1, True, "strided"),
    "ties": ((3, 4), 1, False, "contiguous"),  # values from {0, 1, 2}: extremes repeat
}


def _applies(op: Reduction, case: str) -> bool:
    _, dim, keepdim, _ = CASES[case]
    if case.startswith("empty-reduced") and not op.identity:
        return False
    if op.dims == "none":
        return dim is None
    if op.dims == "int":
        return isinstance(dim, int) and not (op.name.startswith(("softmax", "log_softmax")) and keepdim)
    if op.dims == "int-or-none":
        return not isinstance(dim, tuple)
    if op.dims == "given":
        return dim is not None
    return True


def _input(rng, op: Reduction, dtype: str, case: str) -> np.ndarray:
    shape = CASES[case][0]
    if case == "ties":
        return random_array(rng, shape, "int64", 0, 2).astype(ember.dtypes.as_dtype(dtype).np)
    low, high = (0, 3) if dtype == "uint8" else (op.low, op.high)
    return random_array(rng, shape, dtype, low, high)


@pytest.mark.parametrize("op, dtype, case", [
    pytest.param(op, dtype, case, id=f"{op.name}-{dtype}-{case}")
    for op in REDUCTIONS for dtype in op.dtypes for case in CASES if _applies(op, case)])
def test_reduction_matches_torch(op: Reduction, dtype, case, rng):
    shape, dim, keepdim, layout = CASES[case]
    x = _input(rng, op, dtype, case)
    check_against_torch(lambda m, t: op.fn(m, t, dim, keepdim), x, layout=layout)


@pytest.mark.parametrize("op, case", [
    pytest.param(op, case, id=f"{op.name}-{case}")
    for op in REDUCTIONS if "float64" in op.dtypes and not op.name.startswith("arg")
    for case in ("all", "last-keepdim", "dims", "dim0") if _applies(op, case)])
def test_reduction_gradient_matches_finite_differences(op: Reduction, case, rng):
    shape, dim, keepdim, _ = CASES[case]
    x = random_array(rng, shape, "float64", op.low, op.high)
    check_finite_differences(lambda m, t: op.fn(m, t, dim, keepdim), x)


EXTREMA_NEED_ELEMENTS = {
    "amax": lambda m, x: m.amax(x, 0),
    "amin": lambda m, x: m.amin(x, 0),
    "max-dim": lambda m, x: m.max(x, 0),
    "min-dim": lambda m, x: m.min(x, 0),
    "argmax": lambda m, x: m.argmax(x, 0),
    "argmin": lambda m, x: m.argmin(x),
    "max": lambda m, x: m.max(x),
}


@pytest.mark.parametrize("name", EXTREMA_NEED_ELEMENTS)
def test_extremum_over_empty_dim_raises_like_torch(name):
    fn = EXTREMA_NEED_ELEMENTS[name]
    with pytest.raises((IndexError, RuntimeError)):
        fn(TORCH, TORCH.zeros(0, 3))
    with pytest.raises((IndexError, ember.ShapeError)):
        fn(ember, ember.zeros(0, 3))


SPECIAL_ROWS = np.array([
    [math.nan, 1.0, 2.0],
    [math.inf, 1.0, 2.0],
    [-math.inf, -math.inf, -math.inf],
    [math.inf, math.inf, 1.0],
    [-math.inf, 0.0, 1.0],
    [math.inf, -math.inf, 0.0],
    [1e30, -1e30, 0.0],
])
SPECIAL_OPS = ["sum", "mean", "prod", "amax", "amin", "max-dim", "min-dim", "argmax", "argmin", "var", "logsumexp",
               "softmax", "log_softmax"]


@pytest.mark.parametrize("name", SPECIAL_OPS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduction_special_values_match_torch(name, dtype):
    op = next(o for o in REDUCTIONS if o.name == name)
    with np.errstate(over="ignore"):  # 1e30 is inf in half precision
        x = SPECIAL_ROWS.astype(ember.dtypes.as_dtype(dtype).np)
    check_against_torch(lambda m, t: op.fn(m, t, 1, False), x, grad=False)


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_rows_sum_to_one(dtype, rng):
    x = random_array(rng, (4, 6), dtype, -10, 10)
    total = ember.softmax(ember.tensor(x), -1).float().sum(-1).numpy()
    np.testing.assert_allclose(total, 1.0, rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-5)


@pytest.mark.parametrize("shape, dim", [((3, 7), 1), ((5, 4), 0), ((2, 1, 6), -1), ((0, 4), 1), ((4, 0), 1),
                                        ((1,), 0), ((), 0), ((2, 3, 5), 1)])
@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
def test_integer_cumsum_matches_torch_without_a_matrix_product(shape, dim, dtype, rng):
    """An integer cumsum is a masked sum the generated kernels compute (cuBLAS multiplies no integers, and a
    product moved to the host breaks CUDA graph capture: transformers' masks number positions by a cumsum)."""
    x = rng.integers(-50, 50, size=shape).astype(dtype) if dtype != "bool" else rng.random(shape) < 0.5
    got = ember.tensor(x).cumsum(dim)
    assert all(k.kind.value != "matmul" for k in plan(got).kernels), str(plan(got))
    expected = TORCH.tensor(x).cumsum(dim)
    assert got.dtype == ember.int64
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_cumsum_casts_to_the_dtype_asked_for_first_as_torch_does(dtype):
    """(EdgeNeXt's positional encoding sums a boolean mask with dtype=float32.)"""
    mask = np.array([[True, False, True, True], [False, True, True, False]])
    got = ember.tensor(mask).cumsum(1, dtype=dtype)
    expected = TORCH.tensor(mask).cumsum(1, dtype=getattr(TORCH, dtype))
    assert got.dtype == ember.dtypes.as_dtype(dtype)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
