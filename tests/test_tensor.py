"""The Tensor handle: properties, reading values, Python protocols, in-place updates,
casts and interop, each compared with what PyTorch does."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import ember
from ember.compiler.targets import reference

RNG = np.random.default_rng(1)


def data(*shape, dtype="float32") -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def pair(*shape, dtype="float32"):
    """The same random values as an ember and a torch tensor."""
    a = data(*shape, dtype=dtype)
    return ember.tensor(a), torch.tensor(a)


def assert_same(e: ember.Tensor, t: torch.Tensor, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    assert e.shape == tuple(t.shape)
    assert str(e.dtype).removeprefix("ember.") == str(t.dtype).removeprefix("torch.")
    np.testing.assert_allclose(np.asarray(e.tolist(), dtype=np.float64),
                               np.asarray(t.tolist(), dtype=np.float64), rtol=rtol, atol=atol)


# -- properties ---------------------------------------------------------------------------

def test_shape_dtype_device_and_sizes():
    x = ember.randn(2, 3, 4)
    assert x.shape == (2, 3, 4)
    assert x.dtype is ember.float32
    assert x.device == ember.Device("cpu") and str(x.device) == "cpu"
    assert x.ndim == 3 and x.dim() == 3
    assert x.numel() == 24
    assert x.size() == (2, 3, 4)
    assert x.size(1) == 3 and x.size(-1) == 4
    assert x.element_size() == 4
    assert x.is_floating_point() and not x.is_cuda


def test_properties_of_a_0d_and_an_empty_tensor():
    s = ember.tensor(2.5)
    assert s.shape == () and s.ndim == 0 and s.numel() == 1
    e = ember.zeros(0, 3)
    assert e.shape == (0, 3) and e.numel() == 0
    assert e.numpy().shape == (0, 3)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                                   "float32", "float64"])
def test_dtype_and_element_size_match_torch(dtype):
    x = ember.zeros(2, dtype=dtype)
    t = torch.zeros(2, dtype=getattr(torch, dtype))
    assert x.dtype.name == dtype
    assert x.element_size() == t.element_size()
    assert x.is_floating_point() == t.is_floating_point()


def test_requires_grad_and_is_leaf():
    x = ember.randn(3)
    assert not x.requires_grad and x.is_leaf and x.grad_fn is None
    w = ember.randn(3, requires_grad=True)
    assert w.requires_grad and w.is_leaf and w.grad is None
    y = w * x
    assert y.requires_grad and not y.is_leaf and y.grad_fn is not None
    z = x * 2  # no input needs gradients: a leaf that does not require them
    assert not z.requires_grad and z.is_leaf
    d = y.detach()
    assert not d.requires_grad and d.is_leaf
    assert x.requires_grad_() is x and x.requires_grad


# -- reading values -----------------------------------------------------------------------

def test_numpy_returns_a_copy_of_the_value():
    a = data(2, 3)
    x = ember.tensor(a)
    a[0, 0] = 100.0  # the tensor copied its data
    out = x.numpy()
    assert out.dtype == np.float32
    out[0, 0] = -100.0  # and .numpy() gives a copy
    assert x.numpy()[0, 0] not in (100.0, -100.0)


def test_item_of_one_element_tensors():
    a = data(1, 1)
    assert ember.tensor(a).item() == torch.tensor(a).item()
    assert isinstance(ember.tensor(7).item(), int)
    assert isinstance(ember.tensor(True).item(), bool)
    assert isinstance(ember.tensor(0.5).item(), float)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "bool", "uint8"])
def test_tolist_matches_torch(dtype):
    a = (data(2, 3) * 10).astype(dtype)
    assert ember.tensor(a).tolist() == torch.tensor(a).tolist()
    assert ember.tensor(a[0, 0]).tolist() == torch.tensor(a[0, 0]).tolist()


def test_bfloat16_values_through_tolist_match_torch():
    a = data(8)
    e = ember.tensor(a).bfloat16().tolist()
    t = torch.tensor(a).bfloat16().tolist()
    assert e == t
    assert all(isinstance(v, float) for v in e)
    assert ember.tensor(a).to(ember.bfloat16).float().tolist() == torch.tensor(a).bfloat16().float().tolist()


def test_realize_computes_several_tensors_in_one_pass(monkeypatch):
    evaluated = []
    original = reference.evaluate

    def counting(node, args):
        evaluated.append(id(node))
        return original(node, args)

    monkeypatch.setattr(reference, "evaluate", counting)
    x = ember.tensor(data(4, 5))
    shared = (x * 3).exp()
    a, b = shared.sum(0), shared.amax(1)
    ember.realize(a, b)
    assert len(evaluated) == len(set(evaluated))  # the shared part was computed once for both
    computed = len(evaluated)
    t = torch.tensor(x.numpy())
    np.testing.assert_allclose(a.numpy(), (t * 3).exp().sum(0).numpy(), rtol=1e-5)
    np.testing.assert_allclose(b.numpy(), (t * 3).exp().amax(1).numpy(), rtol=1e-5)
    assert len(evaluated) == computed  # reading them afterwards computes nothing


def test_realize_returns_the_tensor_and_accepts_realized_ones():
    x = ember.randn(3)
    y = x + 1
    assert y.realize() is y
    ember.realize(y, x)
    ember.realize()
    np.testing.assert_allclose(y.numpy(), x.numpy() + 1, rtol=1e-6)


# -- repr -----------------------------------------------------------------------------------

REPR_CASES = {
    "float_vector": data(3),
    "float_matrix": data(2, 3),
    "whole_floats": np.array([1.0, 2.0, -3.0], np.float32),
    "int64": np.array([1, -2, 30]),
    "int32": np.array([1, 2, 3], np.int32),
    "bool": np.array([True, False]),
    "float16": data(3, dtype="float16"),
    "float64": data(2, 2, dtype="float64"),
    "0d_float": np.float32(3.25),
    "0d_int": np.int64(7),
    "empty_matrix": np.zeros((0, 3), np.float32),
    "empty_int32": np.zeros(0, np.int32),
    "large_values": np.array([1e9, 1.0], np.float32),
    "small_values": np.array([1e-5, 1.5], np.float32),
    "non_finite": np.array([np.nan, np.inf, -np.inf, 1.5], np.float32),
    "uint8": np.array([1, 255], np.uint8),
    "3d": data(2, 2, 2),
    "summarized_vector": data(2000),
    "summarized_matrix": data(40, 40),
}


@pytest.mark.parametrize("name", list(REPR_CASES))
def test_repr_matches_torch(name):
    a = REPR_CASES[name]
    expected = repr(torch.tensor(a)).replace("torch.", "ember.")
    assert repr(ember.tensor(a)) == expected
    assert str(ember.tensor(a)) == expected


def test_repr_of_bfloat16_matches_torch():
    a = data(3)
    assert repr(ember.tensor(a).bfloat16()) == repr(torch.tensor(a).bfloat16()).replace("torch.", "ember.")


def test_repr_shows_requires_grad_and_grad_fn():
    a = data(2)
    leaf = ember.tensor(a, requires_grad=True)
    assert repr(leaf) == repr(torch.tensor(a, requires_grad=True))
    d = ember.tensor(a, dtype=ember.float64, requires_grad=True)
    assert repr(d) == repr(torch.tensor(a, dtype=torch.float64, requires_grad=True)).replace("torch.", "ember.")
    out = repr(leaf * 2)
    assert re.fullmatch(r"tensor\(\[.*\], grad_fn=<\w+.*>\)", out), out
    assert "grad_fn" not in repr((leaf * 2).detach())


FORMAT_CASES = {  # a 0-d value, by dtype
    "float32": np.float32(0.1234567), "float64": np.float64(-2.5), "int64": np.int64(7), "bool": np.bool_(True),
    "float16": np.float16(1.5),
}


@pytest.mark.parametrize("spec", ["", ".4f", ">10.2e", "+", "08.3f", "g"])
@pytest.mark.parametrize("dtype", list(FORMAT_CASES))
def test_a_0d_tensor_formats_as_its_python_value_as_in_torch(dtype, spec):
    value = FORMAT_CASES[dtype]
    assert format(ember.tensor(value), spec) == format(torch.tensor(value), spec)
    assert f"{ember.tensor(value):{spec}}" == f"{torch.tensor(value):{spec}}"


def test_a_0d_bfloat16_and_a_computed_loss_format_as_their_values():
    assert f"{ember.tensor(1.5, dtype=ember.bfloat16):.3f}" == f"{torch.tensor(1.5, dtype=torch.bfloat16):.3f}"
    a = data(4)
    loss = (ember.tensor(a) ** 2).mean()
    assert f"loss {loss:.4f}" == f"loss {(torch.tensor(a) ** 2).mean():.4f}"


def test_a_tensor_with_dims_formats_only_with_an_empty_spec_as_in_torch():
    a = data(2, 3)
    assert f"{ember.tensor(a)}" == str(ember.tensor(a)) == f"{torch.tensor(a)}"
    assert format(ember.tensor(a[:1, :1])) == str(ember.tensor(a[:1, :1]))
    for spec in [".4f", ">8", "e"]:
        with pytest.raises(TypeError, match="unsupported format string passed to Tensor.__format__"):
            format(ember.tensor(a), spec)
        with pytest.raises(TypeError):
            format(torch.tensor(a), spec)


# -- Python protocols -------------------------------------------------------------------------

def test_len_and_iteration_follow_the_first_dim():
    e, t = pair(4, 3)
    assert len(e) == len(t) == 4
    rows = list(e)
    assert len(rows) == 4
    for r, tr in zip(rows, t):
        assert_same(r, tr)
    assert [v.item() for v in ember.tensor([5, 6, 7])] == [5, 6, 7]
    assert list(ember.zeros(0, 2)) == []


def test_bool_float_int_and_index_conversions():
    assert bool(ember.tensor([0.5])) is True
    assert bool(ember.tensor(0)) is False
    assert bool(ember.tensor([[True]])) is True
    v = data(1)
    assert float(ember.tensor(v)) == float(torch.tensor(v))
    assert int(ember.tensor([-2.7])) == int(torch.tensor([-2.7])) == -2
    assert int(ember.tensor(9)) == 9
    assert [10, 20, 30][ember.tensor(2)] == 30
    assert range(10)[ember.tensor([3])] == 3
    if ember.tensor(1.0) > 0:
        pass
    else:
        pytest.fail("a one-element comparison should be usable in an if")


# -- in-place updates --------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["add_", "sub_", "mul_", "div_", "remainder_", "fmod_"])
def test_binary_in_place_ops_match_torch(op):
    e, t = pair(3, 4)
    oe, ot = pair(4)
    before = e
    assert getattr(e, op)(oe) is before
    getattr(t, op)(ot)
    assert_same(e, t)


def test_in_place_ops_with_scalars_and_unary_ones_match_torch():
    e, t = pair(5)
    e.mul_(3).add_(0.5).abs_().sqrt_().clamp_(0.2, 1.5)
    t.mul_(3).add_(0.5).abs_().sqrt_().clamp_(0.2, 1.5)
    assert_same(e, t)
    e.add_(ember.tensor([1.0] * 5), alpha=2)
    t.add_(torch.tensor([1.0] * 5), alpha=2)
    assert_same(e, t)


def test_in_place_op_keeps_the_dtype_like_torch():
    e, t = ember.tensor([1, 2, 3]), torch.tensor([1, 2, 3])
    e.mul_(2)
    t.mul_(2)
    assert_same(e, t)
    f = ember.tensor(data(3, dtype="float16"))
    f.add_(ember.tensor(data(3)))
    assert f.dtype is ember.float16


def test_zero_fill_and_copy():
    e, t = pair(2, 3)
    e.zero_()
    t.zero_()
    assert_same(e, t)
    e.fill_(2.5)
    t.fill_(2.5)
    assert_same(e, t)
    se, st = pair(3)
    e.copy_(se)  # broadcast, as torch does
    t.copy_(st)
    assert_same(e, t)
    ie = ember.zeros(3, dtype=ember.int32)
    ie.copy_(ember.tensor([1.7, -2.2, 3.9]))  # cast to the destination dtype
    it = torch.zeros(3, dtype=torch.int32)
    it.copy_(torch.tensor([1.7, -2.2, 3.9]))
    assert_same(ie, it)


def test_augmented_assignment_updates_the_same_object():
    e, t = pair(3)
    oe, ot = pair(3)
    alias = e
    e += oe
    e *= 2
    e -= 0.25
    e /= oe
    t += ot
    t *= 2
    t -= 0.25
    t /= ot
    assert e is alias
    assert_same(e, t, rtol=1e-5)


def test_in_place_update_leaves_earlier_results_alone():
    x = ember.tensor([1.0, 2.0])
    y = x * 10  # computed from the value x had
    x.add_(1)
    assert y.tolist() == [10.0, 20.0]
    assert x.tolist() == [2.0, 3.0]


SETITEM_CASES = {
    "int": (1, lambda s: data(*s)),
    "negative_int": (-1, 7.5),
    "slice": (slice(1, 3), lambda s: data(*s)),
    "step_slice": ((slice(None), slice(0, None, 2)), lambda s: data(*s)),
    "negative_start_slice": ((slice(-3, None), 1), lambda s: data(*s)),
    "int_and_slice": ((2, slice(1, None)), lambda s: data(*s)),
    "scalar_everywhere": (slice(None), -1.0),
    "broadcast_row": (slice(0, 3), lambda s: data(s[-1])),
    "broadcast_column": ((slice(None), slice(1, 3)), lambda s: data(s[0], 1)),
    "ellipsis": ((Ellipsis, 0), lambda s: data(*s)),
    "int_tensor": ("rows", lambda s: data(*s)),
    "int_tensor_pair": ("points", lambda s: data(*s)),
    "bool_mask": ("mask", 0.0),
}


def _index(kind, torch_side: bool):
    lib = torch if torch_side else ember
    if kind == "rows":
        return lib.tensor([3, 0])
    if kind == "points":
        return lib.tensor([0, 2, 3]), lib.tensor([4, 0, 1])
    return kind


@pytest.mark.parametrize("name", list(SETITEM_CASES))
def test_setitem_matches_torch(name):
    index, value = SETITEM_CASES[name]
    e, t = pair(4, 5)
    if index == "mask":
        ie, it = e > 0.3, t > 0.3
    else:
        ie, it = _index(index, False), _index(index, True)
    shape = tuple(t[it].shape)
    v = value(shape) if callable(value) else value
    alias = e
    e[ie] = ember.tensor(v) if isinstance(v, np.ndarray) else v
    t[it] = torch.tensor(v) if isinstance(v, np.ndarray) else v
    assert e is alias
    assert_same(e, t)


def test_setitem_with_a_tensor_value_of_another_dtype_casts_it():
    e, t = ember.zeros(2, 3, dtype=ember.int64), torch.zeros(2, 3, dtype=torch.int64)
    e[0] = ember.tensor([1.9, -1.9, 3.0])
    t[0] = torch.tensor([1.9, -1.9, 3.0])
    assert_same(e, t)
    b = ember.zeros(3, dtype=ember.bool)
    b[1] = True
    assert b.tolist() == [False, True, False]


# -- casts and interop --------------------------------------------------------------------------

@pytest.mark.parametrize("wide", ["float64", "float32"])
def test_float_casts_round_trip(wide):
    a = data(16)
    x = ember.tensor(a)
    back = x.to(wide).to(ember.float32)
    np.testing.assert_array_equal(back.numpy(), a)


def test_integer_casts_round_trip_through_floats_and_wider_ints():
    a = RNG.integers(-1000, 1000, size=20)
    x = ember.tensor(a)
    for via in (ember.float32, ember.float64, ember.int32):
        np.testing.assert_array_equal(x.to(via).to(ember.int64).numpy(), a)


@pytest.mark.parametrize("method, dtype", [("float", "float32"), ("double", "float64"), ("half", "float16"),
                                           ("bfloat16", "bfloat16"), ("int", "int32"), ("long", "int64"),
                                           ("short", "int16"), ("char", "int8"), ("byte", "uint8"),
                                           ("bool", "bool")])
def test_cast_methods_match_torch(method, dtype):
    a = data(10) * 50
    e = getattr(ember.tensor(a), method)()
    t = getattr(torch.tensor(a), method)()
    assert e.dtype.name == dtype
    assert_same(e, t, rtol=0, atol=0)


def test_to_accepts_dtypes_names_tensors_and_devices():
    x = ember.tensor(data(3))
    assert x.to(ember.float64).dtype is ember.float64
    assert x.to("float16").dtype is ember.float16
    assert x.to(torch.int32).dtype is ember.int32
    assert x.to(np.float64).dtype is ember.float64
    assert x.to(ember.zeros(1, dtype=ember.int8)).dtype is ember.int8
    assert x.to("cpu") is x
    assert x.to("cpu", ember.float64).dtype is ember.float64
    assert x.to(device="cpu", dtype="bfloat16").dtype is ember.bfloat16
    assert x.type() == "ember.float32"


def test_numpy_interop():
    a = data(2, 3)
    x = ember.tensor(a)
    np.testing.assert_array_equal(np.asarray(x), a)
    np.testing.assert_array_equal(np.asarray(x, dtype=np.float64), a.astype(np.float64))
    np.testing.assert_array_equal(np.from_dlpack(x), a)
    y = ember.from_numpy(a.astype(np.int16))
    assert y.dtype is ember.int16
    np.testing.assert_array_equal(y.numpy(), a.astype(np.int16))
    np.testing.assert_allclose(np.exp(x * 2), np.exp(a * 2), rtol=1e-6)  # a pending value is computed on demand


def test_dlpack_interop_with_torch():
    a = data(3, 2)
    from_torch = ember.from_dlpack(torch.tensor(a))
    assert from_torch.dtype is ember.float32
    np.testing.assert_array_equal(from_torch.numpy(), a)
    to_torch = torch.from_dlpack(ember.tensor(a) + 1)
    assert to_torch.dtype == torch.float32
    np.testing.assert_allclose(to_torch.numpy(), a + 1, rtol=1e-6)
    ints = ember.from_dlpack(torch.arange(5, dtype=torch.int32))
    assert ints.dtype is ember.int32 and ints.tolist() == [0, 1, 2, 3, 4]


def test_tensor_from_torch_tensors_keeps_the_dtype():
    for dtype in (torch.float64, torch.int32, torch.bfloat16, torch.bool):
        t = (torch.randn(4) * 10).to(dtype)
        e = ember.tensor(t)
        assert e.dtype.name == str(dtype).removeprefix("torch.")
        assert e.tolist() == t.tolist()
