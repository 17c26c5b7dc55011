"""A convolution's bias and an eval-mode batch norm folded into the convolution (compiler/conv_folding.py): where
the per-channel affine after a convolution would be a pass over the activation of its own, the cuda plan runs the
convolution on a rescaled weight with a bias instead, and no pass over the activation is left; where a following
pointwise op (a ReLU, a residual add) or a reduction takes the affine in, the plan is as before. Values and
gradients are torch's either way, and the reference backend (which folds nothing) agrees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ON_GPU, random_array, to_torch

import ember
from ember import nn
from ember.explain import plan
from ember.ir import Op
from ember.tensor import apply

pytestmark = [pytest.mark.usefixtures("cuda_backend"), *([pytest.mark.gpu] if ON_GPU else [])]


def conv_and_norm(rng, cin=3, cout=4, kernel=3, *, bias=True, norm=True, groups=1, stride=1, padding=1,
                  dtype=ember.float32, device="cuda"):
    """An ember convolution (and eval-mode batch norm) with random statistics and affine parameters, on `device`,
    and torch's twin, in float32 (the reference values)."""
    layers = [nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=bias)]
    if norm:
        layers.append(nn.BatchNorm2d(cout))
        bn = layers[-1]
        bn.running_mean.data = ember.tensor(random_array(rng, (cout,), "float32", -0.5, 0.5))
        bn.running_var.data = ember.tensor(random_array(rng, (cout,), "float32", 0.3, 2.0))
        bn.weight.data = ember.tensor(random_array(rng, (cout,), "float32", -1.5, 1.5))
        bn.bias.data = ember.tensor(random_array(rng, (cout,), "float32", -1.0, 1.0))
    model = nn.Sequential(*layers)
    reference = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=bias),
                                    *([torch.nn.BatchNorm2d(cout)] if norm else []))
    reference.load_state_dict({k: to_torch(v) for k, v in model.state_dict().items()})
    model.eval()
    reference.eval()
    model.to(device)
    if dtype is not ember.float32:
        model[0].to(dtype)
    ember.realize(*model.parameters(), *model.buffers())
    return model, reference


def folded(p) -> list[tuple[str, ...]]:
    """Per forward convolution of the plan (not its gradients): the ops folded into it (empty: none)."""
    return [k.cores[0].attrs.get("folded", ()) for k in p.kernels if k.cores and k.cores[0].op is Op.CONV2D]


def activation_passes(p, shape) -> int:
    """The plan's generated kernels (or segments) over the activation's shape: passes over it besides the
    convolution's."""
    return sum(1 for k in p.kernels if k.kind.value != "conv2d" for part in (k.segments or [k])
               if tuple(part.space) == tuple(shape))


def close(e, t, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(e.float().numpy(), t.detach().float().numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("bias", [False, True], ids=["conv_without_bias", "conv_with_bias"])
def test_an_eval_batch_norm_with_nothing_after_it_is_folded_into_the_convolutions_weight_and_bias(rng, bias):
    model, reference = conv_and_norm(rng, bias=bias)
    x = random_array(rng, (2, 3, 7, 6), "float32")
    out = model(ember.tensor(x, device="cuda"))
    p = plan(out)
    ops = ("add",) * bias + ("sub", "mul", "mul", "add")
    assert folded(p) == [ops]
    assert activation_passes(p, out.shape) == 0  # the weight and bias are rescaled; the activation is written once
    expected = reference(torch.tensor(x))
    close(out, expected)
    model.to("cpu")  # the reference backend folds nothing, and agrees
    close(model(ember.tensor(x)), expected)


def test_a_convolutions_bias_with_nothing_after_it_is_added_by_the_convolution(rng):
    model, reference = conv_and_norm(rng, norm=False)
    x = random_array(rng, (2, 3, 5, 5), "float32")
    out = model(ember.tensor(x, device="cuda"))
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == ["conv2d"]  # the bias is the parameter itself: nothing to rescale
    assert folded(p) == [("add",)] and p.kernels[0].cores[0].inputs[2] in p.lowered.inputs
    close(out, reference(torch.tensor(x)))


def test_convolutions_in_a_row_each_fold_and_each_runs_once(rng):
    """The second convolution reads the first's folded result (a projection feeding the next block, as in
    MobileNetV2): two convolutions in the plan, and nothing else over the activations."""
    first, first_reference = conv_and_norm(rng, 3, 4)
    second, second_reference = conv_and_norm(rng, 4, 5)
    x = random_array(rng, (2, 3, 8, 8), "float32")
    out = second(first(ember.tensor(x, device="cuda")))
    p = plan(out)
    assert folded(p) == [("add", "sub", "mul", "mul", "add")] * 2
    assert activation_passes(p, out.shape) == 0 and activation_passes(p, (2, 4, 8, 8)) == 0
    close(out, second_reference(first_reference(torch.tensor(x))))


@pytest.mark.parametrize("after", ["relu", "residual_add_and_relu"])
def test_a_following_pointwise_op_still_takes_the_affine_into_its_pass(rng, after):
    """Folding would leave the same pass over the activation and add the rescaling: the plan stays as it was."""
    model, reference = conv_and_norm(rng, cin=4, cout=4)
    x = random_array(rng, (2, 4, 6, 6), "float32")
    xe, xt = ember.tensor(x, device="cuda"), torch.tensor(x)
    if after == "relu":
        out, expected = ember.nn.functional.relu(model(xe)), torch.relu(reference(xt))
    else:
        out, expected = ember.nn.functional.relu(model(xe) + xe), torch.relu(reference(xt) + xt)
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == ["conv2d", "pointwise"]
    assert folded(p) == [()]
    close(out, expected)


def test_a_reduction_that_takes_the_bias_in_leaves_it_unfolded(rng):
    model, reference = conv_and_norm(rng, norm=False)
    x = random_array(rng, (2, 3, 6, 6), "float32")
    out = model(ember.tensor(x, device="cuda")).mean((2, 3))
    assert folded(plan(out)) == [()]
    close(out, reference(torch.tensor(x)).mean((2, 3)))


def test_training_mode_batch_norm_is_not_folded_and_its_gradients_are_torchs(rng):
    """Batch statistics depend on the convolution's result: only the convolution's own bias may fold."""
    model, reference = conv_and_norm(rng)
    model.train()
    reference.train()
    x = random_array(rng, (3, 3, 5, 5), "float32")
    xe, xt = ember.tensor(x, device="cuda", requires_grad=True), torch.tensor(x, requires_grad=True)
    weights = random_array(rng, (3, 4, 5, 5), "float32")
    loss = (model(xe) * ember.tensor(weights, device="cuda")).sum()
    grads = ember.grad(loss, [xe, *model.parameters()])
    assert folded(plan(loss, *grads)) == [()]
    (reference(xt) * torch.tensor(weights)).sum().backward()
    for got, want in zip(grads, [xt, *reference.parameters()]):
        close(got, want.grad, rtol=1e-4, atol=1e-4)
    close(model[1].running_mean, reference[1].running_mean)
    close(model[1].running_var, reference[1].running_var)


def test_a_convolutions_bias_folds_in_training_too_and_every_gradient_is_torchs(rng):
    """The first convolution's result feeds the second convolution, a value of its own: its bias folds, and the
    backward (built from the unfolded add) gives the bias the output gradient's sum."""
    first, first_reference = conv_and_norm(rng, 3, 4, norm=False)
    second, second_reference = conv_and_norm(rng, 4, 2, norm=False)
    x = random_array(rng, (2, 3, 6, 6), "float32")
    xe, xt = ember.tensor(x, device="cuda", requires_grad=True), torch.tensor(x, requires_grad=True)
    out = second(first(xe))
    weights = random_array(rng, tuple(out.shape), "float32")
    parameters = [*first.parameters(), *second.parameters()]
    grads = ember.grad((out * ember.tensor(weights, device="cuda")).sum(), [xe, *parameters])
    assert folded(plan(out, *grads)) == [("add",), ("add",)]
    (second_reference(first_reference(xt)) * torch.tensor(weights)).sum().backward()
    for got, want in zip(grads, [xt, *first_reference.parameters(), *second_reference.parameters()]):
        close(got, want.grad, rtol=1e-4, atol=1e-4)


def test_gradients_through_a_folded_eval_batch_norm_are_torchs(rng):
    """A frozen (eval-mode) batch norm under a convolution being trained: the forward folds, and the backward,
    built from the unfolded ops, gives the input, weight and bias their gradients."""
    model, reference = conv_and_norm(rng)
    for p in (*model[1].parameters(), *reference[1].parameters()):
        p.requires_grad_(False)
    x = random_array(rng, (2, 3, 5, 5), "float32")
    xe, xt = ember.tensor(x, device="cuda", requires_grad=True), torch.tensor(x, requires_grad=True)
    out = model(xe)
    weights = random_array(rng, tuple(out.shape), "float32")
    grads = ember.grad((out * ember.tensor(weights, device="cuda")).sum(), [xe, *model[0].parameters()])
    assert folded(plan(out, *grads)) == [("add", "sub", "mul", "mul", "add")]
    expected = reference(xt)
    (expected * torch.tensor(weights)).sum().backward()
    close(out, expected)
    for got, want in zip(grads, [xt, *reference[0].parameters()]):
        close(got, want.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_a_half_precision_convolution_folds_scalars_float16_cannot_hold(rng, memory_format):
    """0.1 and 1/3 are rounded in float16 as torch rounds them; the fold computes the scale and shift in float32
    and rounds the result once. On channels-last memory the result's one pass back to the (N, C, H, W) layout
    takes the affine in, so there is nothing to fold and no pass more."""
    model, reference = conv_and_norm(rng, norm=False, dtype=ember.float16)
    x = random_array(rng, (2, 3, 6, 6), "float32")
    with ember.conv_memory_format(memory_format):
        out = model(ember.tensor(x, device="cuda").half()) * 0.1 + 1 / 3
        p = plan(out)
    nchw = memory_format == "contiguous"
    assert out.dtype is ember.float16 and folded(p) == [("add", "mul", "add") if nchw else ()]
    assert activation_passes(p, out.shape) == (0 if nchw else 1)
    expected = reference.half()(torch.tensor(x).half()) * 0.1 + 1 / 3
    close(out, expected, rtol=1e-2, atol=2e-3)


AFFINES = {  # name: the affine of the convolution's result y, for either library
    "negation": lambda y: -y,
    "subtracted_from_a_scalar": lambda y: 1.5 - y,
    "divided_by_a_scalar": lambda y: y / 3.0 - 0.25,
}


@pytest.mark.parametrize("affine", AFFINES)
def test_every_form_of_a_per_channel_affine_folds_and_matches_torch(rng, affine):
    model, reference = conv_and_norm(rng, norm=False)
    x = random_array(rng, (2, 3, 6, 6), "float32")
    out = AFFINES[affine](model(ember.tensor(x, device="cuda")))
    assert len(folded(plan(out))[0]) > 1
    close(out, AFFINES[affine](reference(torch.tensor(x))))


def test_a_per_channel_factor_computed_from_the_convolutions_own_result_is_not_folded(rng):
    """As with a training-mode batch norm's statistics, the factor is not known before the convolution runs."""
    model, reference = conv_and_norm(rng, norm=False)
    x = random_array(rng, (2, 3, 6, 6), "float32")

    def scaled(y):
        return y * y[:1, :, :1, :1].abs()
    out = scaled(model(ember.tensor(x, device="cuda")))
    assert folded(plan(out)) == [()]
    close(out, scaled(reference(torch.tensor(x))))


# name: (convolution: cin, cout, kernel, groups, stride, padding; input's batch and spatial size), each activation
# large enough that a pass over it moves more bytes than rescaling the weight
SHAPES = {
    "batch_of_one": ((3, 4, 3, 1, 1, 1), (1, 8)),
    "one_channel": ((1, 1, 3, 1, 1, 1), (2, 5)),
    "one_by_one_spatial": ((3, 4, 1, 1, 1, 0), (32, 1)),
    "grouped": ((4, 6, 3, 2, 2, 1), (2, 7)),
    "depthwise": ((4, 4, 3, 4, 1, 1), (2, 6)),
}


@pytest.mark.parametrize("case", SHAPES)
def test_degenerate_and_grouped_convolutions_fold_and_match_torch(rng, case):
    (cin, cout, kernel, groups, stride, padding), (batch, size) = SHAPES[case]
    model, reference = conv_and_norm(rng, cin, cout, kernel, groups=groups, stride=stride, padding=padding)
    x = random_array(rng, (batch, cin, size, size), "float32")
    out = model(ember.tensor(x, device="cuda"))
    p = plan(out)
    assert folded(p) == [("add", "sub", "mul", "mul", "add")]
    close(out, reference(torch.tensor(x)))


def test_a_channels_last_half_precision_convolution_folds_the_batch_norm_before_the_next_convolution(rng):
    """On (N, H, W, C) memory the channels are the last axis; the batch norm's result is the next convolution's
    operand, a value of its own, so the fold saves its pass."""
    with ember.conv_memory_format("channels_last"):
        model, reference = conv_and_norm(rng, 4, 8, dtype=ember.bfloat16)
        after, after_reference = conv_and_norm(rng, 8, 8, 1, bias=False, norm=False, padding=0, dtype=ember.bfloat16)
        x = random_array(rng, (2, 4, 6, 6), "float32")
        h = model[1](model[0](ember.tensor(x, device="cuda").bfloat16()).float()).bfloat16()
        out = after(h)
        p = plan(out)
    first = next(k.cores[0] for k in p.kernels if k.kind.value == "conv2d")
    assert first.attrs.get("channels_last") and folded(p) == [("add", "sub", "mul", "mul", "add"), ()]
    close(out, after_reference(reference(torch.tensor(x))), rtol=5e-2, atol=5e-2)


def test_a_large_weight_over_a_small_activation_is_not_rescaled(rng):
    """Rescaling a 128 x 128 weight moves more bytes than one pass over a 1 x 128 x 1 x 1 activation saves."""
    model, reference = conv_and_norm(rng, 128, 128, 1, padding=0)
    x = random_array(rng, (1, 128, 1, 1), "float32")
    out = model(ember.tensor(x, device="cuda"))
    assert folded(plan(out)) == [()]
    close(out, reference(torch.tensor(x)), rtol=1e-4, atol=1e-4)


def test_explain_names_the_ops_folded_into_the_convolution(rng):
    model, _ = conv_and_norm(rng)
    text = str(plan(model(ember.tensor(random_array(rng, (2, 3, 8, 8), "float32"), device="cuda"))))
    assert "folded add, sub, mul, mul, add per channel into its rescaled weight and bias" in text, text


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_convolution_primitive_with_a_bias_is_torchs_conv2d_with_its_gradients(rng, device):
    """What the fold makes, as a primitive: its reference value and its VJP (the bias's gradient is the output
    gradient summed per channel), and the vendor call's (cuda), with a float32 bias beside float16 values."""
    x, w, b = (random_array(rng, shape, "float32") for shape in ((2, 4, 5, 5), (6, 2, 3, 3), (6,)))
    attrs = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=2)
    xe, we, be = (ember.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    out = apply(Op.CONV2D, xe, we, be, **attrs)
    g = random_array(rng, tuple(out.shape), "float32")
    grads = ember.grad((out * ember.tensor(g, device=device)).sum(), [xe, we, be])
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    expected = torch.nn.functional.conv2d(xt, wt, bt, padding=1, groups=2)
    (expected * torch.tensor(g)).sum().backward()
    close(out, expected)
    for got, want in zip(grads, (xt, wt, bt)):
        close(got, want.grad, rtol=1e-4, atol=1e-4)
    half = apply(Op.CONV2D, xe.detach().half(), we.detach().half(), be.detach(), **attrs)
    assert half.dtype is ember.float16
    close(half, expected, rtol=1e-2, atol=1e-2)
