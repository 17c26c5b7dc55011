"""Sorting ops against torch: sort, argsort and topk (values, indices and gradients), and multinomial sampling
(its errors as torch's, its exact properties, and its distribution measured over many seeded draws)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import DTYPES, FLOATS, TORCH, check_against_torch, check_finite_differences, numpy_dtype, random_array

import ember

pytestmark = pytest.mark.usefixtures("device")


def _distinct(rng, shape, dtype: str) -> np.ndarray:
    """Values without ties (so that every order is torch's too), exact in every dtype: a permutation of small
    integers, in quarters for floats."""
    n = int(np.prod(shape))
    values = rng.permutation(n) - (0 if dtype in ("uint8", "bool") else n // 2)
    if dtype == "bool":
        return values.reshape(shape) > n // 2
    return (values / 4 if dtype in FLOATS else values).astype(numpy_dtype(dtype)).reshape(shape)


SORT_CASES = {  # name: (shape, dim)
    "vector": ((7,), 0),
    "rows": ((3, 5), -1),
    "columns": ((4, 3), 0),
    "middle-dim": ((2, 4, 3), 1),
    "size-1-dim": ((3, 1), 1),
    "empty-dim": ((2, 0), 1),
    "empty-other-dim": ((0, 3), 1),
    "0d": ((), 0),
}


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("case", SORT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_matches_torch_with_ties_kept_in_order(dtype, case, descending, rng):
    shape, dim = SORT_CASES[case]
    x = random_array(rng, shape, dtype, -3, 3)
    if dtype in FLOATS:
        x = np.asarray(np.round(x), dtype=x.dtype)  # ties
    check_against_torch(lambda m, t: m.sort(t, dim=dim, descending=descending, stable=True), x)


@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_of_a_non_contiguous_view_matches_torch(descending, layout, rng):
    x = _distinct(rng, (4, 5), "float32")
    check_against_torch(lambda m, t: t.sort(dim=0, descending=descending), x, layout=layout)
    check_against_torch(lambda m, t: t.sort(descending=descending), x, layout=layout)


@pytest.mark.parametrize("descending", [False, True])
def test_sort_orders_nan_as_largest_and_keeps_ties_in_order(descending):
    x = np.array([1.0, np.nan, -0.0, 2.0, np.nan, 0.0, 2.0, -np.inf, np.inf], np.float32)
    check_against_torch(lambda m, t: m.sort(t, descending=descending, stable=True), x)
    check_against_torch(lambda m, t: m.argsort(t, descending=descending, stable=True), x)


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
@pytest.mark.parametrize("case", ["rows", "columns", "0d", "empty-dim"])
def test_argsort_matches_torch(case, dtype, rng):
    shape, dim = SORT_CASES[case]
    x = _distinct(rng, shape, dtype)
    check_against_torch(lambda m, t: m.argsort(t, dim), x)
    check_against_torch(lambda m, t: t.argsort(dim=dim, descending=True), x)


TOPK_CASES = {  # name: (shape, k, dim)
    "vector": ((8,), 3, -1),
    "rows": ((3, 6), 2, 1),
    "columns": ((5, 3), 4, 0),
    "k-is-size": ((2, 4), 4, -1),
    "k-1": ((3, 5), 1, -1),
    "k-0": ((3, 5), 0, -1),
    "middle-dim": ((2, 5, 2), 3, 1),
    "empty-other-dim": ((0, 4), 2, 1),
    "0d": ((), 1, 0),
}


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("case", TOPK_CASES)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bool"])
def test_topk_matches_torch(dtype, case, largest, rng):
    shape, k, dim = TOPK_CASES[case]
    x = _distinct(rng, shape, dtype)
    check_against_torch(lambda m, t: m.topk(t, k, dim, largest=largest), x)


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_topk_of_a_non_contiguous_view_matches_torch(layout, rng):
    x = _distinct(rng, (5, 6), "float32")
    check_against_torch(lambda m, t: t.topk(3, dim=0), x, layout=layout)
    check_against_torch(lambda m, t: t.topk(2, largest=False), x, layout=layout)


def test_topk_takes_nan_as_the_largest_value():
    x = np.array([[1.0, np.nan, 3.0, -1.0], [2.0, 0.5, np.nan, np.nan]], np.float32)
    check_against_torch(lambda m, t: m.topk(t, 2), x)
    check_against_torch(lambda m, t: m.topk(t, 2, largest=False), x)


def test_topk_unsorted_gives_the_same_elements_as_sorted(rng):
    x = ember.tensor(_distinct(rng, (3, 7), "float32"))
    unsorted, ordered = x.topk(3, sorted=False), x.topk(3)
    np.testing.assert_array_equal(np.sort(unsorted.indices.numpy()), np.sort(ordered.indices.numpy()))
    np.testing.assert_array_equal(np.sort(unsorted.values.numpy()), np.sort(ordered.values.numpy()))


def test_sort_and_topk_results_name_their_values_and_indices(rng):
    x = ember.tensor(_distinct(rng, (6,), "float32"))
    for result in (ember.sort(x), x.topk(2)):
        values, indices = result
        assert result.values is values and result.indices is indices
        assert indices.dtype is ember.int64


@pytest.mark.parametrize("name, fn", [
    ("sort", lambda m, t: m.sort(t, dim=0).values),
    ("sort-descending", lambda m, t: m.sort(t, descending=True).values),
    ("topk", lambda m, t: m.topk(t, 2).values),
    ("topk-1", lambda m, t: m.topk(t, 1, dim=0, largest=False).values),
], ids=lambda v: v if isinstance(v, str) else "")
def test_sorted_values_gradient_matches_finite_differences(name, fn, rng):
    check_finite_differences(fn, _distinct(rng, (3, 4), "float64"), samples=12)


def test_sorting_errors_are_torch_s():
    x = ember.tensor(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    with pytest.raises(ember.ShapeError, match="topk: selected index k out of range"):
        ember.topk(x, 4)
    with pytest.raises(ember.ShapeError, match="selected index k out of range"):
        x.topk(-1)
    with pytest.raises(ember.ShapeError, match="selected index k out of range"):
        x.topk(3, dim=0)
    with pytest.raises(IndexError, match="sort: dimension 2 is out of range"):
        ember.sort(x, dim=2)
    with pytest.raises(IndexError, match="argsort"):
        x.argsort(dim=-3)
    with pytest.raises(ember.DTypeError, match="topk: does not support bool"):
        ember.topk(x > 1, 1)
    with pytest.raises(TypeError, match="sort: input must be an ember Tensor"):
        ember.sort(np.zeros(3))


# -- multinomial ---------------------------------------------------------------------------------------

def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square values a correct sampler exceeds with probability 1e-4 (3 and 11 degrees of freedom): the draws are
# seeded, so a pass is no accident of the day
CHI2_DF3, CHI2_DF11 = 21.1, 35.6
# draws per test: fewer through Triton's interpreter, which runs a program per row of keys (still at least ~7
# expected per category, where the chi-square test holds)
DRAWS = {"cpu": 4000, "cuda": 400}


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_multinomial_with_replacement_follows_the_weights(dtype, device):
    ember.manual_seed(1)
    weights = np.array([1.0, 2.0, 0.0, 5.0, 4.0], numpy_dtype(dtype))
    n = DRAWS[device]
    samples = ember.multinomial(ember.tensor(weights), n, replacement=True).numpy()
    assert samples.shape == (n,) and samples.dtype == np.int64
    counts = np.bincount(samples, minlength=5)
    assert counts[2] == 0  # a zero weight is never drawn
    p = np.array([1, 2, 5, 4]) / 12
    assert _chi_square(counts[[0, 1, 3, 4]], p) < CHI2_DF3


def test_multinomial_without_replacement_draws_as_one_at_a_time(device):
    """Over many rows of the same weights, the ordered pairs drawn have the probabilities of drawing one category,
    removing it, then drawing another: P(i, j) = w_i / S * w_j / (S - w_i)."""
    ember.manual_seed(2)
    w = np.array([1.0, 2.0, 3.0, 4.0])
    rows = DRAWS[device]
    samples = ember.tensor(np.tile(w.astype(np.float32), (rows, 1))).multinomial(2).numpy()
    assert samples.shape == (rows, 2)
    assert (samples[:, 0] != samples[:, 1]).all()
    pairs = list(itertools.permutations(range(4), 2))
    counts = np.array([np.sum((samples[:, 0] == i) & (samples[:, 1] == j)) for i, j in pairs])
    p = np.array([w[i] / w.sum() * w[j] / (w.sum() - w[i]) for i, j in pairs])
    assert _chi_square(counts, p) < CHI2_DF11


def test_multinomial_without_replacement_never_repeats_and_takes_zero_weights_last():
    ember.manual_seed(3)
    weights = np.array([[0.0, 3.0, 0.0, 1.0, 2.0, 0.0]] * 50, np.float32)
    samples = ember.multinomial(ember.tensor(weights), 6).numpy()
    for row in samples:
        assert sorted(row) == list(range(6))
        assert set(row[:3]) == {1, 3, 4}  # every positive weight before any zero one, as torch draws them
    assert set(ember.multinomial(ember.tensor(weights), 3).numpy().ravel()) == {1, 3, 4}


def test_multinomial_draws_the_same_samples_from_the_same_seed():
    weights = ember.tensor(np.array([[1.0, 2.0, 3.0], [3.0, 0.5, 0.5]], np.float32))
    ember.manual_seed(4)
    first = weights.multinomial(3, replacement=True).numpy(), weights.multinomial(2).numpy()
    ember.manual_seed(4)
    second = weights.multinomial(3, replacement=True).numpy(), weights.multinomial(2).numpy()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape, num_samples, replacement", [
    ((4,), 1, False), ((2, 3), 3, False), ((2, 3), 5, True), ((0, 3), 2, False), ((1, 1), 1, True)])
def test_multinomial_shapes_match_torch(shape, num_samples, replacement):
    ember.manual_seed(5)
    weights = np.ones(shape, np.float32)
    got = ember.multinomial(ember.tensor(weights), num_samples, replacement)
    want = TORCH.multinomial(TORCH.tensor(weights), num_samples, replacement)
    assert got.shape == tuple(want.shape) and got.dtype is ember.int64
    assert ((got.numpy() >= 0) & (got.numpy() < shape[-1])).all()


@pytest.mark.parametrize("weights, num_samples, replacement, error, message", [
    ([1.0, -1.0], 1, False, ValueError, "probability tensor contains either `inf`, `nan` or element < 0"),
    ([1.0, np.inf], 1, True, ValueError, "probability tensor contains either `inf`, `nan` or element < 0"),
    ([[1.0, 1.0], [np.nan, 1.0]], 1, False, ValueError, "probability tensor contains"),
    ([[1.0, 1.0], [0.0, 0.0]], 1, True, ValueError, "invalid multinomial distribution \\(sum of probabilities"),
    (np.ones((2, 0)), 1, True, ValueError, "invalid multinomial distribution"),
    ([1.0, 1.0], 3, False, ValueError, "cannot sample n_sample > prob_dist.size\\(-1\\) samples without"),
    ([1.0, 1.0], 0, True, ValueError, "cannot sample n_sample <= 0 samples"),
    ([[[1.0]]], 1, False, ember.ShapeError, "prob_dist must be 1 or 2 dim"),
    (1.0, 1, False, ember.ShapeError, "prob_dist must be 1 or 2 dim"),
    ([1, 2], 1, False, ember.DTypeError, "only supports floating-point dtypes"),
], ids=["negative", "inf", "nan", "zero-row", "no-categories", "too-many", "none", "3d", "0d", "integer"])
def test_multinomial_refuses_what_torch_refuses(weights, num_samples, replacement, error, message):
    with pytest.raises(RuntimeError):
        TORCH.multinomial(TORCH.tensor(weights), num_samples, replacement)
    with pytest.raises(error, match=message):
        ember.multinomial(ember.tensor(weights), num_samples, replacement)
