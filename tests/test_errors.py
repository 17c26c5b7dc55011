"""Misuse fails at the line that made it, with an error that says what went wrong.

Each case builds its inputs and makes one bad call while realization is forbidden, so
an error that would only surface when the graph is computed fails the test. The
message must name the op and the operands' shapes (and dtypes where they matter).
"""

from __future__ import annotations

import numpy as np
import pytest

import ember
from ember import DeviceError, DTypeError, ShapeError
from ember.compiler.targets import reference

RNG = np.random.default_rng(0)


def rnd(*shape, dtype="float32") -> ember.Tensor:
    return ember.tensor(RNG.standard_normal(shape).astype(dtype))


def ints(*values) -> ember.Tensor:
    return ember.tensor(list(values))


@pytest.fixture
def no_realization(monkeypatch):
    """Any evaluation of graph while the bad call runs fails the test."""
    def refuse(node, args):
        raise AssertionError(f"realized {node} while checking a misuse: the error came too late")

    monkeypatch.setattr(reference, "evaluate", refuse)


def _backward_twice():
    x = rnd(3).requires_grad_()
    y = (x * x).sum()
    y.backward()
    y.backward()


def _concat(*tensors, dim):
    return lambda: ember.cat(list(tensors), dim)


# (call, error type, fragments the message must contain)
CASES = {
    # broadcasting
    "add_not_broadcastable": (lambda: rnd(2, 3) + rnd(4, 3), ShapeError, ["add", "(2, 3)", "(4, 3)"]),
    "mul_not_broadcastable": (lambda: rnd(5) * rnd(4), ShapeError, ["mul", "(5,)", "(4,)"]),
    "sub_not_broadcastable": (lambda: ember.sub(rnd(2, 1, 3), rnd(2, 2)), ShapeError, ["sub", "(2, 1, 3)", "(2, 2)"]),
    "lt_not_broadcastable": (lambda: rnd(3, 2) < rnd(3), ShapeError, ["lt", "(3, 2)", "(3,)"]),
    "where_not_broadcastable": (lambda: ember.where(rnd(3) > 0, rnd(4), rnd(3)), ShapeError,
                                ["where", "(3,)", "(4,)"]),
    # matmul
    "matmul_inner_dims": (lambda: rnd(2, 3) @ rnd(4, 5), ShapeError, ["matmul", "(2, 3)", "(4, 5)", "3 != 4"]),
    "matmul_vector_inner_dims": (lambda: ember.matmul(rnd(3), rnd(4)), ShapeError, ["matmul", "(3,)", "(4,)"]),
    "matmul_batch_dims": (lambda: rnd(2, 3, 4) @ rnd(5, 4, 6), ShapeError, ["matmul", "(2, 3, 4)", "(5, 4, 6)"]),
    "matmul_dtypes": (lambda: rnd(2, 3) @ rnd(3, 4, dtype="float64"), DTypeError,
                      ["matmul", "(2, 3)", "(3, 4)", "float32", "float64"]),
    "matmul_0d": (lambda: ember.matmul(rnd(), rnd(3)), ShapeError, ["matmul", "shape=()"]),
    "mm_1d": (lambda: ember.mm(rnd(3), rnd(3)), ShapeError, ["mm", "(3,)"]),
    "bmm_batch": (lambda: ember.bmm(rnd(2, 3, 4), rnd(3, 4, 5)), ShapeError, ["bmm", "(2, 3, 4)", "(3, 4, 5)"]),
    "linear_in_features": (lambda: ember.linear(rnd(2, 3), rnd(4, 5)), ShapeError, ["linear", "(2, 3)", "(4, 5)"]),
    # conv2d
    "conv2d_channels": (lambda: ember.conv2d(rnd(1, 3, 8, 8), rnd(4, 2, 3, 3)), ShapeError,
                        ["conv2d", "(1, 3, 8, 8)", "(4, 2, 3, 3)", "groups=1"]),
    "conv2d_groups": (lambda: ember.conv2d(rnd(1, 4, 8, 8), rnd(3, 2, 3, 3), groups=2), ShapeError,
                      ["conv2d", "(1, 4, 8, 8)", "(3, 2, 3, 3)", "groups=2"]),
    "conv2d_input_too_small": (lambda: ember.conv2d(rnd(1, 3, 2, 2), rnd(4, 3, 3, 3)), ShapeError,
                               ["conv2d", "(1, 3, 2, 2)", "(4, 3, 3, 3)", "smaller"]),
    "conv2d_dtypes": (lambda: ember.conv2d(rnd(1, 3, 8, 8), rnd(4, 3, 3, 3, dtype="float64")), DTypeError,
                      ["conv2d", "float32", "float64"]),
    "conv2d_2d_input": (lambda: ember.conv2d(rnd(8, 8), rnd(4, 3, 3, 3)), ShapeError, ["conv2d", "(8, 8)"]),
    "conv2d_bias": (lambda: ember.conv2d(rnd(1, 3, 8, 8), rnd(4, 3, 3, 3), rnd(3)), ShapeError,
                    ["conv2d", "bias", "(3,)"]),
    # reshape, expand
    "reshape_wrong_size": (lambda: rnd(2, 3).reshape(4, 2), ShapeError, ["reshape", "(4, 2)", "(2, 3)"]),
    "reshape_two_minus_ones": (lambda: rnd(2, 3).reshape(-1, -1), ShapeError, ["reshape", "-1", "(-1, -1)"]),
    "reshape_minus_one_indivisible": (lambda: rnd(2, 3).reshape(-1, 4), ShapeError, ["reshape", "(-1, 4)", "(2, 3)"]),
    "reshape_negative_size": (lambda: rnd(6).reshape(-2, -3), ShapeError, ["reshape", "(-2, -3)"]),
    "view_wrong_size": (lambda: rnd(6).view(7), ShapeError, ["reshape", "(7,)", "(6,)"]),
    "reshape_float_size": (lambda: rnd(6).reshape(2.0, 3), TypeError, ["reshape", "integers"]),
    "expand_non_singleton": (lambda: rnd(2, 3).expand(4, 3), ShapeError, ["expand", "(2, 3)", "(4, 3)"]),
    "expand_fewer_dims": (lambda: rnd(2, 3).expand(3), ShapeError, ["expand", "(2, 3)", "(3,)"]),
    "broadcast_to": (lambda: ember.broadcast_to(rnd(3), (2, 4)), ShapeError, ["broadcast_to", "(3,)", "(2, 4)"]),
    # invalid dims
    "sum_dim_out_of_range": (lambda: rnd(2, 3).sum(2), IndexError, ["sum", "dimension 2", "2 dims"]),
    "sum_negative_dim_out_of_range": (lambda: rnd(2, 3).sum(-3), IndexError, ["sum", "-3", "[-2, 1]"]),
    "sum_dim_twice": (lambda: rnd(2, 3).sum((0, 0)), ValueError, ["sum", "(0, 0)", "twice"]),
    "sum_dim_twice_negative": (lambda: rnd(2, 3).sum((1, -1)), ValueError, ["sum", "(1, -1)", "twice"]),
    "sum_dim_float": (lambda: rnd(2, 3).sum(0.5), TypeError, ["sum", "float"]),
    "mean_dim_out_of_range": (lambda: rnd(3).mean(1), IndexError, ["mean", "dimension 1"]),
    "amax_dim_out_of_range": (lambda: rnd(3).amax(1), IndexError, ["amax", "dimension 1"]),
    "argmax_dim_out_of_range": (lambda: rnd(3).argmax(2), IndexError, ["argmax", "dimension 2"]),
    "softmax_dim_out_of_range": (lambda: rnd(2, 3).softmax(2), IndexError, ["softmax", "dimension 2", "2 dims"]),
    "log_softmax_dim_out_of_range": (lambda: rnd(2, 3).log_softmax(-3), IndexError, ["log_softmax", "-3"]),
    "transpose_dim_out_of_range": (lambda: rnd(2, 3).transpose(0, 2), IndexError, ["transpose", "dimension 2"]),
    "permute_dim_out_of_range": (lambda: rnd(2, 3).permute(0, 2), IndexError, ["permute", "dimension 2"]),
    "permute_dim_twice": (lambda: rnd(2, 3).permute(1, 1), ValueError, ["permute", "(1, 1)", "twice"]),
    "permute_wrong_count": (lambda: rnd(2, 3).permute(0), ShapeError, ["permute", "(0,)", "(2, 3)"]),
    "squeeze_dim_out_of_range": (lambda: rnd(2, 1).squeeze(3), IndexError, ["squeeze", "dimension 3"]),
    "squeeze_dim_twice": (lambda: rnd(1, 1).squeeze((0, 0)), ValueError, ["squeeze", "twice"]),
    "unsqueeze_dim_out_of_range": (lambda: rnd(2, 3).unsqueeze(4), IndexError, ["unsqueeze", "dimension 4"]),
    "flatten_dim_out_of_range": (lambda: rnd(2, 3).flatten(0, 5), IndexError, ["flatten", "dimension 5"]),
    "flip_dim_twice": (lambda: rnd(2, 3).flip(0, 0), ValueError, ["flip", "twice"]),
    "size_dim_out_of_range": (lambda: rnd(2, 3).size(2), IndexError, ["size", "dimension 2"]),
    "cat_dim_out_of_range": (_concat(rnd(2, 3), rnd(2, 3), dim=2), IndexError, ["cat", "dimension 2"]),
    "stack_dim_out_of_range": (lambda: ember.stack([rnd(2, 3), rnd(2, 3)], 3), IndexError,
                               ["stack", "dimension 3"]),
    # cat, stack, split
    "cat_mismatched_shapes": (_concat(rnd(2, 3), rnd(2, 4), dim=0), ShapeError, ["cat", "(2, 3)", "(2, 4)"]),
    "cat_mismatched_ndim": (_concat(rnd(2, 3), rnd(3), dim=0), ShapeError, ["cat", "(2, 3)", "(3,)"]),
    "cat_0d": (_concat(rnd(), rnd(), dim=0), ShapeError, ["cat", "zero-dimensional"]),
    "cat_empty_list": (lambda: ember.cat([]), ValueError, ["cat", "non-empty"]),
    "stack_mismatched_shapes": (lambda: ember.stack([rnd(2, 3), rnd(2, 4)]), ShapeError,
                                ["stack", "(2, 3)", "(2, 4)"]),
    "split_sections": (lambda: rnd(5).split([2, 2]), ShapeError, ["split", "[2, 2]", "5"]),
    "narrow_past_end": (lambda: rnd(5).narrow(0, 3, 4), IndexError, ["narrow", "size 5"]),
    # indexing
    "index_with_float_tensor": (lambda: rnd(4, 3)[ember.tensor([0.0, 1.0])], IndexError,
                                ["index", "float32", "(4, 3)"]),
    "index_int_out_of_range": (lambda: rnd(4, 3)[4], IndexError, ["index 4", "dimension 0", "size 4", "(4, 3)"]),
    "index_negative_int_out_of_range": (lambda: rnd(4, 3)[0, -4], IndexError,
                                        ["index -4", "dimension 1", "size 3"]),
    "index_int_tensor_out_of_range": (lambda: rnd(4, 3)[ints(0, 7)], IndexError,
                                      ["index", "7", "dimension 0", "size 4"]),
    "index_int_list_out_of_range": (lambda: rnd(4, 3)[:, [0, -5]], IndexError, ["index", "-5", "size 3"]),
    "too_many_indices": (lambda: rnd(4, 3)[0, 0, 0], IndexError, ["too many indices", "(4, 3)", "3"]),
    "two_ellipses": (lambda: rnd(4, 3)[..., ...], IndexError, ["ellipsis"]),
    "index_with_python_bool": (lambda: rnd(4, 3)[True], IndexError, ["bool"]),
    "index_with_string": (lambda: rnd(4, 3)["a"], IndexError, ["'a'", "str"]),
    "bool_mask_shape": (lambda: rnd(3, 3)[ember.tensor([True, False])], IndexError, ["mask", "(2,)", "(3, 3)"]),
    "setitem_value_shape": (lambda: rnd(4, 3).__setitem__(0, rnd(4)), ShapeError, ["setitem", "(4,)", "(3,)"]),
    "setitem_index_out_of_range": (lambda: rnd(4, 3).__setitem__(5, 1.0), IndexError, ["index 5", "size 4"]),
    "gather_index_ndim": (lambda: ember.gather(rnd(4, 3), 1, ints(0, 1)), ShapeError, ["gather", "(2,)", "(4, 3)"]),
    "gather_float_index": (lambda: ember.gather(rnd(4, 3), 1, rnd(4, 1)), DTypeError, ["gather", "float32"]),
    "gather_index_out_of_range": (lambda: ember.gather(rnd(4, 3), 1, ember.tensor([[0], [3]])), IndexError,
                                  ["gather", "3", "size 3"]),
    "gather_dim_out_of_range": (lambda: ember.gather(rnd(4, 3), 2, ember.tensor([[0]])), IndexError,
                                ["gather", "dimension 2"]),
    "scatter_add_src_dtype": (lambda: ember.scatter_add(rnd(3), 0, ints(0), ints(1)), DTypeError,
                              ["scatter_add", "int64", "float32"]),
    "index_select_float_index": (lambda: ember.index_select(rnd(3, 3), 0, rnd(2)), DTypeError,
                                 ["index_select", "float32"]),
    "index_select_2d_index": (lambda: ember.index_select(rnd(3, 3), 0, ember.tensor([[0]])), ShapeError,
                              ["index_select", "(1, 1)"]),
    "embedding_float_indices": (lambda: ember.embedding(rnd(2), rnd(5, 3)), DTypeError,
                                ["embedding", "float32", "(2,)"]),
    "embedding_index_out_of_range": (lambda: ember.embedding(ints(1, 5), rnd(5, 3)), IndexError,
                                     ["embedding", "5", "size 5"]),
    "embedding_3d_weight": (lambda: ember.embedding(ints(1), rnd(5, 3, 2)), ShapeError, ["embedding", "(5, 3, 2)"]),
    "one_hot_float": (lambda: ember.one_hot(rnd(3), 4), DTypeError, ["one_hot", "float32"]),
    # sizes
    "zeros_negative_dim": (lambda: ember.zeros(2, -1), ShapeError, ["zeros", "negative", "(2, -1)"]),
    "ones_negative_dim": (lambda: ember.ones((-3,)), ShapeError, ["ones", "negative", "(-3,)"]),
    "full_negative_dim": (lambda: ember.full((-1, 2), 3.0), ShapeError, ["full", "negative", "(-1, 2)"]),
    "randn_negative_dim": (lambda: ember.randn(-2, 3), ShapeError, ["randn", "negative", "(-2, 3)"]),
    "zeros_count_overflows_int64": (lambda: ember.zeros(2**40, 2**40), ShapeError,
                                    ["zeros", "(1099511627776, 1099511627776)", "too many elements"]),
    "empty_count_overflows_int64": (lambda: ember.empty(2**31, 2**31, 2**31), ShapeError,
                                    ["zeros", "too many elements"]),
    "rand_count_overflows_int64": (lambda: ember.rand(2**40, 2**40), ShapeError, ["rand", "too many elements"]),
    "expand_count_overflows_int64": (lambda: rnd(1, 1).expand(2**40, 2**40), ShapeError,
                                     ["expand", "(1, 1)", "too many elements"]),
    "expand_negative_size": (lambda: rnd(1, 3).expand(-2, 3), ShapeError, ["expand", "-2"]),
    "zeros_float_size": (lambda: ember.zeros(2.5), TypeError, ["zeros", "2.5"]),
    # dtypes
    "mean_of_integers": (lambda: ember.tensor([1, 2, 3]).mean(), DTypeError, ["mean", "int64", "(3,)"]),
    "var_of_integers": (lambda: ember.tensor([1, 2, 3]).var(), DTypeError, ["var", "int64"]),
    "neg_of_bool": (lambda: -ember.tensor([True, False]), DTypeError, ["neg", "bool", "(2,)"]),
    "sub_of_bools": (lambda: ember.tensor([True]) - ember.tensor([False]), DTypeError, ["sub", "bool", "(1,)"]),
    "where_int_condition": (lambda: ember.where(ints(1, 0), rnd(2), rnd(2)), DTypeError, ["where", "int64", "(2,)"]),
    "where_float_condition": (lambda: ember.where(rnd(2), rnd(2), rnd(2)), DTypeError, ["where", "float32"]),
    "masked_fill_float_mask": (lambda: rnd(3).masked_fill(rnd(3), 0.0), DTypeError, ["masked_fill", "float32", "(3,)"]),
    "bitwise_and_floats": (lambda: rnd(2) & rnd(2), DTypeError, ["bitwise_and", "float32", "(2,)"]),
    "invert_float": (lambda: ~rnd(2), DTypeError, ["bitwise_not", "float32"]),
    "int_to_negative_power": (lambda: ints(2, 3) ** -1, DTypeError, ["pow", "int64"]),
    "unknown_dtype": (lambda: ember.zeros(2, dtype="float128"), TypeError, ["float128"]),
    "to_unknown_string": (lambda: rnd(2).to("complex64"), DeviceError, ["complex64"]),
    "tensor_from_strings": (lambda: ember.tensor(["a", "b"]), TypeError, ["tensor", "list"]),
    "tensor_from_ragged_list": (lambda: ember.tensor([[1, 2], [3]]), ValueError, ["tensor", "equal lengths"]),
    # non-tensor operands
    "add_string": (lambda: rnd(2) + "a", TypeError, ["add", "'a'", "str"]),
    "radd_string": (lambda: "a" + rnd(2), TypeError, ["add", "'a'", "str"]),
    "mul_string": (lambda: rnd(2) * "a", TypeError, ["mul", "str"]),
    "lt_string": (lambda: rnd(2) < "a", TypeError, ["lt", "str"]),
    "matmul_string": (lambda: rnd(2) @ "a", TypeError, ["matmul", "'a'"]),
    "where_string_value": (lambda: ember.where(rnd(1) > 0, rnd(1), "a"), TypeError, ["where", "'a'", "str"]),
    "add_none": (lambda: ember.add(rnd(2), None), TypeError, ["add", "None"]),
    # autograd
    "backward_non_scalar": (lambda: (rnd(3).requires_grad_() * 2).backward(), RuntimeError,
                            ["backward", "(3,)", "gradient"]),
    "backward_gradient_shape": (lambda: (rnd(3).requires_grad_() * 2).backward(rnd(4)), ShapeError,
                                ["backward", "(4,)", "(3,)"]),
    "backward_without_grad": (lambda: (rnd(3) * 2).sum().backward(), RuntimeError, ["backward", "require"]),
    "backward_twice": (_backward_twice, RuntimeError, ["second time", "retain_graph=True"]),
    "requires_grad_on_integers": (lambda: ints(1, 2).requires_grad_(), RuntimeError, ["floating", "int64"]),
    "tensor_integer_requires_grad": (lambda: ember.tensor([1, 2], requires_grad=True), RuntimeError,
                                     ["floating", "int64"]),
    "zeros_integer_requires_grad": (lambda: ember.zeros(2, dtype=ember.int32, requires_grad=True), RuntimeError,
                                    ["floating", "int32"]),
    "leaf_in_place": (lambda: rnd(3).requires_grad_().add_(1), RuntimeError, ["leaf", "in-place", "no_grad"]),
    "grad_of_unused_input": (lambda: ember.grad((rnd(2).requires_grad_() * 2).sum(), rnd(2).requires_grad_()),
                             RuntimeError, ["allow_unused"]),
    # scalars out of tensors
    "item_of_many_elements": (lambda: rnd(3).item(), RuntimeError, ["item", "3 elements", "(3,)"]),
    "float_of_many_elements": (lambda: float(rnd(2, 2)), ValueError, ["float", "(2, 2)"]),
    "int_of_many_elements": (lambda: int(ints(1, 2)), ValueError, ["int", "(2,)"]),
    "bool_of_many_elements": (lambda: bool(rnd(3) > 0), RuntimeError, ["ambiguous", "(3,)"]),
    "index_from_float_tensor": (lambda: [0, 1][rnd(1)], TypeError, ["integer", "float32"]),
    "len_of_0d": (lambda: len(rnd()), TypeError, ["len", "0-d"]),
    "iter_of_0d": (lambda: iter(rnd()), TypeError, ["0-d"]),
    # devices
    "unknown_device_tpu": (lambda: ember.zeros(2, device="tpu"), DeviceError, ["'tpu'", "cpu", "cuda"]),
    "malformed_device_index": (lambda: ember.zeros(2, device="cuda:x"), DeviceError, ["'cuda:x'"]),
    "tensor_on_unknown_device": (lambda: ember.tensor([1.0], device="tpu"), DeviceError, ["'tpu'"]),
    "randn_on_unknown_device": (lambda: ember.randn(2, device="xla"), DeviceError, ["'xla'"]),
    "to_unknown_device": (lambda: rnd(2).to("tpu"), DeviceError, ["'tpu'"]),
    "to_unknown_device_keyword": (lambda: rnd(2).to(device="cuda:x"), DeviceError, ["'cuda:x'"]),
    "device_context_unknown": (lambda: ember.device("tpu"), DeviceError, ["'tpu'"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_raises_at_the_call_with_a_clear_message(name, no_realization):
    call, error, fragments = CASES[name]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def test_shape_and_dtype_errors_are_the_builtin_kinds_too():
    # code written for PyTorch or NumPy catches ValueError / TypeError / RuntimeError
    assert issubclass(ShapeError, ValueError)
    assert issubclass(DTypeError, TypeError)
    assert issubclass(DeviceError, RuntimeError)
    assert issubclass(ShapeError, ember.EmberError)


def test_error_messages_describe_operands_by_shape_dtype_and_device(no_realization):
    with pytest.raises(DTypeError) as info:
        rnd(2, 3) @ rnd(3, 4, dtype="float64")
    message = str(info.value)
    assert "Tensor(shape=(2, 3), dtype=float32, device=cpu)" in message
    assert "Tensor(shape=(3, 4), dtype=float64, device=cpu)" in message
    assert ".to(float32)" in message  # and what would fix it


def test_a_failed_call_leaves_its_operands_usable():
    a, b = rnd(2, 3), rnd(4, 3)
    with pytest.raises(ShapeError):
        a + b
    np.testing.assert_allclose((a + b[:2]).numpy(), a.numpy() + b.numpy()[:2], rtol=1e-6)


def test_an_index_computed_lazily_is_checked_when_realized():
    # the values of a pending index are unknown at the call; computing them reports the error
    x = rnd(4, 3)
    picked = x[ember.arange(2) + 5]
    assert picked.shape == (2, 3)
    with pytest.raises(IndexError, match="out of bounds"):
        picked.numpy()


def test_integer_division_by_zero_is_reported_when_realized():
    quotient = ints(1, 2) // ints(1, 0)
    with pytest.raises(ZeroDivisionError):
        quotient.numpy()


def test_device_cpu_as_a_context_manager():
    with ember.device("cpu") as d:
        assert d == ember.Device("cpu")
        assert ember.default_device() == d
        x = ember.randn(2, 3)
        y = ember.tensor([1.0, 2.0])
    assert x.device == ember.Device("cpu") and y.device == ember.Device("cpu")
    assert str(x.device) == "cpu"
    assert ember.default_device() == ember.Device("cpu")


def test_device_context_is_restored_after_an_error():
    with pytest.raises(ShapeError), ember.device("cpu"):
        rnd(2) + rnd(3)
    assert ember.default_device() == ember.Device("cpu")


@pytest.mark.parametrize("spec", ["cpu", ember.Device("cpu")])
def test_known_device_specs_are_accepted(spec):
    x = ember.zeros(2, device=spec)
    assert x.device == ember.Device("cpu")
    assert x.to(spec).device == ember.Device("cpu")
