"""DLPack both ways, without copies: ember tensors on NumPy's and torch's memory and theirs on ember's.
The cuda device runs through the interpreter here (its buffers are torch CPU tensors); tests/test_gpu.py
checks the same contract on a GPU, streams included."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import ON_GPU

import ember


def host_pointer(e: ember.Tensor) -> int:
    """Where a cpu tensor's (or an interpreted cuda tensor's) values live."""
    buffer = e.realize()._node.buffer
    return buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()


def test_from_dlpack_of_a_numpy_array_shares_its_memory(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    e = ember.from_dlpack(a)
    assert e.device == ember.device("cpu").device and e.dtype is ember.float32 and e.shape == (3, 4)
    assert host_pointer(e) == a.ctypes.data
    a[1, 2] = 42.0  # a write through NumPy is seen by what ember computes from the tensor afterwards
    assert (e * 1).numpy()[1, 2] == 42.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_from_dlpack_of_a_torch_cpu_tensor_shares_its_memory(dtype):
    t = (torch.randn(5, 3) * 4).to(dtype)
    e = ember.from_dlpack(t)
    assert e.dtype.name == str(dtype).removeprefix("torch.") and e.shape == (5, 3)
    assert host_pointer(e) == t.data_ptr()
    np.testing.assert_array_equal(e.numpy().astype(np.float64), t.double().numpy())
    if dtype is not torch.bool:
        t.add_(1)
        np.testing.assert_array_equal((e + 0).numpy().astype(np.float64), t.double().numpy())


def test_torch_from_dlpack_of_a_pending_tensor_computes_it_and_shares_the_result(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    e = ember.tensor(x) * 2 + 1  # pending
    t = torch.from_dlpack(e)
    np.testing.assert_allclose(t.numpy(), x * 2 + 1, rtol=1e-6)
    assert t.data_ptr() == host_pointer(e)
    assert torch.from_dlpack(e).data_ptr() == t.data_ptr()  # the same memory each time
    t.mul_(3)  # a write through torch is seen by ember's later computations
    np.testing.assert_allclose((e - 1).numpy(), (x * 2 + 1) * 3 - 1, rtol=1e-5)


def test_numpy_and_torch_read_bfloat16_and_constants_through_dlpack():
    e = ember.tensor(np.array([1.5, -2.25, 3.0], dtype=ml_dtypes.bfloat16))
    t = torch.from_dlpack(e)
    assert t.dtype is torch.bfloat16 and t.tolist() == [1.5, -2.25, 3.0]
    assert t.data_ptr() == host_pointer(e)
    ones = ember.ones(2, 3)  # a constant: no memory until it is exported
    np.testing.assert_array_equal(np.from_dlpack(ones), np.ones((2, 3), np.float32))
    assert torch.from_dlpack(ones).sum().item() == 6.0


@pytest.mark.skipif(ON_GPU, reason="the interpreter's cuda device; tests/test_gpu_transfer.py checks a GPU's")
def test_interpreted_cuda_tensors_share_their_torch_buffers(cuda_backend, rng):
    x = rng.standard_normal(10).astype(np.float32)
    e = ember.tensor(x, device="cuda").exp()
    assert e.__dlpack_device__() == (1, 0)  # the interpreter's cuda device is the CPU
    t = torch.from_dlpack(e)
    assert t.data_ptr() == e._node.buffer.data_ptr()
    np.testing.assert_allclose(t.numpy(), np.exp(x), rtol=1e-6)


def test_dlpack_device_names_cpu_tensors_without_computing_them():
    e = ember.ones(3) * 2
    assert e.__dlpack_device__() == (1, 0)
    assert not e._node.realized


def test_non_contiguous_memory_is_copied_once_and_keeps_its_values():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    e = ember.from_dlpack(t)
    assert e.shape == (4, 3)
    np.testing.assert_array_equal(e.numpy(), t.numpy())


def test_ember_tensor_of_a_torch_cpu_tensor_is_a_copy():
    t = torch.randn(4)
    e = ember.tensor(t)
    before = t.numpy().copy()
    t.add_(1)
    np.testing.assert_array_equal(e.numpy(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_zero_dimensional_torch_cpu_tensors_keep_their_shape(dtype):
    t = torch.tensor(2.5).to(dtype)
    for e in (ember.tensor(t), ember.from_dlpack(t)):
        assert e.shape == () and e.dtype.name == str(dtype).removeprefix("torch.")
        assert e.numpy().astype(np.float64) == t.double().item()


def test_bad_dlpack_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="__dlpack__"):
        ember.from_dlpack([1, 2, 3])
    with pytest.raises(ember.DTypeError, match="complex64"):
        ember.from_dlpack(torch.zeros(2, dtype=torch.complex64))
