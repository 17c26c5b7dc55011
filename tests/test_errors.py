"""Misuse fails at the line that made it, with an error that says what went wrong.

Each case builds its inputs and makes one bad call while realization is forbidden, so
an error that would only surface when the graph is computed fails the test. The
message must name the op and the operands' shapes (and dtypes where they matter).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


# -- objects from outside ember where an ember Tensor belongs ---------------------------------------------
# A torch tensor, a NumPy array, a list, None or a string given where an op takes an ember Tensor: the error is
# ember's own (a TypeError, or an ember error), raised at the call, naming the op and what it got (its type,
# and its shape and dtype where it has them), never an AttributeError from inside ember.

FOREIGN = {
    "torch_tensor": (lambda: torch.tensor(RNG.standard_normal((3, 4)), dtype=torch.float32),
                     ["torch.Tensor(shape=(3, 4), dtype=torch.float32"]),
    "numpy_array": (lambda: RNG.standard_normal((3, 4)).astype(np.float32),
                    ["numpy.ndarray(shape=(3, 4), dtype=float32)"]),
    "list": (lambda: RNG.standard_normal((3, 4)).tolist(), ["list ["]),
    "none": (lambda: None, ["None"]),
    "string": (lambda: "abc", ["str 'abc'"]),
}

# (the op the message names, a call given the foreign object)
FOREIGN_CALLS = {
    "add": ("add", lambda f: rnd(3, 4) + f),
    "reflected_add": ("add", lambda f: f + rnd(3, 4)),
    "mul": ("mul", lambda f: ember.mul(rnd(3, 4), f)),
    "div_first": ("div", lambda f: ember.div(f, 2.0)),
    "lt": ("lt", lambda f: rnd(3, 4) < f),
    "maximum": ("maximum", lambda f: ember.maximum(rnd(3, 4), f)),
    "where_condition": ("where", lambda f: ember.where(f, rnd(3, 4), rnd(3, 4))),
    "where_value": ("where", lambda f: ember.where(rnd(3, 4) > 0, rnd(3, 4), f)),
    "neg": ("neg", lambda f: ember.neg(f)),
    "abs": ("abs", lambda f: ember.abs(f)),
    "clamp": ("clamp", lambda f: ember.clamp(f, 0.0, 1.0)),
    "matmul": ("matmul", lambda f: rnd(2, 3) @ f),
    "reflected_matmul": ("matmul", lambda f: f @ rnd(4, 2)),
    "mm": ("mm", lambda f: ember.mm(f, rnd(4, 2))),
    "bmm": ("bmm", lambda f: ember.bmm(rnd(2, 3, 4), f)),
    "linear_layer": ("linear", lambda f: ember.nn.Linear(4, 2)(f)),
    "linear_weight": ("linear", lambda f: ember.nn.functional.linear(rnd(3, 4), f)),
    "sequential": ("linear", lambda f: ember.nn.Sequential(ember.nn.Linear(4, 2), ember.nn.ReLU())(f)),
    "conv2d_layer": ("conv2d", lambda f: ember.nn.Conv2d(3, 2, 3)(f)),
    "conv2d_weight": ("conv2d", lambda f: ember.conv2d(rnd(1, 3, 5, 5), f)),
    "conv_transpose2d_layer": ("conv_transpose2d", lambda f: ember.nn.ConvTranspose2d(3, 2, 3)(f)),
    "embedding_layer": ("embedding", lambda f: ember.nn.Embedding(5, 3)(f)),
    "embedding_weight": ("embedding", lambda f: ember.embedding(ints(0, 1), f)),
    "cross_entropy_input": ("cross_entropy", lambda f: ember.nn.functional.cross_entropy(f, ints(0, 1, 2))),
    "cross_entropy_target": ("cross_entropy", lambda f: ember.nn.CrossEntropyLoss()(rnd(3, 4), f)),
    "nll_loss_target": ("nll_loss", lambda f: ember.nn.functional.nll_loss(rnd(3, 4), f)),
    "mse_loss_target": ("mse_loss", lambda f: ember.nn.MSELoss()(rnd(3, 4), f)),
    "bce_with_logits_input": ("binary_cross_entropy_with_logits",
                              lambda f: ember.nn.functional.binary_cross_entropy_with_logits(f, rnd(3, 4))),
    "layer_norm_layer": ("layer_norm", lambda f: ember.nn.LayerNorm(4)(f)),
    "batch_norm_layer": ("BatchNorm2d", lambda f: ember.nn.BatchNorm2d(3)(f)),
    "softmax": ("softmax", lambda f: ember.softmax(f, -1)),
    "functional_softmax": ("softmax", lambda f: ember.nn.functional.softmax(f, dim=-1)),
    "log_softmax_layer": ("log_softmax", lambda f: ember.nn.LogSoftmax(dim=-1)(f)),
    "sum": ("sum", lambda f: ember.sum(f)),
    "mean": ("mean", lambda f: ember.mean(f, 0)),
    "argmax": ("argmax", lambda f: ember.argmax(f)),
    "relu_layer": ("relu", lambda f: ember.nn.ReLU()(f)),
    "dropout_layer": ("dropout", lambda f: ember.nn.Dropout(0.5)(f)),
    "max_pool2d_layer": ("max_pool2d", lambda f: ember.nn.MaxPool2d(2)(f)),
    "adaptive_avg_pool2d": ("adaptive_avg_pool2d", lambda f: ember.nn.functional.adaptive_avg_pool2d(f, 1)),
    "flatten_layer": ("flatten", lambda f: ember.nn.Flatten()(f)),
    "reshape": ("reshape", lambda f: ember.reshape(f, (12,))),
    "transpose": ("transpose", lambda f: ember.transpose(f, 0, 1)),
    "pad": ("pad", lambda f: ember.nn.functional.pad(f, (1, 1))),
    "expand": ("expand", lambda f: ember.expand(f, 3, 4)),
    "cat_item": ("cat", lambda f: ember.cat([rnd(3, 4), f])),
    "cat_sequence": ("cat", lambda f: ember.cat(f)),
    "stack_item": ("stack", lambda f: ember.stack([rnd(3, 4), f])),
    "gather_index": ("gather", lambda f: ember.gather(rnd(3, 4), 1, f)),
    "index_select_index": ("index_select", lambda f: ember.index_select(rnd(3, 4), 0, f)),
    "masked_fill_mask": ("masked_fill", lambda f: rnd(3, 4).masked_fill(f, 0.0)),
    "one_hot": ("one_hot", lambda f: ember.one_hot(f, 4)),
    "sgd_params": ("SGD", lambda f: ember.optim.SGD([f], lr=0.1)),
    "adam_params": ("Adam", lambda f: ember.optim.Adam([rnd(2).requires_grad_(), f])),
    "param_group": ("AdamW", lambda f: ember.optim.AdamW([{"params": [f]}])),
}


@pytest.mark.parametrize("kind", list(FOREIGN))
@pytest.mark.parametrize("name", list(FOREIGN_CALLS))
def test_a_foreign_object_where_a_tensor_belongs_is_refused_naming_the_op_and_what_came(name, kind,
                                                                                       no_realization):
    op, call = FOREIGN_CALLS[name]
    make, fragments = FOREIGN[kind]
    with pytest.raises((TypeError, ember.EmberError)) as info:
        call(make())
    message = str(info.value)
    assert not isinstance(info.value, AttributeError)
    missing = [f for f in [op, *fragments] if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


@pytest.mark.parametrize("data", [torch.ones(3, 4), np.ones((3, 4), np.float32), [[1.0] * 4] * 3],
                         ids=["torch_tensor", "numpy_array", "list"])
def test_the_refusal_of_an_array_or_list_says_how_to_convert_it(data, no_realization):
    with pytest.raises(TypeError, match=r"^linear: input must be an ember Tensor, got .*; convert it with "
                                        r"ember\.tensor\(x\)"):
        ember.nn.Linear(4, 2)(data)


def test_a_torch_tensor_given_to_an_ember_layer_gets_the_error_the_layer_means(no_realization):
    # the message code once read `.name` of the torch dtype and raised AttributeError instead
    with pytest.raises(TypeError) as info:
        ember.nn.Linear(4, 2)(torch.randn(3, 4))
    assert str(info.value).startswith("linear: input must be an ember Tensor, got torch.Tensor(shape=(3, 4), "
                                      "dtype=torch.float32, device=cpu)")


@pytest.mark.parametrize("params", [None, "abc", torch.randn(3), np.ones(3)], ids=["none", "string", "torch", "numpy"])
def test_an_optimizer_given_no_iterable_of_parameters_says_what_it_got(params):
    with pytest.raises(TypeError, match=r"^SGD: params must be an iterable of ember Tensors or dicts"):
        ember.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("template", [torch.randn(3, 4, dtype=torch.float64), np.ones((3, 4))],
                         ids=["torch_tensor", "numpy_array"])
def test_another_librarys_array_serves_as_a_template_of_shape_dtype_and_device(template):
    assert rnd(1, 4).expand_as(template).shape == (3, 4)
    assert rnd(12).view_as(template).shape == (3, 4)
    made = ember.zeros_like(template)
    assert (made.shape, made.dtype) == ((3, 4), ember.float64)
    assert ember.randn_like(template).shape == (3, 4)


@pytest.mark.parametrize("template", [None, "abc", [1.0, 2.0]], ids=["none", "string", "list"])
def test_a_template_without_a_shape_is_refused_naming_the_op(template, no_realization):
    with pytest.raises(TypeError, match="^expand_as: other must be an ember Tensor"):
        rnd(1, 4).expand_as(template)
    with pytest.raises(TypeError, match="^zeros_like: input must be an ember Tensor"):
        ember.zeros_like(template)


@pytest.mark.parametrize("data", [torch.tensor([[0.5, -1.0]]), np.array([[0.5, -1.0]], np.float32), [[0.5, -1.0]]],
                         ids=["torch_tensor", "numpy_array", "list"])
def test_ops_that_take_data_convert_it_as_ember_tensor_does(data):
    expected = np.array([[0.5, -1.0]], np.float32)
    np.testing.assert_allclose(ember.exp(data).numpy(), np.exp(expected), rtol=1e-6)
    np.testing.assert_allclose(ember.sigmoid(data).numpy(), 1 / (1 + np.exp(-expected)), rtol=1e-6)
    x = ember.zeros(1, 2)
    x.copy_(data)
    np.testing.assert_array_equal(x.numpy(), expected)
    x[0] = data[0]
    np.testing.assert_array_equal(x.numpy(), expected)


@pytest.mark.parametrize("call", [lambda: ember.exp(None), lambda: ember.zeros(2).copy_("abc"),
                                  lambda: ember.zeros(2).__setitem__(0, None), lambda: ember.rsqrt("abc")],
                         ids=["exp_none", "copy_string", "setitem_none", "rsqrt_string"])
def test_data_that_cannot_be_converted_is_refused_naming_the_op(call, no_realization):
    with pytest.raises(TypeError, match=r"^(exp|copy_|setitem|rsqrt): (input|value) must be an ember Tensor, a "
                                        r"number or data that ember\.tensor takes"):
        call()


@pytest.mark.parametrize("target", [torch.randn(3), np.ones(3), [1.0]], ids=["torch_tensor", "numpy_array", "list"])
def test_to_given_an_array_says_what_it_takes(target, no_realization):
    with pytest.raises(TypeError, match="^to: expected a dtype, a device or an ember Tensor, got"):
        rnd(3).to(target)


def test_describe_shows_any_object_without_computing_it(no_realization):
    from ember.errors import describe

    pending = rnd(2) * 2
    assert describe(pending) == "Tensor(shape=(2,), dtype=float32, device=cpu)"
    assert describe([pending, 3]) == "list [Tensor(shape=(2,), dtype=float32, device=cpu), 3]"
    assert describe(torch.zeros(2, 3, dtype=torch.int64)) == "torch.Tensor(shape=(2, 3), dtype=torch.int64, device=cpu)"
    assert describe(np.zeros(2, np.float16)) == "numpy.ndarray(shape=(2,), dtype=float16)"
    assert describe(None) == "None" and describe(2.5) == "2.5" and describe("a") == "str 'a'"
    assert describe(list(range(100))) == "list [0, 1, 2, 3, ...]"
    assert len(describe({"k": "v" * 500})) < 100
