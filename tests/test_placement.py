"""Device placement: `ember.on_device` regions, mixed-device errors, `module.to`, and cuda:N devices.

Without a GPU the cuda device runs through Triton's interpreter (see conftest.py), so every test here
runs in CI; on a GPU machine the same tests run on the real device.
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import pytest

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.device import as_device
from ember.errors import DeviceError
from ember.ir import Op

pytestmark = pytest.mark.usefixtures("cuda_backend")

CPU, CUDA = ember.Device("cpu"), as_device("cuda")


def values(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# -- on_device ------------------------------------------------------------------------------------

def test_on_device_runs_fn_on_the_device_and_brings_results_back(rng):
    a, b = values(rng, 3, 4), values(rng, 4, 2)
    seen = []

    def step(x, w):
        seen.extend([x.device, w.device])
        return (x @ w).relu()

    out = ember.on_device("cuda", step, ember.tensor(a), ember.tensor(b))
    assert seen == [CUDA, CUDA]
    assert out.device == CPU
    np.testing.assert_allclose(out.numpy(), np.maximum(a @ b, 0), rtol=1e-5, atol=1e-6)


def test_on_device_moves_tensors_inside_lists_tuples_dicts_and_keywords(rng):
    a, b, c, d = (values(rng, 2, 3) for _ in range(4))

    def step(pair, items, table, scale=None):
        devices = {t.device for t in [*pair, *items, *table.values(), scale]}
        assert devices == {CUDA}
        return {"sum": pair[0] + pair[1], "parts": [items[0] * scale, (table["d"],)], "n": len(items)}

    out = ember.on_device("cuda", step, (ember.tensor(a), ember.tensor(b)), [ember.tensor(c)],
                          {"d": ember.tensor(d)}, scale=ember.tensor(2.0))
    assert out["n"] == 1
    assert {out["sum"].device, out["parts"][0].device, out["parts"][1][0].device} == {CPU}
    assert isinstance(out["parts"], list) and isinstance(out["parts"][1], tuple)
    np.testing.assert_allclose(out["sum"].numpy(), a + b, rtol=1e-6)
    np.testing.assert_allclose(out["parts"][0].numpy(), c * 2, rtol=1e-6)
    np.testing.assert_array_equal(out["parts"][1][0].numpy(), d)


def test_on_device_keeps_the_container_types_of_results(rng):
    Pair = namedtuple("Pair", "first second")
    x = ember.tensor(values(rng, 2))
    out = ember.on_device("cuda", lambda t: (Pair(t, t * 2), OrderedDict(a=t + 1)), x)
    pair, table = out
    assert isinstance(pair, Pair) and isinstance(table, OrderedDict)
    assert pair.second.device == CPU and table["a"].device == CPU
    np.testing.assert_allclose(pair.second.numpy(), x.numpy() * 2)


def test_results_return_to_the_device_the_arguments_came_from(rng):
    a = values(rng, 5)
    on_gpu = ember.tensor(a, device="cuda")
    out = ember.on_device("cpu", lambda t: t.exp(), on_gpu)
    assert out.device == CUDA
    np.testing.assert_allclose(out.numpy(), np.exp(a), rtol=1e-6)


def test_results_go_to_the_default_device_when_arguments_are_on_several_devices_or_none(rng):
    mixed = ember.on_device("cuda", lambda p, q: p + q, ember.ones(2), ember.ones(2, device="cuda"))
    assert mixed.device == ember.default_device() == CPU
    made = ember.on_device("cuda", lambda n: ember.arange(n) * 2, 4)
    assert made.device == CPU
    np.testing.assert_array_equal(made.numpy(), np.arange(4) * 2)


def test_inside_the_region_the_device_is_the_default_for_new_tensors(rng):
    def step(x):
        bias = ember.ones(x.shape)  # made inside the region: on the region's device
        assert bias.device == CUDA and ember.default_device() == CUDA
        return x + bias

    out = ember.on_device("cuda", step, ember.zeros(3))
    assert ember.default_device() == CPU
    np.testing.assert_array_equal(out.numpy(), np.ones(3, dtype=np.float32))


def test_other_values_pass_through_unchanged():
    marker = object()
    out = ember.on_device("cuda", lambda m, s, n=None: (m, s, n), marker, "text", n=3)
    assert out == (marker, "text", 3)


def test_on_device_copies_lazily_at_the_edges_only(rng):
    x = ember.tensor(values(rng, 4))
    out = ember.on_device("cuda", lambda t: (t * 2 + 1).tanh(), x)
    assert not out._node.realized  # nothing ran yet
    assert out._node.op is Op.COPY and out._node.inputs[0].device == CUDA
    copies = []
    stack = [out._node]
    while stack:
        node = stack.pop()
        copies += [node] if node.op is Op.COPY else []
        stack.extend(node.inputs)
    assert len(copies) == 2  # one in, one out: the region's body is one graph on the device
    np.testing.assert_allclose(out.numpy(), np.tanh(x.numpy() * 2 + 1), rtol=1e-6)


def test_gradients_flow_through_an_on_device_region(rng):
    a, w = values(rng, 3, 4), values(rng, 4, 2)
    x, wc = ember.tensor(a, requires_grad=True), ember.tensor(w, requires_grad=True)
    ember.on_device("cuda", lambda p, q: (p @ q).sigmoid().sum(), x, wc).backward()
    x_ref, w_ref = ember.tensor(a, requires_grad=True), ember.tensor(w, requires_grad=True)
    (x_ref @ w_ref).sigmoid().sum().backward()
    assert x.grad.device == CPU and wc.grad.device == CPU
    np.testing.assert_allclose(x.grad.numpy(), x_ref.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wc.grad.numpy(), w_ref.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_on_device_rejects_a_device_that_does_not_exist_at_the_call():
    from ember.runtime import cuda

    missing = f"cuda:{cuda.device_count()}"
    called = []
    with pytest.raises(DeviceError, match=f"{missing} does not exist"):
        ember.on_device(missing, lambda t: called.append(t), ember.ones(2))
    assert not called


# -- mixed devices ----------------------------------------------------------------------------------

def _cpu(*shape, dtype=ember.float32):
    return ember.ones(*shape, dtype=dtype)


def _gpu(*shape, dtype=ember.float32):
    return ember.ones(*shape, dtype=dtype, device="cuda")


MIXED = {
    "add": lambda: _cpu(2, 3) + _gpu(2, 3),
    "matmul": lambda: _cpu(2, 3) @ _gpu(3, 4),
    "where": lambda: ember.where(_cpu(2, 3, dtype=ember.bool), _cpu(2, 3), _gpu(2, 3)),
    "cat": lambda: ember.cat([_cpu(2, 3), _gpu(2, 3)]),
    "conv2d": lambda: F.conv2d(_cpu(1, 1, 4, 4), _gpu(1, 1, 3, 3)),
    "gather": lambda: ember.gather(_cpu(2, 3), 1, _gpu(2, 1, dtype=ember.int64)),
    "index": lambda: _cpu(2, 3)[_gpu(2, dtype=ember.int64)],
    "scatter_add": lambda: _cpu(2, 3).scatter_add(0, _cpu(2, 3, dtype=ember.int64), _gpu(2, 3)),
}


@pytest.mark.parametrize("op", list(MIXED))
def test_mixing_devices_fails_at_the_call_naming_op_operands_and_fix(op):
    with pytest.raises(DeviceError) as info:
        MIXED[op]()
    message = str(info.value)
    assert message.startswith(f"{op}:"), message
    for fragment in ("device=cpu", "device=cuda:0", "dtype=", "shape=(", '.to("cpu")', '.to("cuda:0")'):
        assert fragment in message, f"{fragment!r} missing from {message!r}"


def test_mixed_device_message_shows_each_operand():
    with pytest.raises(DeviceError) as info:
        _cpu(2, 3) + _gpu(2, 3, dtype=ember.float16)
    message = str(info.value)
    assert "Tensor(shape=(2, 3), dtype=float32, device=cpu)" in message
    assert "Tensor(shape=(2, 3), dtype=float16, device=cuda:0)" in message


def test_moving_one_operand_fixes_a_mixed_device_op(rng):
    a, b = values(rng, 2, 3), values(rng, 2, 3)
    out = ember.tensor(a) + ember.tensor(b, device="cuda").to("cpu")
    np.testing.assert_allclose(out.numpy(), a + b, rtol=1e-6)


# -- modules ----------------------------------------------------------------------------------------

def test_module_to_cuda_moves_parameters_and_the_forward_matches_the_cpu(rng):
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    x = values(rng, 5, 6)
    want = model(ember.tensor(x)).numpy()
    assert model.to("cuda") is model
    assert {p.device for p in model.parameters()} == {CUDA}
    got = model(ember.tensor(x, device="cuda"))
    assert got.device == CUDA
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    model.to("cpu")
    assert {p.device for p in model.parameters()} == {CPU}


def test_a_module_on_the_gpu_runs_inside_an_on_device_region_from_cpu_code(rng):
    model = nn.Linear(4, 2)
    x = ember.tensor(values(rng, 3, 4))
    want = model(x).numpy()
    model.to("cuda")
    out = ember.on_device("cuda", model, x)
    assert out.device == CPU
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


# -- cuda:N -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, index", [("cuda", 0), ("cuda:0", 0), ("cuda:1", 1), ("cuda:12", 12)])
def test_cuda_devices_with_an_index_parse(spec, index):
    device = as_device(spec)
    assert device == ember.Device("cuda", index)
    assert str(device) == f"cuda:{index}"
    assert as_device(str(device)) is device


def test_a_cuda_index_that_does_not_exist_names_the_devices_that_do():
    from ember.runtime import cuda

    count = cuda.device_count()
    missing = f"cuda:{count}"
    with pytest.raises(DeviceError) as info:
        ember.tensor([1.0, 2.0], device=missing)  # data is uploaded at the call
    message = str(info.value)
    assert f"{missing} does not exist" in message and f"{count} " in message and "cuda:0" in message
    with pytest.raises(DeviceError, match=f"{missing} does not exist"):
        ember.data.DataLoader(np.zeros((4, 2)), batch_size=2, device=missing)
    lazy = ember.ones(2).to(missing)  # a lazy copy: the device is checked when the value is computed
    with pytest.raises(DeviceError, match=f"{missing} does not exist"):
        lazy.numpy()


def test_the_interpreter_runs_one_cuda_device():
    from ember.runtime import cuda

    if not cuda.TARGET.interpret:
        pytest.skip("runs under EMBER_INTERPRET=1")
    assert cuda.device_count() == 1
    assert ember.tensor([1.0], device="cuda:0").numpy().tolist() == [1.0]
    with pytest.raises(DeviceError, match="interpreter"):
        ember.tensor([1.0], device="cuda:1")


def test_module_to_dtype_keeps_the_device():
    model = ember.nn.Linear(4, 3).to("cuda")
    model.to(ember.bfloat16)
    assert all(p.device == ember.Device("cuda") and p.dtype is ember.bfloat16 for p in model.parameters())
    model.to("cpu", ember.float32)
    assert all(p.device == ember.Device("cpu") and p.dtype is ember.float32 for p in model.parameters())


def test_the_device_context_places_new_tensors_and_modules():
    with ember.device("cuda"):
        model = ember.nn.Linear(4, 3)
        x = ember.randn(2, 4)
        y = model(x)
    assert all(p.device == ember.Device("cuda") for p in model.parameters())
    assert x.device == y.device == ember.Device("cuda")
    assert ember.zeros(1).device == ember.Device("cpu")  # back to the default outside the block
    expected = x.numpy() @ model.weight.numpy().T + model.bias.numpy()
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_matmul_precision_is_set_as_in_pytorch():
    import torch

    from ember.runtime import cuda  # noqa: F401 - the backend follows the setting once loaded

    assert ember.get_matmul_precision() == "highest"
    try:
        ember.set_matmul_precision("high")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        ember.set_matmul_precision("highest")
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        with pytest.raises(ValueError, match="highest, high, medium"):
            ember.set_matmul_precision("low")
    finally:
        ember.set_matmul_precision("highest")


def test_a_value_that_depends_on_no_data_is_made_on_the_gpu_it_moves_to(monkeypatch):
    """A model built on the cpu and moved to the GPU: its initial parameters (random numbers and arithmetic on
    them) are computed on the GPU, nothing on the host, and equal what the cpu computes to rounding."""
    from ember.runtime import reference

    def build():
        ember.manual_seed(4)
        return ember.nn.Sequential(ember.nn.Linear(7, 5), ember.nn.ReLU(), ember.nn.Linear(5, 3))

    expected = [p.numpy() for p in build().parameters()]
    moved = build().to("cuda")
    monkeypatch.setattr(reference, "run", lambda order, keep: pytest.fail("computed on the host"))
    got = [p.numpy() for p in moved.parameters()]
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    data = ember.tensor(np.arange(6, dtype=np.float32)).to("cuda")  # data is copied, not recomputed
    np.testing.assert_array_equal(data.numpy(), np.arange(6, dtype=np.float32))


def test_set_device_names_the_gpu_that_cuda_without_an_index_means():
    from ember.device import as_device

    try:
        ember.set_device("cuda:3")
        assert as_device("cuda") == as_device("cuda:3") and as_device("cuda:1").index == 1
        ember.set_device(2)
        assert str(as_device("cuda")) == "cuda:2"
        with pytest.raises(ember.DeviceError, match="set_device: expected a GPU"):
            ember.set_device("cpu")
    finally:
        ember.set_device(0)
    assert str(as_device("cuda")) == "cuda:0"
