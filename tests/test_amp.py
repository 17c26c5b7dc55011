"""Mixed precision as PyTorch users write it: `ember.autocast` casts the operands of PyTorch's
lower-precision ops (matrix products, convolutions) and of its float32 ops (softmax, norms, losses);
`ember.amp.GradScaler` scales the loss, unscales and checks the gradients, skips bad steps and adapts
its scale exactly as `torch.amp.GradScaler`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ember
import ember.nn.functional as F

pytestmark = pytest.mark.usefixtures("device")


def _arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


LOW_OPS = {
    "matmul": (lambda m, x, w, b: m.matmul(x, w), ((4, 8), (8, 3), (3,))),
    "linear": (lambda m, x, w, b: m.nn.functional.linear(x, w, b), ((4, 8), (3, 8), (3,))),
    "conv2d": (lambda m, x, w, b: m.nn.functional.conv2d(x, w, b, padding=1), ((2, 3, 5, 5), (4, 3, 3, 3), (4,))),
    "conv_transpose2d": (lambda m, x, w, b: m.nn.functional.conv_transpose2d(x, w, b, stride=2),
                         ((2, 3, 4, 4), (3, 2, 3, 3), (2,))),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", LOW_OPS)
def test_autocast_runs_matrix_products_and_convolutions_in_low_precision_as_torch(name, dtype, device):
    fn, shapes = LOW_OPS[name]
    arrays = _arrays(*shapes)
    low = getattr(ember, dtype)
    with ember.autocast(device, dtype=low):
        out = fn(ember, *(ember.tensor(a) for a in arrays))
    assert out.dtype is low
    # torch's CPU autocast casts these ops' operands the same way
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        want = fn(TorchNamespace, *(torch.tensor(a) for a in arrays))
    assert str(want.dtype) == f"torch.{dtype}"
    np.testing.assert_allclose(out.float().numpy(), want.float().numpy(), rtol=2e-2, atol=5e-2)


class TorchNamespace:
    matmul = staticmethod(torch.matmul)
    nn = torch.nn


FLOAT32_OPS = {  # (input, another input of its shape, class targets)
    "softmax": lambda x, y, t: F.softmax(x, dim=-1),
    "log_softmax": lambda x, y, t: F.log_softmax(x, dim=-1),
    "layer_norm": lambda x, y, t: F.layer_norm(x, (x.shape[-1],)),
    "cross_entropy": lambda x, y, t: F.cross_entropy(x, t),
    "mse_loss": lambda x, y, t: F.mse_loss(x, y),
    "l1_loss": lambda x, y, t: F.l1_loss(x, y),
    "smooth_l1_loss": lambda x, y, t: F.smooth_l1_loss(x, y),
    "binary_cross_entropy_with_logits": lambda x, y, t: F.binary_cross_entropy_with_logits(x, (y > 0).float()),
}

# PyTorch's autocast lists (aten/src/ATen/autocast_mode.cpp), for the ops ember has, by device type. The cpu
# ones are also checked against torch's CPU autocast itself below; the cuda ones need a GPU to run.
TORCH_LOWER_PRECISION = {"matmul", "mm", "bmm", "linear", "conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d"}
TORCH_FLOAT32 = {
    "cuda": {"softmax", "log_softmax", "layer_norm", "logsumexp", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
             "smooth_l1_loss", "binary_cross_entropy_with_logits"},
    "cpu": {"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits",
            "binary_cross_entropy"},
}


@pytest.mark.parametrize("name", FLOAT32_OPS)
def test_autocast_runs_the_ops_of_the_float32_list_in_float32(name, device):
    x, y = (ember.tensor(a).to(ember.float16) for a in _arrays((4, 6), (4, 6)))
    target = ember.tensor(np.array([0, 5, 2, 3]))
    with ember.autocast(device, dtype=ember.float16):
        out = FLOAT32_OPS[name](x, y, target)
    expected = ember.float32 if name in TORCH_FLOAT32[device] else ember.float16
    assert out.dtype is expected
    want = FLOAT32_OPS[name](x.to(expected), y.to(expected), target)
    np.testing.assert_allclose(out.float().numpy(), want.float().numpy(), rtol=1e-6, atol=1e-6)


# Every spelling of the ops on the lists, as a function of the library and (x (4, 6), w (6, 3), y (4, 6), class
# targets (4,)): the op's name on the lists and the call.
SPELLINGS = {
    "ember.softmax": ("softmax", lambda m, x, w, y, t: m.softmax(x, -1)),
    "Tensor.softmax": ("softmax", lambda m, x, w, y, t: x.softmax(-1)),
    "F.softmax": ("softmax", lambda m, x, w, y, t: m.nn.functional.softmax(x, dim=-1)),
    "nn.Softmax": ("softmax", lambda m, x, w, y, t: m.nn.Softmax(dim=-1)(x)),
    "ember.log_softmax": ("log_softmax", lambda m, x, w, y, t: m.log_softmax(x, -1)),
    "Tensor.log_softmax": ("log_softmax", lambda m, x, w, y, t: x.log_softmax(-1)),
    "F.log_softmax": ("log_softmax", lambda m, x, w, y, t: m.nn.functional.log_softmax(x, dim=-1)),
    "nn.LogSoftmax": ("log_softmax", lambda m, x, w, y, t: m.nn.LogSoftmax(dim=-1)(x)),
    "ember.logsumexp": ("logsumexp", lambda m, x, w, y, t: m.logsumexp(x, -1)),
    "Tensor.logsumexp": ("logsumexp", lambda m, x, w, y, t: x.logsumexp(-1)),
    "F.layer_norm": ("layer_norm", lambda m, x, w, y, t: m.nn.functional.layer_norm(x, (6,))),
    "nn.LayerNorm": ("layer_norm", lambda m, x, w, y, t: m.nn.LayerNorm(6)(x)),
    "F.cross_entropy": ("cross_entropy", lambda m, x, w, y, t: m.nn.functional.cross_entropy(x, t)),
    "nn.CrossEntropyLoss": ("cross_entropy", lambda m, x, w, y, t: m.nn.CrossEntropyLoss()(x, t)),
    "F.nll_loss": ("nll_loss", lambda m, x, w, y, t: m.nn.functional.nll_loss(x, t)),
    "nn.NLLLoss": ("nll_loss", lambda m, x, w, y, t: m.nn.NLLLoss()(x, t)),
    "F.mse_loss": ("mse_loss", lambda m, x, w, y, t: m.nn.functional.mse_loss(x, y)),
    "nn.MSELoss": ("mse_loss", lambda m, x, w, y, t: m.nn.MSELoss()(x, y)),
    "F.l1_loss": ("l1_loss", lambda m, x, w, y, t: m.nn.functional.l1_loss(x, y)),
    "nn.L1Loss": ("l1_loss", lambda m, x, w, y, t: m.nn.L1Loss()(x, y)),
    "F.smooth_l1_loss": ("smooth_l1_loss", lambda m, x, w, y, t: m.nn.functional.smooth_l1_loss(x, y)),
    "nn.SmoothL1Loss": ("smooth_l1_loss", lambda m, x, w, y, t: m.nn.SmoothL1Loss()(x, y)),
    "F.binary_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",
                                           lambda m, x, w, y, t: m.nn.functional.binary_cross_entropy_with_logits(
                                               x, y.sigmoid())),
    "nn.BCEWithLogitsLoss": ("binary_cross_entropy_with_logits",
                             lambda m, x, w, y, t: m.nn.BCEWithLogitsLoss()(x, y.sigmoid())),
    "F.binary_cross_entropy": ("binary_cross_entropy",
                               lambda m, x, w, y, t: m.nn.functional.binary_cross_entropy(x.sigmoid(), y.sigmoid())),
    "nn.BCELoss": ("binary_cross_entropy", lambda m, x, w, y, t: m.nn.BCELoss()(x.sigmoid(), y.sigmoid())),
    "matmul operator": ("matmul", lambda m, x, w, y, t: x @ w),
    "ember.matmul": ("matmul", lambda m, x, w, y, t: m.matmul(x, w)),
    "Tensor.matmul": ("matmul", lambda m, x, w, y, t: x.matmul(w)),
    "ember.mm": ("mm", lambda m, x, w, y, t: m.mm(x, w)),
    "Tensor.mm": ("mm", lambda m, x, w, y, t: x.mm(w)),
    "ember.bmm": ("bmm", lambda m, x, w, y, t: m.bmm(x[None], w[None])),
    "Tensor.bmm": ("bmm", lambda m, x, w, y, t: x[None].bmm(w[None])),
    "F.linear": ("linear", lambda m, x, w, y, t: m.nn.functional.linear(x, w.T)),
    "nn.Linear": ("linear", lambda m, x, w, y, t: m.nn.Linear(6, 3)(x)),
    "F.conv2d": ("conv2d", lambda m, x, w, y, t: m.nn.functional.conv2d(x.reshape(1, 6, 2, 2), w.reshape(3, 6, 1, 1))),
    "nn.Conv2d": ("conv2d", lambda m, x, w, y, t: m.nn.Conv2d(4, 2, 1)(x.reshape(1, 4, 2, 3))),
    "F.conv_transpose2d": ("conv_transpose2d", lambda m, x, w, y, t: m.nn.functional.conv_transpose2d(
        x.reshape(1, 6, 2, 2), w.reshape(6, 3, 1, 1))),
    "nn.ConvTranspose2d": ("conv_transpose2d", lambda m, x, w, y, t: m.nn.ConvTranspose2d(4, 2, 1)(
        x.reshape(1, 4, 2, 3))),
    "F.conv_transpose3d": ("conv_transpose3d", lambda m, x, w, y, t: m.nn.functional.conv_transpose3d(
        x.reshape(1, 6, 1, 2, 2), w.reshape(6, 3, 1, 1, 1))),
}


def _spelling_inputs(lib, dtype: str):
    x, w, y = _arrays((4, 6), (6, 3), (4, 6), seed=3)
    t = np.array([0, 5, 2, 3])
    if lib is torch:
        return [torch.tensor(a).to(getattr(torch, dtype)) for a in (x, w, y)] + [torch.tensor(t)]
    return [ember.tensor(a).to(dtype) for a in (x, w, y)] + [ember.tensor(t)]


def _torch_dtype_under_autocast(device: str, name: str, fn, dtype: str, low: str) -> str:
    """The dtype torch gives: its CPU autocast run here; its cuda lists applied to its result without autocast."""
    if device == "cpu":
        with torch.autocast("cpu", dtype=getattr(torch, low)):
            return str(fn(torch, *_spelling_inputs(torch, dtype)).dtype).removeprefix("torch.")
    if name in TORCH_LOWER_PRECISION:
        return low
    if name in TORCH_FLOAT32["cuda"]:
        return "float32"
    return str(fn(torch, *_spelling_inputs(torch, dtype)).dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", ["float32", "low"])
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_of_an_op_on_the_autocast_lists_gives_torchs_dtype(spelling, low, dtype, device):
    name, fn = SPELLINGS[spelling]  # (torch refuses binary_cross_entropy under cuda autocast; ember leaves it be)
    dtype = low if dtype == "low" else dtype
    with ember.autocast(device, dtype=getattr(ember, low)):
        out = fn(ember, *_spelling_inputs(ember, dtype))
    assert out.dtype.name == _torch_dtype_under_autocast(device, name, fn, dtype, low)


def test_the_lists_ember_applies_are_torchs(device):
    from ember import amp

    assert amp.LOWER_PRECISION[device] == TORCH_LOWER_PRECISION
    assert amp.FLOAT32[device] == TORCH_FLOAT32[device]


def test_autocast_leaves_float64_other_devices_and_disabled_regions_alone(device):
    x64, w64 = (ember.tensor(a.astype(np.float64)) for a in _arrays((4, 8), (8, 3)))
    x, w = (ember.tensor(a) for a in _arrays((4, 8), (8, 3)))
    other = "cpu" if device == "cuda" else "cuda"
    with ember.autocast(device, dtype=ember.bfloat16):
        assert (x64 @ w64).dtype is ember.float64
        with ember.autocast(device, enabled=False):
            assert (x @ w).dtype is ember.float32
        assert (x @ w).dtype is ember.bfloat16  # the outer setting is back
    with ember.autocast(other, dtype=ember.bfloat16):
        assert (x @ w).dtype is ember.float32
    assert (x @ w).dtype is ember.float32


def test_autocast_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match="device_type"), ember.autocast("tpu"):
        pass
    with pytest.raises(ValueError, match="float16 or bfloat16"), ember.autocast("cpu", dtype=ember.float32):
        pass


def test_autocast_gradients_reach_float32_parameters_as_torch(device):
    x, w, b = _arrays((5, 8), (3, 8), (3,))
    ew, eb = ember.tensor(w, requires_grad=True), ember.tensor(b, requires_grad=True)
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    target = np.array([0, 2, 1, 1, 0])
    with ember.autocast(device, dtype=ember.bfloat16):
        F.cross_entropy(F.linear(ember.tensor(x), ew, eb).relu(), ember.tensor(target)).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(torch.tensor(x), tw, tb).relu(),
                                          torch.tensor(target)).backward()
    assert ew.grad.dtype is ember.float32 and eb.grad.dtype is ember.float32
    np.testing.assert_allclose(ew.grad.numpy(), tw.grad.numpy(), rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(eb.grad.numpy(), tb.grad.numpy(), rtol=3e-2, atol=3e-2)


def _scaled_training(lib, bad_steps, **scaler_options):
    """Ten SGD steps of a linear model under a scaler, with infinite inputs at `bad_steps`; the scales and
    the weights after each step."""
    (x, w0) = _arrays((6, 4), (2, 4), seed=1)
    target = _arrays((6, 2), seed=2)[0]
    if lib is torch:
        w = torch.tensor(w0, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", **scaler_options)
        tensor = torch.tensor
    else:
        w = ember.tensor(w0, requires_grad=True)
        opt = ember.optim.SGD([w], lr=0.1, momentum=0.9)
        scaler = ember.amp.GradScaler(**scaler_options)
        tensor = ember.tensor
    scales, weights = [], []
    for step in range(10):
        inputs = x.copy()
        if step in bad_steps:
            inputs[0, 0] = np.inf
        opt.zero_grad()
        loss = ((tensor(inputs) @ w.T - tensor(target)) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        weights.append(w.detach().numpy().copy())
    return scales, weights


def test_grad_scaler_skips_bad_steps_backs_off_and_grows_as_torch(device):
    options = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    bad = {1, 2, 6}
    scales, weights = _scaled_training(ember, bad, **options)
    want_scales, want_weights = _scaled_training(torch, bad, **options)
    assert scales == want_scales
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for step in bad:  # a skipped step leaves the weights as they were
        np.testing.assert_array_equal(weights[step], weights[step - 1])


def test_grad_scaler_misuse_raises_as_torch(device):
    w = ember.tensor(_arrays((2, 2))[0], requires_grad=True)
    opt = ember.optim.SGD([w], lr=0.1)
    scaler = ember.amp.GradScaler()
    scaler.scale((w * w).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    half = ember.tensor(_arrays((2, 2))[0], requires_grad=True, dtype=ember.float16)
    half_opt = ember.optim.SGD([half], lr=0.1)
    scaler.scale((half * half).sum()).backward()
    with pytest.raises(ValueError, match="float16 gradients"):
        scaler.unscale_(half_opt)
    with pytest.raises(ValueError, match="growth_factor"):
        ember.amp.GradScaler(growth_factor=0.5)


def test_a_disabled_grad_scaler_is_transparent(device):
    w = ember.tensor(_arrays((2, 2))[0], requires_grad=True)
    scaler = ember.amp.GradScaler(enabled=False)
    loss = (w * w).sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
