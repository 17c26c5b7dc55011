"""Type promotion and broadcasting follow torch: property tests over random dtypes, operand kinds
(tensors with dims, 0-d tensors, Python scalars) and random shapes, errors included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DTYPES, TORCH, assert_same, to_torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

import ember

SETTINGS = settings(max_examples=examples(150), deadline=None)

dtype_names = st.sampled_from(DTYPES)


@pytest.mark.parametrize("b", DTYPES)
@pytest.mark.parametrize("a", DTYPES)
def test_promote_types_matches_torch_for_every_pair(a, b):
    got = ember.promote_types(getattr(ember, a), getattr(ember, b))
    assert got.name == str(torch.promote_types(getattr(torch, a), getattr(torch, b))).removeprefix("torch.")


@SETTINGS
@given(st.lists(dtype_names, min_size=1, max_size=4))
def test_promote_types_of_several_dtypes_folds_like_torch(names):
    want = getattr(torch, names[0])
    for n in names[1:]:
        want = torch.promote_types(want, getattr(torch, n))
    assert ember.promote_types(*(getattr(ember, n) for n in names)).name == str(want).removeprefix("torch.")


# -- operands: a tensor with dims, a 0-d tensor or a Python scalar ----------------------------------------

@st.composite
def operands(draw, allow_scalar: bool = True):
    """(ember operand, torch operand) holding the same small nonzero values."""
    kinds = ["tensor", "0d"] + (["scalar"] if allow_scalar else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "scalar":
        value = draw(st.one_of(st.booleans(), st.integers(1, 3), st.sampled_from([0.5, 1.5, 2.0, 3.0])))
        return value, value
    name = draw(dtype_names)
    shape = (3,) if kind == "tensor" else ()
    values = np.asarray(draw(st.lists(st.integers(1, 3), min_size=int(np.prod(shape)),
                                      max_size=int(np.prod(shape))))).reshape(shape)
    array = values.astype(bool) if name == "bool" else values.astype(ember.dtypes.as_dtype(name).np)
    return ember.tensor(array), to_torch(array)


@st.composite
def operand_pairs(draw):
    """Two operands, at least one of them a tensor."""
    first = draw(operands())
    second = draw(operands(allow_scalar=not isinstance(first[0], (bool, int, float))))
    return (first, second) if draw(st.booleans()) else (second, first)


@SETTINGS
@given(operand_pairs())
def test_result_type_matches_torch(pair):
    (ea, ta), (eb, tb) = pair
    assert ember.result_type(ea, eb).name == str(torch.result_type(ta, tb)).removeprefix("torch.")


BINARY_OPS = {
    "add": lambda m, a, b: a + b,
    "sub": lambda m, a, b: a - b,
    "mul": lambda m, a, b: a * b,
    "div": lambda m, a, b: a / b,
    "floordiv": lambda m, a, b: a // b,
    "remainder": lambda m, a, b: a % b,
    "pow": lambda m, a, b: a**b,
    "eq": lambda m, a, b: a == b,
    "lt": lambda m, a, b: a < b,
    "ge": lambda m, a, b: a >= b,
    "maximum": lambda m, a, b: m.maximum(a, b),
    "minimum": lambda m, a, b: m.minimum(a, b),
    "logical_and": lambda m, a, b: m.logical_and(a, b),
    "where": lambda m, a, b: m.where(m.ones(3, dtype=m.bool), a, b),
    "cat": lambda m, a, b: m.cat([a.reshape(-1), b.reshape(-1)]),
}
NEEDS_TENSORS = {"maximum", "minimum", "logical_and", "cat"}


@settings(max_examples=examples(400), deadline=None)
@given(st.sampled_from(sorted(BINARY_OPS)), operand_pairs())
def test_binary_op_result_dtype_and_values_match_torch(name, pair):
    (ea, ta), (eb, tb) = pair
    if name in NEEDS_TENSORS and not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)):
        return
    fn = BINARY_OPS[name]
    try:
        want = fn(TORCH, ta, tb)
    except (RuntimeError, TypeError, NotImplementedError):
        return  # an operation torch does not define for these dtypes (bool subtraction, ...)
    assert_same(fn(ember, ea, eb), want)


# -- broadcasting -------------------------------------------------------------------------------------------

@st.composite
def shape_pairs(draw):
    """Two shapes: usually broadcastable (derived from one shape), sometimes arbitrary."""
    base = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    if draw(st.integers(0, 3)) == 0:
        other = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
        return tuple(base), tuple(other)

    def derived():
        shape = [1 if draw(st.booleans()) else s for s in base]
        return tuple(shape[draw(st.integers(0, len(shape))):])

    return derived(), derived()


@SETTINGS
@given(shape_pairs())
def test_broadcasting_matches_torch_or_fails_where_torch_fails(shapes):
    a, b = shapes
    try:
        want = tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        with pytest.raises(ember.ShapeError):
            ember.broadcast_shapes(a, b)
        with pytest.raises(ember.ShapeError):
            ember.zeros(a) + ember.ones(b)
        return
    assert ember.broadcast_shapes(a, b) == want
    out = ember.zeros(a) + ember.ones(b)
    assert out.shape == want
    np.testing.assert_array_equal(out.numpy(), np.ones(want, dtype=np.float32))


@SETTINGS
@given(shape_pairs(), shape_pairs())
def test_where_broadcasts_three_shapes_like_torch(first, second):
    shapes = (first[0], first[1], second[0])
    try:
        want = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        with pytest.raises(ember.ShapeError):
            ember.where(ember.ones(shapes[0], dtype=ember.bool), ember.zeros(shapes[1]), ember.ones(shapes[2]))
        return
    out = ember.where(ember.ones(shapes[0], dtype=ember.bool), ember.zeros(shapes[1]), ember.ones(shapes[2]))
    assert out.shape == want


@SETTINGS
@given(st.lists(st.integers(1, 3), min_size=0, max_size=3), st.lists(st.integers(1, 3), min_size=0, max_size=3),
       st.lists(st.integers(1, 3), min_size=0, max_size=2))
def test_matmul_batch_dims_broadcast_like_torch(batch_a, batch_b, mnk):
    m, n, k = (mnk + [2, 3, 4])[:3]
    a, b = tuple(batch_a) + (m, k), tuple(batch_b) + (k, n)
    try:
        want = tuple((torch.ones(a) @ torch.ones(b)).shape)
    except RuntimeError:
        with pytest.raises(ember.ShapeError):
            ember.ones(a) @ ember.ones(b)
        return
    assert (ember.ones(a) @ ember.ones(b)).shape == want
