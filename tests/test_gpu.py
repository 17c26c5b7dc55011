"""The GPU suite (`pytest -m gpu`): generated kernels on a real CUDA device, at realistic sizes,
against torch on the same GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import check_relu_rounding

import ember
import ember.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("EMBER_INTERPRET", "0") != "0",
                       reason="needs a CUDA GPU (and EMBER_INTERPRET unset)"),
]


def from_torch(t: torch.Tensor) -> ember.Tensor:
    return ember.tensor(t.detach().cpu(), device="cuda")


def close(e: ember.Tensor, t: torch.Tensor, rtol: float, atol: float) -> None:
    np.testing.assert_allclose(e.numpy().astype(np.float32), t.detach().float().cpu().numpy(), rtol=rtol, atol=atol)


BF16 = dict(rtol=2e-2, atol=2e-2)
F32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_and_layer_norm_match_torch_at_scale(dtype):
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    b = torch.randn(4096, device="cuda", dtype=dtype)
    tol = BF16 if dtype is torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    ex = from_torch(x)
    close(ex.softmax(-1), torch.softmax(x, -1), **tol)
    close(F.layer_norm(ex, (4096,), from_torch(w), from_torch(b)),
          torch.nn.functional.layer_norm(x, (4096,), w, b), **tol)


def test_cross_entropy_forward_and_backward_match_torch_at_scale():
    logits = torch.randn(8192, 32000, device="cuda", requires_grad=True)
    target = torch.randint(0, 32000, (8192,), device="cuda")
    loss = torch.nn.functional.cross_entropy(logits, target)
    loss.backward()
    el = from_torch(logits).requires_grad_()
    eloss = F.cross_entropy(el, from_torch(target))
    eloss.backward()
    close(eloss, loss, rtol=1e-5, atol=1e-5)
    close(el.grad, logits.grad, rtol=1e-4, atol=1e-8)


def test_mlp_training_step_matches_torch():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)]
    reference = torch.nn.Sequential(*layers).cuda()
    model = ember.nn.Sequential(ember.nn.Linear(784, 512), ember.nn.ReLU(), ember.nn.Linear(512, 10)).to("cuda")
    model.load_state_dict({k: ember.tensor(v.cpu()) for k, v in reference.state_dict().items()})
    opt_t = torch.optim.Adam(reference.parameters(), lr=1e-3)
    opt_e = ember.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(256, 784, device="cuda")
        y = torch.randint(0, 10, (256,), device="cuda")
        loss_t = torch.nn.functional.cross_entropy(reference(x), y)
        opt_t.zero_grad()
        loss_t.backward()
        opt_t.step()
        loss_e = F.cross_entropy(model(from_torch(x)), from_torch(y))
        opt_e.zero_grad()
        loss_e.backward()
        opt_e.step()
        close(loss_e, loss_t, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        close(p, q, rtol=1e-3, atol=1e-5)


def test_random_numbers_on_the_gpu_match_the_reference_generator():
    ember.manual_seed(11)
    a = ember.rand(1 << 20, device="cuda") + ember.randn(1 << 20, device="cuda")
    ember.manual_seed(11)
    b = ember.rand(1 << 20) + ember.randn(1 << 20)
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


@pytest.mark.parametrize("width,depth,dtype,activation", [
    (32, 5, torch.float16, torch.nn.GELU), (64, 5, torch.float16, torch.nn.GELU),
    (128, 3, torch.bfloat16, torch.nn.GELU), (100, 8, torch.float16, torch.nn.GELU),
    (64, 5, torch.float16, torch.nn.ReLU), (48, 4, torch.float16, torch.nn.ReLU)])
def test_narrow_mlp_is_one_kernel_and_matches_torch_at_scale(width, depth, dtype, activation):
    """Persistent programs walking row tiles, biases loaded before the walk; ReLU clamps the float16 operand
    after its cast, NaN passing through as in torch."""
    from ember.compiler.fused import KernelKind
    from ember.explain import plan

    torch.manual_seed(width + depth)
    sizes = [width] * depth + [16]
    layers = []
    for i in range(depth):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1])] + ([activation()] if i < depth - 1 else [])
    model = torch.nn.Sequential(*layers).to("cuda", dtype).eval()
    x = torch.randn(2**18 + 3, width, device="cuda", dtype=dtype)
    x[5, 1] = float("nan")
    em = ember.from_torch(model)
    with ember.no_grad():
        out = em(ember.from_dlpack(x))
        assert [k.kind for k in plan(out).kernels] == [KernelKind.MLP]
        got = torch.from_dlpack(out).float()
    with torch.no_grad():
        ref = model.float()(x.float())
    assert got[5].isnan().all() and ref[5].isnan().all()
    got[5], ref[5] = 0, 0
    assert ((got - ref).norm() / ref.norm()).item() < (2e-2 if dtype is torch.float16 else 5e-2)


@pytest.mark.parametrize("rows", [37, 2**16 + 3])
def test_relu_in_an_mlp_operands_conversion_rounds_and_clamps_as_torch(rows):
    """The ReLU the float16 conversion applies (cvt.rn.relu.f16x2.f32), on the values where it could differ."""
    check_relu_rounding(rows)


def test_sums_over_a_narrow_mlps_rows_are_taken_inside_its_kernel_at_scale():
    """A mean squared error and column means of an MLP's output over 2^18 + 3 rows (both staged in two
    reductions by the passes) are summed by the MLP kernel's programs: one kernel, values as torch's."""
    from ember.compiler.fused import KernelKind
    from ember.explain import plan

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16)).to("cuda", torch.float16).eval()
    x = torch.randn(2**18 + 3, 64, device="cuda", dtype=torch.float16)
    y = torch.randn(2**18 + 3, 16, device="cuda", dtype=torch.float16)
    em = ember.from_torch(model)
    with ember.no_grad():
        out = em(ember.from_dlpack(x)).float()
        loss = ((out - ember.from_dlpack(y).float()) ** 2).mean()
        columns = out.mean(0)
        kernels = plan(loss, columns).kernels
        assert [k.kind for k in kernels] == [KernelKind.MLP] and len(kernels[0].payload.summed) == 2
        got = [torch.from_dlpack(t.realize()).double() for t in (loss, columns)]
    with torch.no_grad():
        ref = model.double()(x.double())
    want = [((ref - y.double()) ** 2).mean(), ref.mean(0)]
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() < 2e-3


def _mlp(sizes: list[int], activation, dtype) -> torch.nn.Sequential:
    layers = []
    for i in range(len(sizes) - 1):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1])] + ([activation()] if i < len(sizes) - 2 else [])
    return torch.nn.Sequential(*layers).to("cuda", dtype)


def _checked_training_step(model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """One MSE step of `model` through ember.from_torch, its loss and every gradient checked against torch's in
    float64, within twice torch's own error in x's type; the layers of each MLP kernel of its plan. The loss is
    scaled as a GradScaler scales half-precision training: unscaled, a mean over millions of errors gives
    gradients in float16's subnormal range, where both lose most digits."""
    import copy

    from ember.compiler.fused import KernelKind
    from ember.explain import plan

    scale = 2.0**16

    def step(net, xs, ys):
        loss = ((net(xs).float() - ys.float()) ** 2).mean() * scale
        loss.backward()
        return [loss.detach().double()] + [p.grad.double() for p in net.parameters()]

    em = ember.from_torch(model)
    loss = ((em(ember.from_dlpack(x)).float() - ember.from_dlpack(y).float()) ** 2).mean() * scale
    loss.backward()
    grads = [p.grad for p in em.parameters()]
    kernels = plan(loss, *grads).kernels
    got = [torch.from_dlpack(t.realize()).double() for t in [loss, *grads]]
    want = step(copy.deepcopy(model).double(), x.double(), y.double())
    theirs = step(copy.deepcopy(model), x, y)
    for i, (g, w, t) in enumerate(zip(got, want, theirs)):
        error, torch_error = ((g - w).norm() / w.norm()).item(), ((t - w).norm() / w.norm()).item()
        assert error < max(1e-2, 2 * torch_error), (i, error, torch_error)
    return [len(k.cores) for k in kernels if k.kind is KernelKind.MLP]


@pytest.mark.parametrize("dtype,floor", [(torch.float32, 5e-3), (torch.bfloat16, 0.15)])
def test_a_residual_cnn_imported_from_torch_trains_as_torch_at_size(dtype, floor):
    """A torch module with residual blocks, batch norm, pooling and functional calls, imported through torch.fx
    with its parameters and buffers shared on the GPU: one cross-entropy step's loss, every gradient and the
    updated running statistics within twice torch's own error in the same type (against float64), or `floor`.
    Batch norm's backward cancels: in bfloat16 torch's own gradients are 1-40% off float64's."""
    import copy

    from test_from_torch import net

    model = net(21, width=32, classes=10).to("cuda", dtype).train()
    x = torch.randn(64, 3, 32, 32, device="cuda", dtype=dtype)
    y = torch.randint(0, 10, (64,), device="cuda")
    em = ember.from_torch(model)
    loss = F.cross_entropy(em(ember.from_dlpack(x)).float(), ember.from_dlpack(y))
    loss.backward()
    values = [loss] + [p.grad for p in em.parameters()] + [b for b in em.buffers() if b.dtype.is_floating_point]
    got = [torch.from_dlpack(t.realize()).double() for t in values]

    def step(m, xs):
        out = m(xs)
        loss = torch.nn.functional.cross_entropy(out if out.dtype is torch.float64 else out.float(), y)
        loss.backward()
        return [loss.detach().double()] + [p.grad.double() for p in m.parameters()] + [
            b.double() for b in m.buffers() if b.is_floating_point()]

    want = step(copy.deepcopy(model).double(), x.double())
    theirs = step(copy.deepcopy(model), x)
    assert len(got) == len(want) == len(theirs)
    for i, (g, w, t) in enumerate(zip(got, want, theirs)):
        error, torch_error = ((g - w).norm() / w.norm()).item(), ((t - w).norm() / w.norm()).item()
        assert error < max(floor, 2 * torch_error), (i, error, torch_error)


@pytest.mark.parametrize("width,activation,dtype", [(64, torch.nn.ReLU, torch.float16),
                                                    (32, torch.nn.SiLU, torch.bfloat16),
                                                    (128, torch.nn.Tanh, torch.float16)])
def test_a_narrow_mlps_training_step_fuses_and_matches_torch_at_scale(width, activation, dtype, monkeypatch):
    """Forward and backward chains as MLP kernels, the weight gradients as split-K GEMMs, over 2^18 + 5 rows:
    the loss and every gradient within twice torch's own error in the same type (against float64)."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    torch.manual_seed(width)
    model = _mlp([width] * 5 + [16], activation, dtype)
    x = torch.randn(2**18 + 5, width, device="cuda", dtype=dtype)
    y = torch.randn(2**18 + 5, 16, device="cuda", dtype=dtype)
    assert len(_checked_training_step(model, x, y)) == 2


def test_the_narrow_layers_between_wide_ones_are_one_kernel_at_scale(monkeypatch):
    """A 784-wide input and a 256-wide hidden layer around 64-wide layers: the narrow layers are one MLP kernel
    in the forward and one in the backward, the wide ones GEMMs; the output, the loss and every gradient as
    torch's (within twice its own error in float16)."""
    from ember.compiler.fused import KernelKind
    from ember.explain import plan

    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    torch.manual_seed(3)
    model = _mlp([784, 64, 64, 64, 256, 16], torch.nn.GELU, torch.float16)
    x = torch.randn(2**16 + 5, 784, device="cuda", dtype=torch.float16)
    y = torch.randn(2**16 + 5, 16, device="cuda", dtype=torch.float16)
    with ember.no_grad():
        out = ember.from_torch(model)(ember.from_dlpack(x))
        kernels = plan(out).kernels
        assert [len(k.cores) for k in kernels if k.kind is KernelKind.MLP] == [2], [k.kind for k in kernels]
        got = torch.from_dlpack(out).float()
    with torch.no_grad():
        ref = model.float()(x.float())
        model.half()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2
    # the forward's layers 2-3 (64-64-64), and the input gradient's walk back through them
    assert _checked_training_step(model, x, y) == [2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 1, 1, 1), (2, 3, 1, 1), (1, 2, 2, 1),
                                                               (2, 1, 1, 4)])
def test_convolutions_write_into_their_buffers_and_match_torch(dtype, memory_format, stride, padding, dilation,
                                                              groups, monkeypatch):
    """A convolution's forward runs on cuDNN straight into ember's buffer (grouped ones as torch runs them, through
    a copy), and so does a stride-1 convolution's input gradient; values and gradients match torch's on the same
    GPU, both memory formats."""
    from ember.runtime import vendor

    written = []
    into = vendor._into_buffer
    gradients = []  # the calls on 16 channels: the output gradient's (an input gradient as a forward convolution)
    monkeypatch.setattr(vendor, "_into_buffer", lambda x, *args: gradients.append(x.shape[1] == 16)
                        or written.append(into(x, *args)) or written[-1])
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 as IEEE float32 on both sides
    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 8, 19, 17, device="cuda", dtype=dtype, generator=generator)
    w = torch.randn(16, 8 // groups, 3, 3, device="cuda", dtype=dtype, generator=generator) * 0.2
    g = torch.randn(4, 16, (19 + 2 * padding - 2 * dilation - 1) // stride + 1,
                    (17 + 2 * padding - 2 * dilation - 1) // stride + 1, device="cuda", dtype=dtype,
                    generator=generator)
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.conv2d(tx, tw, None, stride, padding, dilation, groups)
    want.backward(g)
    ex, ew = from_torch(x).requires_grad_(), from_torch(w).requires_grad_()
    with ember.conv_memory_format(memory_format):
        got = F.conv2d(ex, ew, None, stride, padding, dilation, groups)
        (got * from_torch(g)).sum().backward()
        tolerance = BF16 if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        close(got, want, **tolerance)
        close(ex.grad, tx.grad, **tolerance)
        close(ew.grad, tw.grad, **tolerance)
    if groups == 1 and (memory_format == "contiguous" or dtype == torch.bfloat16):
        assert written and all(written)
        # a stride-1 convolution's input gradient too, as a forward convolution (vendor.input_grad_as_forward)
        assert any(gradients) == (stride == 1) and not all(gradients)
