"""Contractions and pooling against torch: matmul (batched, broadcast, 1-d operands), einsum (implicit and
explicit outputs, ellipses, diagonals, broadcasting, several operands), conv2d (stride, padding incl. 'same',
dilation, groups), max/avg/adaptive pooling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FLOATS, INTS, TORCH, check_against_torch, check_finite_differences, random_array

import ember
from ember.ir import Op
from ember.ir.ops import RULES
from ember.tensor import apply

pytestmark = pytest.mark.usefixtures("device")

# sums of many rounded products: half-precision results are compared a little more loosely
HALF_TOLERANCE = {"float16": dict(rtol=2e-2, atol=2e-2), "bfloat16": dict(rtol=3e-2, atol=5e-2)}
HALF_GRAD_TOLERANCE = {"float16": dict(grad_rtol=3e-2, grad_atol=3e-2),
                       "bfloat16": dict(grad_rtol=5e-2, grad_atol=1e-1)}


def _tolerance(dtype: str) -> dict:
    return {**HALF_TOLERANCE.get(dtype, {}), **HALF_GRAD_TOLERANCE.get(dtype, {})}


def _inputs(rng, shapes, dtype):
    low, high = (0, 3) if dtype == "uint8" else (-2, 2)
    return [random_array(rng, s, dtype, low, high) for s in shapes]


# -- matmul ---------------------------------------------------------------------------------------

MATMUL_CASES = {  # name: (left shape, right shape, layout)
    "vector-vector": ((5,), (5,), "contiguous"),
    "vector-matrix": ((4,), (4, 3), "contiguous"),
    "matrix-vector": ((3, 4), (4,), "contiguous"),
    "matrix-matrix": ((3, 4), (4, 5), "contiguous"),
    "batched": ((2, 3, 4), (2, 4, 5), "contiguous"),
    "batch-broadcast": ((2, 1, 3, 4), (5, 4, 2), "contiguous"),
    "batch-matrix": ((2, 3, 4), (4, 5), "contiguous"),
    "matrix-batch": ((3, 4), (2, 4, 5), "contiguous"),
    "batch-vector": ((2, 3, 4), (4,), "contiguous"),
    "vector-batch": ((4,), (2, 4, 5), "contiguous"),
    "empty-rows": ((0, 3), (3, 4), "contiguous"),
    "empty-inner": ((3, 0), (0, 4), "contiguous"),
    "empty-batch": ((0, 2, 3), (3, 4), "contiguous"),
    "transposed": ((3, 4), (4, 5), "transposed"),
    "strided": ((3, 4), (4, 6), "strided"),
}
MATMUL_FORMS = {
    "matmul": lambda m, a, b: m.matmul(a, b),
    "operator": lambda m, a, b: a @ b,
}
MATMUL_DTYPES = FLOATS + INTS


@pytest.mark.parametrize("case", MATMUL_CASES)
@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_matmul_matches_torch(dtype, case, rng):
    left, right, layout = MATMUL_CASES[case]
    a, b = _inputs(rng, (left, right), dtype)
    check_against_torch(MATMUL_FORMS["operator"], a, b, layout=layout, **_tolerance(dtype))


@pytest.mark.parametrize("case", ["vector-vector", "matrix-matrix", "batch-broadcast", "vector-batch"])
def test_matmul_function_form_matches_torch(case, rng):
    left, right, _ = MATMUL_CASES[case]
    a, b = _inputs(rng, (left, right), "float32")
    check_against_torch(MATMUL_FORMS["matmul"], a, b)


@pytest.mark.parametrize("case", [c for c in MATMUL_CASES if not c.startswith("empty")])
def test_matmul_gradient_matches_finite_differences(case, rng):
    left, right, _ = MATMUL_CASES[case]
    check_finite_differences(MATMUL_FORMS["operator"], *_inputs(rng, (left, right), "float64"))


@pytest.mark.parametrize("name, fn, shapes", [
    ("mm", lambda m, a, b: m.mm(a, b), [(3, 4), (4, 2)]),
    ("bmm", lambda m, a, b: m.bmm(a, b), [(2, 3, 4), (2, 4, 2)]),
    ("dot", lambda m, a, b: m.dot(a, b), [(4,), (4,)]),
    ("linear", lambda m, x, w, b: m.linear(x, w, b), [(2, 3, 4), (5, 4), (5,)]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_matmul_variants_match_torch(name, fn, shapes, rng):
    check_against_torch(fn, *_inputs(rng, shapes, "float32"))


@pytest.mark.parametrize("left, right", [((3, 4), (3, 4)), ((2, 3, 4), (3, 4, 5)), ((4,), (3,)), ((), (3,))],
                         ids=["inner", "batch", "vectors", "scalar"])
def test_matmul_shape_mismatch_raises_like_torch(left, right):
    with pytest.raises(RuntimeError):
        TORCH.ones(left) @ TORCH.ones(right)
    with pytest.raises(ember.ShapeError):
        ember.ones(left) @ ember.ones(right)


# -- einsum ---------------------------------------------------------------------------------------

EINSUM_CASES = {  # name: (equation, operand shapes)
    "matmul": ("ij,jk->ik", [(3, 4), (4, 5)]),
    "implicit-output": ("ij,jk", [(3, 4), (4, 2)]),
    "implicit-upper-case-first": ("bA", [(2, 3)]),
    "batched": ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    "batch-not-leading": ("ibj,jbk->bki", [(3, 2, 4), (4, 2, 2)]),
    "several-summed": ("ijk,jil->kl", [(2, 3, 4), (3, 2, 5)]),
    "transpose": ("ij->ji", [(3, 4)]),
    "sum-all": ("ij->", [(3, 4)]),
    "diagonal": ("ii->i", [(4, 4)]),
    "trace": ("ii", [(3, 3)]),
    "triple-diagonal": ("iii->i", [(3, 3, 3)]),
    "diagonal-and-more": ("iij,jk->ik", [(3, 3, 2), (2, 4)]),
    "outer": ("i,j->ij", [(3,), (4,)]),
    "dot": ("i,i->", [(5,)] * 2),
    "elementwise": ("ij,ij->ij", [(2, 3)] * 2),
    "chain": ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    "three-way": ("i,jk,k->ij", [(2,), (3, 4), (4,)]),
    "ellipsis": ("...ij->...ji", [(2, 3, 4)]),
    "ellipsis-summed": ("...ij->ji", [(2, 3, 4)]),
    "ellipsis-last": ("...ij->ji...", [(2, 3, 4)]),
    "ellipsis-broadcast": ("...,...", [(4, 3), (3,)]),
    "ellipsis-batch": ("b...i,b...i->b...", [(2, 3, 4), (2, 1, 4)]),
    "ellipsis-covering-nothing": ("...ij,jk->...ik", [(3, 4), (4, 2)]),
    "broadcast-summed": ("ij,jk->ik", [(2, 3), (1, 4)]),
    "scalar": ("", [()]),
    "scalar-times": (",ij->ij", [(), (2, 3)]),
    "size-1-dims": ("ij,jk->ik", [(1, 1), (1, 3)]),
    "empty-rows": ("ij,jk->ik", [(0, 3), (3, 4)]),
    "empty-summed": ("ij,jk->ik", [(2, 0), (0, 4)]),
    "empty-dot": ("i,i->", [(0,)] * 2),
}
EINSUM_DTYPES = FLOATS + ("int32", "int64")


@pytest.mark.parametrize("case", EINSUM_CASES)
@pytest.mark.parametrize("dtype", EINSUM_DTYPES)
def test_einsum_matches_torch(dtype, case, rng):
    equation, shapes = EINSUM_CASES[case]
    operands = _inputs(rng, shapes, dtype)
    check_against_torch(lambda m, *xs: m.einsum(equation, *xs), *operands, **_tolerance(dtype))


@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("case", ["matmul", "batched", "diagonal", "chain", "ellipsis-batch"])
def test_einsum_of_non_contiguous_views_matches_torch(case, layout, rng):
    equation, shapes = EINSUM_CASES[case]
    check_against_torch(lambda m, *xs: m.einsum(equation, *xs), *_inputs(rng, shapes, "float32"), layout=layout)


@pytest.mark.parametrize("case", ["batch-not-leading", "diagonal-and-more", "three-way", "ellipsis-broadcast",
                                  "broadcast-summed", "trace"])
def test_einsum_gradient_matches_finite_differences(case, rng):
    equation, shapes = EINSUM_CASES[case]
    check_finite_differences(lambda m, *xs: m.einsum(equation, *xs), *_inputs(rng, shapes, "float64"), samples=6)


def test_einsum_takes_operands_as_a_list_or_subscripts_as_sublists(rng):
    a, b = _inputs(rng, [(3, 4), (4, 5)], "float32")
    check_against_torch(lambda m, x, y: m.einsum("ij,jk", [x, y]), a, b)
    check_against_torch(lambda m, x, y: m.einsum(x, [0, 1], y, [1, 2], [0, 2]), a, b)
    check_against_torch(lambda m, x, y: m.einsum(x, [0, 1], y, [1, 2]), a, b)
    check_against_torch(lambda m, x: m.einsum(x, [Ellipsis, 27], [27, Ellipsis]), a)


def test_einsum_contracts_two_operands_with_a_matmul(rng):
    """So that its contractions run as GEMM kernels (or the vendor's matmul), not as a broadcast product and a sum."""
    a, b = (ember.tensor(x) for x in _inputs(rng, [(2, 3, 4), (2, 4, 5)], "float32"))
    seen, stack = set(), [ember.einsum("bij,bjk->bik", a, b)._node]
    while stack:
        node = stack.pop()
        seen.add(node.op)
        stack.extend(node.inputs)
    assert Op.MATMUL in seen and Op.SUM not in seen


@pytest.mark.parametrize("equation, shapes, error, message", [
    ("ij,jk->ik", [(2, 3)], ValueError, "fewer operands were provided than specified"),
    ("ij->ij", [(2, 3), (3, 4)], ValueError, "more operands were provided than specified"),
    ("i1,jk->ik", [(2, 3), (3, 4)], ValueError, "invalid subscript given at index 1"),
    ("ij-", [(2, 3)], ValueError, "invalid subscript given at index 2"),
    ("ijk->ik", [(2, 3)], ember.ShapeError, "number of subscripts in the equation \\(3\\) does not match"),
    ("ij...k", [(2, 3)], ember.ShapeError, "number of subscripts in the equation \\(3\\) is more than"),
    ("ii->i", [(2, 3)], ember.ShapeError, "subscript i is repeated for operand 0 but the sizes don't match"),
    ("ij->ii", [(2, 3)], ValueError, "output subscript i appears more than once"),
    ("ij->k", [(2, 3)], ValueError, "output subscript k does not appear"),
    ("ij,jk->ik", [(2, 3), (4, 4)], ember.ShapeError, "subscript j has size 4 for operand 1 which does not broadcast"),
    ("...,...", [(5, 3), (2,)], ember.ShapeError, "covered by ellipsis in operand 1 has size 2"),
    ("i.j", [(2, 3)], ValueError, "found '.' for operand 0 that is not part of any ellipsis"),
    ("...i...", [(2, 3)], ValueError, "for which an ellipsis was already found"),
], ids=["fewer", "more", "digit", "dash", "too-many-subscripts", "too-many-with-ellipsis", "diagonal-sizes",
        "repeated-output", "unknown-output", "sizes", "ellipsis-sizes", "lone-dot", "two-ellipses"])
def test_einsum_misuse_raises_like_torch(equation, shapes, error, message):
    with pytest.raises(RuntimeError):
        TORCH.einsum(equation, *[TORCH.ones(s) for s in shapes])
    with pytest.raises(error, match=message):
        ember.einsum(equation, *[ember.ones(s) for s in shapes])


def test_einsum_refuses_mixed_and_bool_dtypes_and_missing_operands():
    with pytest.raises(ember.DTypeError, match="einsum: operands must have the same dtype"):
        ember.einsum("i,i", ember.ones(2), ember.ones(2, dtype=ember.float64))
    with pytest.raises(ember.DTypeError, match="einsum: bool operands"):
        ember.einsum("i,i", ember.ones(2) > 0, ember.ones(2) > 0)
    with pytest.raises(ValueError, match="must specify the equation string and at least one operand"):
        ember.einsum("ij")
    with pytest.raises(TypeError, match="einsum: operands\\[0\\] must be an ember Tensor"):
        ember.einsum("i", np.ones(2))


# -- conv2d ---------------------------------------------------------------------------------------

CONV_CASES = {  # name: (input shape, weight shape, keyword arguments, layout)
    "basic": ((2, 3, 6, 5), (4, 3, 3, 3), {}, "contiguous"),
    "bias": ((1, 2, 5, 5), (3, 2, 3, 3), {"bias": True}, "contiguous"),
    "stride": ((1, 2, 7, 6), (3, 2, 3, 3), {"stride": 2}, "contiguous"),
    "stride-pair": ((1, 2, 7, 6), (3, 2, 2, 3), {"stride": (2, 1)}, "contiguous"),
    "padding": ((1, 2, 5, 4), (3, 2, 3, 3), {"padding": 1}, "contiguous"),
    "padding-pair": ((1, 2, 5, 4), (3, 2, 3, 3), {"padding": (2, 1)}, "contiguous"),
    "padding-same": ((1, 2, 5, 4), (3, 2, 3, 3), {"padding": "same"}, "contiguous"),
    "padding-same-even-kernel": ((1, 2, 5, 5), (3, 2, 4, 2), {"padding": "same"}, "contiguous"),
    "padding-same-dilated": ((1, 2, 7, 6), (2, 2, 3, 2), {"padding": "same", "dilation": 2}, "contiguous"),
    "padding-valid": ((1, 2, 5, 4), (3, 2, 3, 3), {"padding": "valid"}, "contiguous"),
    "dilation": ((1, 2, 8, 7), (3, 2, 3, 3), {"dilation": 2}, "contiguous"),
    "dilation-pair": ((1, 2, 8, 7), (3, 2, 3, 2), {"dilation": (1, 3)}, "contiguous"),
    "groups": ((2, 4, 5, 5), (6, 2, 3, 3), {"groups": 2, "bias": True}, "contiguous"),
    "depthwise": ((1, 3, 5, 5), (6, 1, 3, 3), {"groups": 3}, "contiguous"),
    "everything": ((2, 4, 9, 8), (4, 2, 3, 2), {"stride": (2, 3), "padding": (1, 2), "dilation": (2, 1),
                                                 "groups": 2, "bias": True}, "contiguous"),
    "one-by-one": ((2, 3, 4, 4), (5, 3, 1, 1), {}, "contiguous"),
    "kernel-covers-input": ((1, 2, 3, 3), (2, 2, 3, 3), {}, "contiguous"),
    "unbatched": ((3, 5, 5), (2, 3, 3, 3), {"padding": 1}, "contiguous"),
    "empty-batch": ((0, 2, 5, 5), (3, 2, 3, 3), {}, "contiguous"),
    "transposed": ((1, 2, 5, 6), (3, 2, 3, 2), {"stride": 2}, "transposed"),
    "strided": ((1, 2, 5, 6), (3, 2, 3, 2), {"padding": 1}, "strided"),
}


def _conv(m, x, w, *rest, kwargs):
    kwargs = dict(kwargs)
    bias = rest[0] if kwargs.pop("bias", False) else None
    return m.conv2d(x, w, bias, **kwargs)


def _conv_inputs(rng, case, dtype):
    xs, ws, kwargs, _ = CONV_CASES[case]
    shapes = [xs, ws] + ([(ws[0],)] if kwargs.get("bias") else [])
    return _inputs(rng, shapes, dtype)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype", FLOATS + ("int64",))
def test_conv2d_matches_torch(dtype, case, rng):
    _, _, kwargs, layout = CONV_CASES[case]
    inputs = _conv_inputs(rng, case, dtype)
    check_against_torch(lambda m, *xs: _conv(m, *xs, kwargs=kwargs), *inputs, layout=layout, **_tolerance(dtype))


@pytest.mark.parametrize("case", [c for c in CONV_CASES if c != "empty-batch"])
def test_conv2d_gradient_matches_finite_differences(case, rng):
    kwargs = CONV_CASES[case][2]
    check_finite_differences(lambda m, *xs: _conv(m, *xs, kwargs=kwargs), *_conv_inputs(rng, case, "float64"))


@pytest.mark.parametrize("name, x, w, kwargs", [
    ("channels", (1, 3, 5, 5), (2, 2, 3, 3), {}),
    ("groups", (1, 4, 5, 5), (3, 2, 3, 3), {"groups": 2}),
    ("kernel-too-large", (1, 2, 2, 2), (1, 2, 3, 3), {}),
    ("same-strided", (1, 2, 5, 5), (1, 2, 3, 3), {"padding": "same", "stride": 2}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_conv2d_misuse_raises_like_torch(name, x, w, kwargs):
    with pytest.raises((RuntimeError, ValueError)):
        TORCH.conv2d(TORCH.ones(x), TORCH.ones(w), **kwargs)
    with pytest.raises((ember.ShapeError, ValueError)):
        ember.conv2d(ember.ones(x), ember.ones(w), **kwargs)


TRANSPOSE_CASES = {  # name: (input shape, weight shape (C, O/groups, kH, kW), keyword arguments)
    "basic": ((2, 3, 5, 4), (3, 4, 3, 3), {}),
    "bias": ((1, 2, 4, 4), (2, 3, 3, 3), {"bias": True}),
    "stride-output-padding": ((1, 2, 4, 5), (2, 3, 3, 2), {"stride": (2, 3), "output_padding": (1, 2)}),
    "padding-dilation": ((1, 2, 5, 5), (2, 2, 3, 3), {"padding": 1, "dilation": 2}),
    "groups": ((2, 4, 3, 3), (4, 3, 2, 2), {"groups": 2, "bias": True, "stride": 2}),
    "depthwise": ((1, 3, 4, 4), (3, 1, 3, 3), {"groups": 3}),
    "one-by-one": ((2, 3, 4, 4), (3, 5, 1, 1), {}),
    "unbatched": ((3, 4, 4), (3, 2, 3, 3), {"stride": 2}),
    "empty-batch": ((0, 2, 3, 3), (2, 3, 3, 3), {}),
}


def _conv_transpose(m, x, w, *rest, kwargs):
    kwargs = dict(kwargs)
    bias = rest[0] if kwargs.pop("bias", False) else None
    return m.conv_transpose2d(x, w, bias, **kwargs)


def _transpose_inputs(rng, case, dtype):
    xs, ws, kwargs = TRANSPOSE_CASES[case]
    shapes = [xs, ws] + ([(ws[1] * kwargs.get("groups", 1),)] if kwargs.get("bias") else [])
    return _inputs(rng, shapes, dtype)


@pytest.mark.parametrize("case", TRANSPOSE_CASES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_conv_transpose2d_matches_torch(dtype, case, rng):
    kwargs = TRANSPOSE_CASES[case][2]
    check_against_torch(lambda m, *xs: _conv_transpose(m, *xs, kwargs=kwargs), *_transpose_inputs(rng, case, dtype),
                        **_tolerance(dtype))


@pytest.mark.parametrize("case", [c for c in TRANSPOSE_CASES if c != "empty-batch"])
def test_conv_transpose2d_gradient_matches_finite_differences(case, rng):
    kwargs = TRANSPOSE_CASES[case][2]
    check_finite_differences(lambda m, *xs: _conv_transpose(m, *xs, kwargs=kwargs),
                             *_transpose_inputs(rng, case, "float64"))


@pytest.mark.parametrize("x, w, kwargs, error", [
    ((1, 3, 4, 4), (2, 3, 3, 3), {}, ember.ShapeError),  # input channels are the weight's first axis
    ((1, 4, 4, 4), (4, 3, 3, 3), {"groups": 3}, ember.ShapeError),
    ((1, 2, 4, 4), (2, 3, 3, 3), {"stride": 2, "output_padding": 2}, ValueError),
    ((1, 2, 1, 1), (2, 3, 1, 1), {"padding": 1}, ember.ShapeError),
], ids=["channels", "groups", "output-padding", "empty-output"])
def test_conv_transpose2d_misuse_raises_like_torch(x, w, kwargs, error):
    with pytest.raises((RuntimeError, ValueError)):
        TORCH.conv_transpose2d(TORCH.ones(x), TORCH.ones(w), **kwargs)
    with pytest.raises(error, match="conv_transpose2d"):
        ember.conv_transpose2d(ember.ones(x), ember.ones(w), **kwargs)


# A convolution's gradients are primitives of their own (cuDNN's backward-data and backward-filter on a GPU);
# their own gradients (a double backward) are convolutions and each other, checked against torch's.
SECOND_ORDER_CASES = [c for c in CONV_CASES if c not in ("unbatched", "empty-batch", "padding-same",
                                                         "padding-same-even-kernel", "padding-same-dilated")]


def _conv_attrs(kwargs: dict) -> dict:
    pair = lambda v: tuple(v) if isinstance(v, tuple) else (v, v)  # noqa: E731
    padding = kwargs.get("padding", 0)
    padding = (0, 0) if padding == "valid" else pair(padding)
    return {"stride": pair(kwargs.get("stride", 1)), "padding": padding,
            "dilation": pair(kwargs.get("dilation", 1)), "groups": kwargs.get("groups", 1)}


@pytest.mark.parametrize("case", SECOND_ORDER_CASES)
def test_conv2d_gradient_primitives_differentiate_like_torch_double_backward(case, rng):
    xs, ws, kwargs, _ = CONV_CASES[case]
    attrs = _conv_attrs(kwargs)
    x, w = (random_array(rng, shape, "float64") for shape in (xs, ws))
    y_shape = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), **attrs).shape
    g, hx, hw = (random_array(rng, shape, "float64") for shape in (tuple(y_shape), xs, ws))
    tx, tw, tg = (torch.tensor(a, requires_grad=True) for a in (x, w, g))
    conv = (attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"])
    gx = torch.nn.grad.conv2d_input(xs, tw, tg, *conv)
    gw = torch.nn.grad.conv2d_weight(tx, ws, tg, *conv)
    expected_dgrad = torch.autograd.grad(gx, (tg, tw), torch.tensor(hx))
    expected_wgrad = torch.autograd.grad(gw, (tx, tg), torch.tensor(hw))
    ex, ew, eg = (ember.tensor(a) for a in (x, w, g))
    dgrad = RULES[Op.CONV2D_INPUT_GRAD].vjp(ember.tensor(hx), (eg, ew), None, {**attrs, "input_size": xs[2:]})
    wgrad = RULES[Op.CONV2D_WEIGHT_GRAD].vjp(ember.tensor(hw), (ex, eg), None, {**attrs, "kernel_size": ws[2:]})
    for got, want in zip((*dgrad, *wgrad), (*expected_dgrad, *expected_wgrad)):
        assert got.shape == tuple(want.shape)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["everything", "depthwise", "stride", "empty-batch"])
def test_conv2d_gradient_primitives_match_torch_backward_kernels(case, rng):
    """The reference implementations (cpu) and the vendor calls (cuda) of both gradients, on their own."""
    xs, ws, kwargs, _ = CONV_CASES[case]
    attrs = _conv_attrs(kwargs)
    x, w = (random_array(rng, shape, "float32") for shape in (xs, ws))
    g = random_array(rng, tuple(torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), **attrs).shape),
                     "float32")
    conv = (attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"])
    want_x = torch.nn.grad.conv2d_input(xs, torch.tensor(w), torch.tensor(g), *conv).numpy()
    want_w = torch.nn.grad.conv2d_weight(torch.tensor(x), ws, torch.tensor(g), *conv).numpy()
    got_x = apply(Op.CONV2D_INPUT_GRAD, ember.tensor(g), ember.tensor(w), input_size=xs[2:], **attrs)
    got_w = apply(Op.CONV2D_WEIGHT_GRAD, ember.tensor(x), ember.tensor(g), kernel_size=ws[2:], **attrs)
    np.testing.assert_allclose(got_x.numpy(), want_x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_w.numpy(), want_w, rtol=1e-4, atol=1e-4)


def test_a_conv2d_gradient_of_the_wrong_shape_is_refused():
    attrs = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}
    with pytest.raises(ember.ShapeError, match="conv2d_input_grad"):
        apply(Op.CONV2D_INPUT_GRAD, ember.ones((1, 3, 4, 4)), ember.ones((3, 2, 3, 3)), input_size=(5, 5), **attrs)
    with pytest.raises(ember.ShapeError, match="conv2d_weight_grad"):
        apply(Op.CONV2D_WEIGHT_GRAD, ember.ones((1, 2, 5, 5)), ember.ones((1, 3, 4, 4)), kernel_size=(3, 3), **attrs)


# -- pooling --------------------------------------------------------------------------------------

POOL_CASES = {  # name: (function of the library and the input, input shape)
    "max": (lambda m, x: m.max_pool2d(x, 2), (2, 3, 6, 5)),
    "max-stride": (lambda m, x: m.max_pool2d(x, 3, stride=2), (1, 2, 7, 8)),
    "max-padding": (lambda m, x: m.max_pool2d(x, 3, stride=2, padding=1), (1, 2, 7, 6)),
    "max-dilation": (lambda m, x: m.max_pool2d(x, 2, stride=1, dilation=2), (1, 2, 6, 6)),
    "max-ceil": (lambda m, x: m.max_pool2d(x, 2, ceil_mode=True), (1, 2, 5, 7)),
    "max-ceil-padding": (lambda m, x: m.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True), (1, 1, 6, 8)),
    "max-rectangular": (lambda m, x: m.max_pool2d(x, (2, 3), stride=(1, 2)), (1, 2, 5, 7)),
    "max-unbatched": (lambda m, x: m.max_pool2d(x, 2), (3, 4, 4)),
    "max-empty-batch": (lambda m, x: m.max_pool2d(x, 2), (0, 2, 4, 4)),
    "avg": (lambda m, x: m.avg_pool2d(x, 2), (2, 3, 6, 5)),
    "avg-stride": (lambda m, x: m.avg_pool2d(x, 3, stride=2), (1, 2, 7, 8)),
    "avg-padding": (lambda m, x: m.avg_pool2d(x, 3, stride=2, padding=1), (1, 2, 7, 6)),
    "avg-padding-exclude": (lambda m, x: m.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
                            (1, 2, 7, 6)),
    "avg-ceil": (lambda m, x: m.avg_pool2d(x, 2, ceil_mode=True), (1, 2, 5, 7)),
    "avg-ceil-padding": (lambda m, x: m.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True), (1, 1, 6, 8)),
    "avg-ceil-padding-exclude": (lambda m, x: m.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
                                 (1, 1, 6, 8)),
    "avg-divisor": (lambda m, x: m.avg_pool2d(x, 2, divisor_override=3), (1, 2, 4, 4)),
    "avg-unbatched": (lambda m, x: m.avg_pool2d(x, 2), (3, 4, 4)),
    "avg-empty-batch": (lambda m, x: m.avg_pool2d(x, 2, padding=1, count_include_pad=False), (0, 2, 4, 4)),
    "adaptive-divisible": (lambda m, x: m.adaptive_avg_pool2d(x, (2, 3)), (2, 3, 6, 6)),
    "adaptive-uneven": (lambda m, x: m.adaptive_avg_pool2d(x, (3, 4)), (1, 2, 7, 5)),
    "adaptive-one": (lambda m, x: m.adaptive_avg_pool2d(x, 1), (2, 3, 5, 4)),
    "adaptive-larger": (lambda m, x: m.adaptive_avg_pool2d(x, (4, 5)), (1, 2, 3, 3)),
    "adaptive-none": (lambda m, x: m.adaptive_avg_pool2d(x, (None, 2)), (1, 2, 3, 4)),
    "adaptive-unbatched": (lambda m, x: m.adaptive_avg_pool2d(x, 2), (3, 5, 5)),
    "adaptive-empty-batch": (lambda m, x: m.adaptive_avg_pool2d(x, (2, 3)), (0, 2, 5, 5)),
}


def _pool_dtypes(case: str) -> tuple:
    if case.startswith("max"):
        return FLOATS + INTS
    if case.startswith("avg"):
        return FLOATS + ("int64",)
    return FLOATS


@pytest.mark.parametrize("case, dtype, layout", [
    pytest.param(case, dtype, layout, id=f"{case}-{dtype}-{layout}")
    for case in POOL_CASES for dtype in _pool_dtypes(case)
    for layout in (("contiguous", "transposed", "strided") if dtype == "float32" else ("contiguous",))])
def test_pooling_matches_torch(case, dtype, layout, rng):
    fn, shape = POOL_CASES[case]
    x = random_array(rng, shape, dtype, 0 if dtype == "uint8" else -5, 5)
    check_against_torch(fn, x, layout=layout)


@pytest.mark.parametrize("case", [c for c in POOL_CASES if not c.endswith("empty-batch")])
def test_pooling_gradient_matches_finite_differences(case, rng):
    fn, shape = POOL_CASES[case]
    check_finite_differences(fn, random_array(rng, shape, "float64"))


def test_max_pool2d_gradient_on_ties_goes_to_one_element_like_torch():
    x = np.zeros((1, 1, 4, 4), dtype=np.float32)  # every window is a tie, as after a relu
    check_against_torch(lambda m, t: m.max_pool2d(t, 2), x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_max_pool2d_with_nans_and_overlapping_ties_matches_torch(dtype, rng):
    x = np.maximum(random_array(rng, (2, 3, 7, 6), "float32", -3, 3), 0)  # many ties at zero, as after a relu
    x[0, 0, 1, 1] = x[1, 2, 4, 3] = np.nan  # a NaN is the maximum of every window that holds it
    x = x.astype(random_array(rng, (1,), dtype).dtype)
    check_against_torch(lambda m, t: m.max_pool2d(t, 3, stride=2, padding=1), x)


def test_memory_format_is_accepted_as_pytorch_spells_it():
    x = ember.randn(2, 3, 5, 5)
    for fmt in (ember.channels_last, ember.contiguous_format, ember.preserve_format, torch.channels_last,
                torch.contiguous_format):
        np.testing.assert_array_equal(x.contiguous(memory_format=fmt).numpy(), x.numpy())
        np.testing.assert_array_equal(x.to(memory_format=fmt).numpy(), x.numpy())
    with pytest.raises(ValueError, match="contiguous: memory_format"):
        x.contiguous(memory_format="nhwc")
    with pytest.raises(ValueError, match="conv2d: memory_format"):
        ember.nn.functional.conv2d(x, ember.randn(4, 3, 3, 3), memory_format="nhwc")
    net = ember.nn.Sequential(ember.nn.Conv2d(3, 4, 3), ember.nn.ReLU(), ember.nn.ConvTranspose2d(4, 2, 3))
    assert net.to(memory_format=torch.channels_last) is net
    assert [getattr(m, "memory_format", None) for m in net] == ["channels_last", None, "channels_last"]
    net.to(memory_format=ember.preserve_format)
    assert net[0].memory_format == "channels_last"
    net.to(memory_format=ember.contiguous_format)
    assert net[2].memory_format == "contiguous"


@pytest.mark.slow
def test_max_pool_with_more_window_offsets_than_a_byte_counts(device):
    """A 17x17 window has 289 offsets; increasing values put each window's maximum at the last one."""
    x = np.arange(18 * 18, dtype=np.float32).reshape(1, 1, 18, 18)
    e = ember.tensor(x, device=device, requires_grad=True)
    t = torch.tensor(x, requires_grad=True)
    out, expected = ember.nn.functional.max_pool2d(e, 17, stride=1), torch.nn.functional.max_pool2d(t, 17, stride=1)
    out.sum().backward()
    expected.sum().backward()
    np.testing.assert_array_equal(out.numpy(), expected.detach().numpy())
    np.testing.assert_array_equal(e.grad.numpy(), t.grad.numpy())
