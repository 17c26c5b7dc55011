"""Index ops against torch: gather, scatter_add, index_select, embedding, one_hot, integer and bool
tensor indexing, and item assignment (setitem), with gradients."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, FLOATS, TORCH, check_against_torch, check_finite_differences, random_array

import ember
from ember.explain import plan

pytestmark = pytest.mark.usefixtures("device")


def _index(rng, shape, size: int, dtype: str = "int64") -> np.ndarray:
    """Random indices into a dimension of `size` (repeats included)."""
    return rng.integers(0, size, size=shape).astype(dtype)


# -- gather, scatter_add, index_select -----------------------------------------------------------------

GATHER_CASES = {  # name: (input shape, dim, index shape)
    "dim0": ((4, 3), 0, (2, 3)),
    "dim1-longer-index": ((3, 5), 1, (3, 7)),
    "negative-dim": ((2, 3, 4), -1, (2, 3, 2)),
    "smaller-index": ((4, 5), 1, (2, 3)),
    "vector": ((6,), 0, (4,)),
    "empty-index": ((3, 4), 0, (0, 4)),
}


@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_torch(dtype, case, rng):
    shape, dim, index_shape = GATHER_CASES[case]
    x = random_array(rng, shape, dtype)
    index = _index(rng, index_shape, shape[dim])
    check_against_torch(lambda m, t, i: m.gather(t, dim, i), x, index)
    if dtype == "float32" and len(shape) > 1:
        check_against_torch(lambda m, t, i: t.gather(dim, i), x, index, layout="transposed")


SCATTER_CASES = {  # name: (input shape, dim, index shape, src shape)
    "dim0": ((4, 3), 0, (5, 3), (5, 3)),
    "dim1": ((3, 4), 1, (3, 6), (3, 6)),
    "src-larger": ((3, 4), 1, (2, 3), (3, 5)),
    "negative-dim": ((2, 3, 4), -2, (2, 5, 4), (2, 5, 4)),
    "vector": ((5,), 0, (8,), (8,)),
    "empty-index": ((3, 4), 0, (0, 4), (0, 4)),
    # one position per row: a pointwise select (cross entropy's backward, one-hot codes)
    "one-per-row": ((5, 7), 1, (5, 1), (5, 1)),
    "one-per-column": ((4, 3, 2), 0, (1, 3, 2), (1, 3, 2)),
    "one-per-row-src-larger": ((3, 6), 1, (3, 1), (3, 4)),
    "one-per-row-single": ((1, 1), 1, (1, 1), (1, 1)),
    "one-per-row-no-rows": ((0, 5), 1, (0, 1), (0, 1)),
    "all-into-one-element": ((1, 1), 1, (1, 3), (1, 3)),
}


@pytest.mark.parametrize("case", SCATTER_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_add_matches_torch(dtype, case, rng):
    shape, dim, index_shape, src_shape = SCATTER_CASES[case]
    x = random_array(rng, shape, dtype)
    src = random_array(rng, src_shape, dtype)
    index = _index(rng, index_shape, shape[dim])
    # torch's own backward rejects a src larger than the index; ember's is checked by finite differences
    grad = src_shape == index_shape
    check_against_torch(lambda m, t, i, s: m.scatter_add(t, dim, i, s), x, index, src, grad=grad)
    if dtype == "float32" and len(shape) > 1:
        check_against_torch(lambda m, t, i, s: t.scatter_add(dim, i, s), x, index, src, layout="transposed",
                            grad=grad)


def test_one_scatter_per_row_is_a_select_that_fuses_with_its_reader(rng):
    """scatter_add of one position per row writes no buffer of the input's size: the select is computed where
    it is read (here, a sum over the row in one kernel)."""
    x = ember.tensor(random_array(rng, (6, 50), "float32"))
    index = ember.tensor(_index(rng, (6, 1), 50))
    src = ember.tensor(random_array(rng, (6, 1), "float32"))
    total = (x.scatter_add(1, index, src) * x).sum(1)
    assert [k.kind.value for k in plan(total).kernels] == ["reduce"], str(plan(total))
    expected = (TORCH.tensor(x.numpy()).scatter_add(1, TORCH.tensor(index.numpy()), TORCH.tensor(src.numpy()))
                * TORCH.tensor(x.numpy())).sum(1)
    np.testing.assert_allclose(total.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)


INDEX_SELECT_CASES = {  # name: (input shape, dim, index length)
    "dim0": ((5, 3), 0, 4),
    "dim1": ((3, 5), 1, 7),
    "negative-dim": ((2, 3, 4), -1, 3),
    "empty-index": ((4, 3), 0, 0),
}


@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("case", INDEX_SELECT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_index_select_matches_torch(dtype, case, index_dtype, rng):
    shape, dim, n = INDEX_SELECT_CASES[case]
    x = random_array(rng, shape, dtype)
    index = _index(rng, (n,), shape[dim], index_dtype)
    check_against_torch(lambda m, t, i: m.index_select(t, dim, i), x, index)
    if dtype == "float32":
        check_against_torch(lambda m, t, i: t.index_select(dim, i), x, index, layout="transposed")


@pytest.mark.parametrize("name, fn", [
    ("gather", lambda m, t, i: m.gather(t, 1, i)),
    ("scatter_add", lambda m, t, i: m.scatter_add(t, 1, i, t * 2)),
    ("scatter_add-src-larger", lambda m, t, i: m.scatter_add(t, 1, i[:2, :3], t * 2)),
    ("index_select", lambda m, t, i: m.index_select(t, 1, i[0])),
], ids=lambda v: v if isinstance(v, str) else "")
def test_index_op_gradient_matches_finite_differences(name, fn, rng):
    check_finite_differences(fn, random_array(rng, (3, 4), "float64"), _index(rng, (3, 4), 4))


# -- embedding and one_hot -----------------------------------------------------------------------------

EMBEDDING_CASES = {  # name: (index shape, keyword arguments)
    "vector": ((4,), {}),
    "matrix": ((2, 3), {}),
    "padding-idx": ((3, 4), {"padding_idx": 1}),
    "negative-padding-idx": ((6,), {"padding_idx": -1}),
    "empty": ((0,), {}),
    "0d": ((), {}),
}


@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("case", EMBEDDING_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_matches_torch(dtype, case, index_dtype, rng):
    index_shape, kwargs = EMBEDDING_CASES[case]
    weight = random_array(rng, (5, 3), dtype)
    index = _index(rng, index_shape, 5, index_dtype)
    check_against_torch(lambda m, i, w: m.embedding(i, w, **kwargs), index, weight)


def test_embedding_gradient_matches_finite_differences(rng):
    index = _index(rng, (2, 3), 4)  # no padding_idx: its row's gradient is 0 by definition, not by calculus
    check_finite_differences(lambda m, i, w: m.embedding(i, w), index, random_array(rng, (4, 3), "float64"),
                             samples=12)


ONE_HOT_CASES = {  # name: (index shape, num_classes, index maximum)
    "given": ((5,), 6, 5),
    "inferred": ((5,), -1, 4),
    "matrix": ((2, 3), 4, 3),
    "empty": ((0,), 3, 2),
    "0d": ((), 3, 2),
}


@pytest.mark.parametrize("case", ONE_HOT_CASES)
def test_one_hot_matches_torch(case, rng):
    shape, num_classes, top = ONE_HOT_CASES[case]
    index = _index(rng, shape, top + 1)
    if case == "inferred":
        index.flat[0] = top  # the largest index fixes the number of classes
    check_against_torch(lambda m, i: m.one_hot(i, num_classes), index)


# -- indexing with tensors ---------------------------------------------------------------------------

GETITEM_CASES = {  # name: (function of the library, the input and the index tensors, input shape, index makers)
    "int-tensor": (lambda m, x, i: x[i], (5, 3), [lambda rng: _index(rng, (4,), 5)]),
    "int-tensor-2d": (lambda m, x, i: x[i], (5, 3), [lambda rng: _index(rng, (2, 2), 5)]),
    "int32-tensor": (lambda m, x, i: x[i], (5, 3), [lambda rng: _index(rng, (3,), 5, "int32")]),
    "negative-indices": (lambda m, x, i: x[i], (5, 3), [lambda rng: np.array([-1, 0, -5, 2])]),
    "second-dim": (lambda m, x, i: x[:, i], (3, 5), [lambda rng: _index(rng, (4,), 5)]),
    "two-tensors": (lambda m, x, i, j: x[i, j], (4, 5), [lambda rng: _index(rng, (2, 1), 4),
                                                         lambda rng: _index(rng, (3,), 5)]),
    "non-adjacent": (lambda m, x, i, j: x[i, :, j], (2, 3, 4), [lambda rng: _index(rng, (3,), 2),
                                                                lambda rng: _index(rng, (3,), 4)]),
    "adjacent-later": (lambda m, x, i, j: x[:, i, j], (2, 3, 4), [lambda rng: _index(rng, (2,), 3),
                                                                  lambda rng: _index(rng, (2,), 4)]),
    "int-then-tensor": (lambda m, x, i: x[0, :, i], (2, 3, 4), [lambda rng: _index(rng, (2,), 4)]),
    "tensor-then-int": (lambda m, x, i: x[i, 1], (2, 3, 4), [lambda rng: _index(rng, (3,), 2)]),
    "ellipsis-tensor": (lambda m, x, i: x[..., i], (2, 3, 4), [lambda rng: _index(rng, (2,), 4)]),
    "tensor-slice": (lambda m, x, i: x[i, 1:3], (4, 5), [lambda rng: _index(rng, (3,), 4)]),
    "tensor-none": (lambda m, x, i: x[None, i], (4, 5), [lambda rng: _index(rng, (3,), 4)]),
    "0d-tensor": (lambda m, x, i: x[i], (3, 4), [lambda rng: np.array(1)]),
    "empty-tensor": (lambda m, x, i: x[i], (3, 4), [lambda rng: np.zeros(0, dtype=np.int64)]),
    "list": (lambda m, x: x[[0, 2, 2]], (3, 4), []),
    "bool-mask": (lambda m, x, b: x[b], (3, 4), [lambda rng: random_array(rng, (3, 4), "bool")]),
    "bool-rows": (lambda m, x, b: x[b], (5, 3), [lambda rng: random_array(rng, (5,), "bool")]),
    "bool-columns": (lambda m, x, b: x[:, b], (3, 5), [lambda rng: random_array(rng, (5,), "bool")]),
    "bool-none-true": (lambda m, x, b: x[b], (3, 4), [lambda rng: np.zeros((3,), dtype=bool)]),
    "bool-0d": (lambda m, x, b: x[b], (3, 4), [lambda rng: np.array(True)]),
}


@pytest.mark.parametrize("case, dtype, layout", [
    pytest.param(case, dtype, layout, id=f"{case}-{dtype}-{layout}")
    for case in GETITEM_CASES for dtype in DTYPES
    for layout in (("contiguous", "transposed") if dtype == "float32" else ("contiguous",))])
def test_tensor_indexing_matches_torch(case, dtype, layout, rng):
    fn, shape, index_makers = GETITEM_CASES[case]
    x = random_array(rng, shape, dtype)
    indices = [make(rng) for make in index_makers]
    check_against_torch(fn, x, *indices, layout=layout)


@pytest.mark.parametrize("case", [c for c in GETITEM_CASES if not c.startswith(("bool-none", "empty"))])
def test_tensor_indexing_gradient_matches_finite_differences(case, rng):
    fn, shape, index_makers = GETITEM_CASES[case]
    check_finite_differences(fn, random_array(rng, shape, "float64"), *[make(rng) for make in index_makers],
                             samples=6)


def test_index_out_of_range_raises_like_torch():
    for m in (TORCH, ember):
        x = m.zeros(3, 4)
        with pytest.raises(IndexError):
            (x[m.tensor([0, 3])] + 1).sum().item()
        with pytest.raises((IndexError, RuntimeError)):
            m.gather(x, 1, m.tensor([[4]])).sum().item()


# -- setitem -------------------------------------------------------------------------------------------

def _assigned(index_fn):
    """y = x * 1; y[index] = v; y, built the same way for both libraries (a non-leaf, so gradients flow)."""
    def fn(m, x, v, *indices):
        y = x * 1 if x.dtype != m.bool else x.clone()
        y[index_fn(*indices)] = v
        return y
    return fn


SETITEM_CASES = {  # name: (index from the index tensors, input shape, value shape or scalar, index makers)
    "int": (lambda: 1, (3, 4), (4,), []),
    "negative-int": (lambda: -1, (3, 4), (4,), []),
    "slice": (lambda: slice(1, 3), (4, 3), (2, 3), []),
    "step-scalar": (lambda: slice(None, None, 2), (5, 3), 7, []),
    "broadcast-value": (lambda: (slice(None), slice(1, 3)), (3, 4), (2,), []),
    "ellipsis": (lambda: (Ellipsis, 0), (2, 3, 4), (2, 3), []),
    "none": (lambda: (None, 1), (3, 4), (1, 4), []),
    "everything": (lambda: Ellipsis, (2, 3), (2, 3), []),
    "tensor": (lambda i: i, (5, 3), (2, 3), [lambda rng: np.array([3, 1])]),
    "tensor-columns": (lambda i: (slice(None), i), (3, 5), (3, 2), [lambda rng: np.array([4, 0])]),
    "tensor-duplicates-scalar": (lambda i: i, (5, 3), 5, [lambda rng: np.array([0, 0, 2, 0])]),
    "two-tensors": (lambda i, j: (i, j), (4, 5), (3,), [lambda rng: np.array([0, 3, 1]),
                                                        lambda rng: np.array([4, 4, 0])]),
    "bool-mask-scalar": (lambda b: b, (3, 4), 0, [lambda rng: random_array(rng, (3, 4), "bool")]),
    "bool-rows": (lambda b: b, (4, 3), (3,), [lambda rng: np.array([True, False, True, True])]),
    "empty-slice": (lambda: slice(2, 2), (3, 4), 1, []),
}


@pytest.mark.parametrize("case, dtype", [
    pytest.param(case, dtype, id=f"{case}-{dtype}") for case in SETITEM_CASES for dtype in DTYPES])
def test_setitem_matches_torch(case, dtype, rng):
    index_fn, shape, value, index_makers = SETITEM_CASES[case]
    x = random_array(rng, shape, dtype)
    v = random_array(rng, value, dtype) if isinstance(value, tuple) else value
    check_against_torch(_assigned(index_fn), x, v, *[make(rng) for make in index_makers])


@pytest.mark.parametrize("case", [c for c in SETITEM_CASES if c != "empty-slice"])
def test_setitem_gradient_matches_finite_differences(case, rng):
    index_fn, shape, value, index_makers = SETITEM_CASES[case]
    v = random_array(rng, value, "float64") if isinstance(value, tuple) else value
    check_finite_differences(_assigned(index_fn), random_array(rng, shape, "float64"), v,
                             *[make(rng) for make in index_makers], samples=6)


@pytest.mark.parametrize("dtype", FLOATS)
def test_setitem_casts_value_to_the_tensor_dtype(dtype, rng):
    x = random_array(rng, (3, 4), dtype)
    check_against_torch(_assigned(lambda: (slice(None), 0)), x, np.arange(3, dtype=np.int64))
