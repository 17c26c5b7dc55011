"""Creation ops against torch: tensors from data, constants, ranges, identity matrices, the
*_like family, NumPy and DLPack interchange, and the statistics and determinism of random draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import DTYPES, TORCH, assert_same, random_array, to_torch

import ember

pytestmark = pytest.mark.usefixtures("device")

# -- tensor -------------------------------------------------------------------------------------------

DATA = {  # name: data that torch.tensor and ember.tensor both accept
    "ints": [[1, 2, 3], [4, 5, 6]],
    "floats": [1.5, -2.0, 3.25],
    "positive-floats": [1.5, 0.25, 3.75],
    "bools": [True, False, True],
    "ints-and-floats": [1, 2.5, 3],
    "bools-and-ints": [True, 2, 3],
    "scalar-int": 7,
    "scalar-float": 2.5,
    "scalar-bool": False,
    "empty": [],
    "nested-empty": [[], []],
    "big-int": [2**40, -(2**40)],
    "special-floats": [math.nan, math.inf, -math.inf, -0.0],
}


@pytest.mark.parametrize("name", DATA)
def test_tensor_from_python_data_matches_torch(name):
    assert_same(ember.tensor(DATA[name]), TORCH.tensor(DATA[name]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["ints", "positive-floats", "bools", "scalar-int"])
def test_tensor_with_dtype_matches_torch(name, dtype):
    data = DATA[name]
    assert_same(ember.tensor(data, dtype=getattr(ember, dtype)), TORCH.tensor(data, dtype=getattr(torch, dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_from_numpy_array_keeps_its_dtype(dtype, rng):
    array = random_array(rng, (2, 3), dtype)
    assert_same(ember.tensor(array), to_torch(array))


def test_tensor_from_a_tensor_copies_values_and_drops_the_graph(rng):
    x = ember.tensor(random_array(rng, (3,), "float32"), requires_grad=True)
    y = ember.tensor(x * 2)
    assert not y.requires_grad and y.is_leaf
    np.testing.assert_array_equal(y.numpy(), x.numpy() * 2)


def test_tensor_requires_grad_makes_a_leaf():
    x = ember.tensor([1.0, 2.0], requires_grad=True)
    assert x.requires_grad and x.is_leaf


# -- constants ----------------------------------------------------------------------------------------

CONSTANTS = {  # name: function of the library
    "zeros": lambda m: m.zeros(2, 3),
    "zeros-tuple": lambda m: m.zeros((2, 3)),
    "zeros-list": lambda m: m.zeros([4]),
    "zeros-0d": lambda m: m.zeros(()),
    "zeros-empty": lambda m: m.zeros(0, 3),
    "zeros-int": lambda m: m.zeros(2, dtype=m.int32),
    "ones": lambda m: m.ones(3, 2),
    "ones-bool": lambda m: m.ones(2, 2, dtype=m.bool),
    "ones-half": lambda m: m.ones((2,), dtype=m.float16),
    "full-float": lambda m: m.full((2, 3), 1.5),
    "full-int": lambda m: m.full((2, 3), 7),
    "full-bool": lambda m: m.full((2,), True),
    "full-dtype": lambda m: m.full((3,), 2, dtype=m.float64),
    "full-nan": lambda m: m.full((2,), math.nan),
    "full-bfloat16": lambda m: m.full((2,), 1.1, dtype=m.bfloat16),
    "eye": lambda m: m.eye(3),
    "eye-rectangular": lambda m: m.eye(2, 4),
    "eye-tall": lambda m: m.eye(4, 2),
    "eye-empty": lambda m: m.eye(0),
    "eye-int": lambda m: m.eye(3, dtype=m.int64),
    "eye-bool": lambda m: m.eye(2, dtype=m.bool),
}


@pytest.mark.parametrize("name", CONSTANTS)
def test_constants_match_torch(name):
    fn = CONSTANTS[name]
    assert_same(fn(ember), fn(TORCH))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_has_the_shape_and_dtype_asked(dtype):
    x = ember.empty(2, 3, dtype=getattr(ember, dtype))
    assert x.shape == (2, 3) and x.dtype is getattr(ember, dtype)
    assert ember.empty((0,)).shape == (0,)


# -- ranges -------------------------------------------------------------------------------------------

RANGES = {  # name: function of the library
    "arange-end": lambda m: m.arange(5),
    "arange-start-end": lambda m: m.arange(2, 7),
    "arange-negative": lambda m: m.arange(-3, 3, 2),
    "arange-descending": lambda m: m.arange(5, 0, -1),
    "arange-float-step": lambda m: m.arange(1, 2, 0.25),
    "arange-float-start": lambda m: m.arange(0.5, 3),
    "arange-tenths": lambda m: m.arange(0, 1, 0.1),
    "arange-inexact-end": lambda m: m.arange(0, 1.05, 0.35),
    "arange-empty": lambda m: m.arange(3, 3),
    "arange-int32": lambda m: m.arange(4, dtype=m.int32),
    "arange-float64": lambda m: m.arange(0, 5, dtype=m.float64),
    "arange-half": lambda m: m.arange(0, 3, 0.5, dtype=m.float16),
    "arange-float-to-int": lambda m: m.arange(0.5, 4.5, dtype=m.int64),
    "linspace": lambda m: m.linspace(0, 1, 5),
    "linspace-negative": lambda m: m.linspace(-2, 3, 7),
    "linspace-descending": lambda m: m.linspace(5, -5, 11),
    "linspace-one": lambda m: m.linspace(0, 1, 1),
    "linspace-zero": lambda m: m.linspace(0, 1, 0),
    "linspace-float64": lambda m: m.linspace(0, 1, 7, dtype=m.float64),
    "linspace-int": lambda m: m.linspace(0, 10, 5, dtype=m.int64),
    "linspace-long": lambda m: m.linspace(-1, 1, 1000),
}


@pytest.mark.parametrize("name", RANGES)
def test_ranges_match_torch(name):
    fn = RANGES[name]
    assert_same(fn(ember), fn(TORCH))


@pytest.mark.parametrize("args", [(0, 5, 0), (5, 0, 1), (0, 1, -0.5)],
                         ids=["zero-step", "wrong-sign", "wrong-sign-float"])
def test_arange_with_bad_step_raises_like_torch(args):
    with pytest.raises(RuntimeError):
        torch.arange(*args)
    with pytest.raises(ValueError):
        ember.arange(*args)


# -- the *_like family --------------------------------------------------------------------------------

LIKE = {  # name: function of the library and a tensor
    "zeros_like": lambda m, x: m.zeros_like(x),
    "ones_like": lambda m, x: m.ones_like(x),
    "full_like": lambda m, x: m.full_like(x, 3),
    "zeros_like-dtype": lambda m, x: m.zeros_like(x, dtype=m.float64),
    "ones_like-dtype": lambda m, x: m.ones_like(x, dtype=m.int8),
    "full_like-dtype": lambda m, x: m.full_like(x, 1.5, dtype=m.bfloat16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LIKE)
def test_like_constants_match_torch(name, dtype, rng):
    x = random_array(rng, (2, 3), dtype)
    fn = LIKE[name]
    assert_same(fn(ember, ember.tensor(x)), fn(TORCH, to_torch(x)))


RANDOM_LIKE = {
    "empty_like": lambda m, x: m.empty_like(x),
    "rand_like": lambda m, x: m.rand_like(x),
    "randn_like": lambda m, x: m.randn_like(x),
    "randint_like": lambda m, x: m.randint_like(x, 10),
    "randint_like-range": lambda m, x: m.randint_like(x, 2, 10),
}


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("name", RANDOM_LIKE)
def test_random_like_has_the_shape_and_dtype_of_its_model(name, dtype, rng):
    x = random_array(rng, (3, 2), dtype)
    fn = RANDOM_LIKE[name]
    e, t = fn(ember, ember.tensor(x)), fn(TORCH, to_torch(x))
    assert e.shape == tuple(t.shape) and e.dtype.name == str(t.dtype).removeprefix("torch.")
    assert np.all(np.isfinite(e.numpy().astype(np.float64)))


# -- NumPy and DLPack -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_from_numpy_keeps_dtype_and_values(dtype, rng):
    array = random_array(rng, (3, 4), dtype)
    assert_same(ember.from_numpy(array), to_torch(array))
    transposed = array.T  # a non-contiguous array
    assert_same(ember.from_numpy(transposed), to_torch(np.ascontiguousarray(transposed)))
    zero_d = np.asarray(array[0, 0])
    assert_same(ember.from_numpy(zero_d), to_torch(zero_d))


def test_from_numpy_rejects_other_data():
    with pytest.raises(TypeError):
        ember.from_numpy([1, 2, 3])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bfloat16"])
def test_from_dlpack_accepts_torch_and_numpy(dtype, rng):
    array = random_array(rng, (2, 3), dtype)
    source = to_torch(array)
    assert_same(ember.from_dlpack(source), source)
    assert_same(ember.from_dlpack(array), source)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bfloat16"])
def test_torch_reads_ember_tensors_through_dlpack(dtype, rng):
    array = random_array(rng, (2, 3), dtype)
    x = ember.tensor(array) * 1 if dtype != "bool" else ember.tensor(array)
    assert_same(x, torch.from_dlpack(x))


# -- random numbers -------------------------------------------------------------------------------------

N = 20_000


def test_rand_is_uniform_on_the_unit_interval():
    ember.manual_seed(1)
    x = ember.rand(N).numpy()
    assert x.dtype == np.float32 and x.min() >= 0 and x.max() < 1
    assert abs(x.mean() - 0.5) < 0.01
    assert abs(x.var() - 1 / 12) < 0.005
    counts, _ = np.histogram(x, bins=10, range=(0, 1))
    assert np.all(np.abs(counts - N / 10) < 5 * math.sqrt(N / 10))


def test_randn_is_standard_normal():
    ember.manual_seed(2)
    x = ember.randn(N).numpy().astype(np.float64)
    assert abs(x.mean()) < 0.03
    assert abs(x.std() - 1) < 0.03
    assert abs(np.mean(np.abs(x) < 1) - 0.6827) < 0.015  # one standard deviation
    assert abs(np.mean(x**3)) < 0.1  # symmetric


@pytest.mark.parametrize("low, high", [(0, 10), (3, 7), (-5, 5), (0, 2)])
def test_randint_covers_its_range_evenly(low, high):
    ember.manual_seed(3)
    x = ember.randint(low, high, (N,)).numpy()
    assert x.dtype == np.int64 and x.min() == low and x.max() == high - 1
    counts = np.bincount(x - low, minlength=high - low)
    assert np.all(np.abs(counts - N / (high - low)) < 5 * math.sqrt(N / (high - low)))


def test_randint_with_only_high_and_a_dtype():
    x = ember.randint(4, (3, 5), dtype=ember.int32)
    assert x.shape == (3, 5) and x.dtype is ember.int32
    assert x.numpy().min() >= 0 and x.numpy().max() < 4


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("draw", ["rand", "randn"])
def test_random_draws_take_the_dtype_asked(draw, dtype):
    x = getattr(ember, draw)(2, 3, dtype=getattr(ember, dtype))
    assert x.shape == (2, 3) and x.dtype is getattr(ember, dtype)


DRAWS = {
    "rand": lambda: ember.rand(4, 5),
    "randn": lambda: ember.randn(20),
    "randint": lambda: ember.randint(0, 1000, (20,)),
    "rand_like": lambda: ember.rand_like(ember.zeros(3, 4)),
    "randperm": lambda: ember.randperm(20),
}


@pytest.mark.parametrize("name", DRAWS)
def test_manual_seed_makes_draws_repeat(name):
    draw = DRAWS[name]
    ember.manual_seed(1234)
    first, second = draw().numpy(), draw().numpy()
    ember.manual_seed(1234)
    again_first, again_second = draw().numpy(), draw().numpy()
    np.testing.assert_array_equal(first, again_first)
    np.testing.assert_array_equal(second, again_second)
    assert not np.array_equal(first, second), "successive draws must differ"
    ember.manual_seed(4321)
    assert not np.array_equal(draw().numpy(), first), "another seed must give other values"


def test_a_lazy_random_tensor_keeps_its_values():
    ember.manual_seed(5)
    x = ember.rand(6)
    y = x * 2
    np.testing.assert_array_equal(y.numpy(), x.numpy() * 2)
    np.testing.assert_array_equal(x.numpy(), x.numpy())


def test_initial_seed_reports_the_manual_seed():
    ember.manual_seed(77)
    assert ember.initial_seed() == 77


def test_randperm_is_a_permutation():
    ember.manual_seed(9)
    p = ember.randperm(50).numpy()
    assert p.dtype == np.int64
    np.testing.assert_array_equal(np.sort(p), np.arange(50))

