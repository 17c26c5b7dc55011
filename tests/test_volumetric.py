"""The 3-d (volumetric) layers against torch: conv3d (stride, padding incl. 'same' and 'valid', dilation, groups,
bias, the padding modes), conv_transpose3d (stride, padding, output_padding, dilation, groups, bias), max/avg/adaptive
pooling over volumes (max pooling's indices too), interpolate on (N, C, L) and (N, C, D, H, W) input (nearest, linear,
trilinear, area; align_corners), BatchNorm3d; values and gradients in float32 and float64 (float16 for
conv_transpose3d), the layers as modules, and a small 3-d network imported with from_torch (torch.fx and
torch.export) and by torch.compile's ember backend, matching torch's forward and one training step."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import ember
from ember import nn
from tests.conftest import check_against_torch, check_finite_differences, random_array

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("device", "fresh_dynamo")

FLOAT_DTYPES = ("float32", "float64")


def arrays(rng, dtype: str, *shapes) -> list[np.ndarray]:
    return [random_array(rng, shape, dtype) for shape in shapes]


def ties(seed: int, shape) -> np.ndarray:
    """Small integers as floats: most windows hold their maximum more than once."""
    return np.random.default_rng(seed).integers(0, 3, shape).astype(np.float32)


# -- conv3d ---------------------------------------------------------------------------------------

CONV3D_CASES = {  # name: (input shape, weight shape, keyword arguments)
    "basic": ((2, 3, 4, 5, 4), (4, 3, 3, 2, 3), {}),
    "bias-stride-padding": ((1, 2, 5, 6, 5), (3, 2, 3, 3, 2), {"bias": True, "stride": (2, 1, 2), "padding": 1}),
    "dilation-groups": ((2, 4, 6, 5, 5), (6, 2, 2, 3, 2), {"dilation": (2, 1, 2), "groups": 2, "bias": True}),
    "padding-same-even-kernel": ((1, 2, 4, 5, 3), (3, 2, 2, 3, 2), {"padding": "same"}),
    "padding-valid": pytest.param(((1, 2, 3, 4, 4), (2, 2, 3, 3, 3), {"padding": "valid"}), marks=pytest.mark.slow),
    "size-one-dims": ((1, 1, 1, 3, 1), (2, 1, 1, 2, 1), {"bias": True}),
    "unbatched": ((2, 3, 4, 4), (3, 2, 2, 2, 2), {"padding": (0, 1, 1)}),
    "empty-batch": ((0, 2, 3, 3, 3), (3, 2, 2, 2, 2), {}),
    "everything": pytest.param(((2, 6, 7, 8, 6), (6, 2, 3, 2, 3), {"stride": (2, 3, 1), "padding": (1, 0, 2),
                                                                    "dilation": (1, 2, 2), "groups": 3,
                                                                    "bias": True}),
                               marks=pytest.mark.slow),
}


def _convolution(name: str, kwargs: dict):
    """The functional convolution `name` of a case's keyword arguments, its bias (when "bias" is set) an input."""
    def convolve(m, x, w, *rest):
        arguments = dict(kwargs)
        bias = rest[0] if arguments.pop("bias", False) else None
        return getattr(m.nn.functional, name)(x, w, bias, **arguments)
    return convolve


def _convolution_inputs(rng, case, dtype, out_channels):
    """A case's input, weight and (when it has one) bias, the bias of `out_channels(weight shape, kwargs)`."""
    xs, ws, kwargs = case
    return arrays(rng, dtype, xs, ws, *([(out_channels(ws, kwargs),)] if kwargs.get("bias") else []))


def _conv3d_inputs(rng, case, dtype):
    return _convolution_inputs(rng, case, dtype, lambda ws, kwargs: ws[0])


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@pytest.mark.parametrize("case", CONV3D_CASES.values(), ids=CONV3D_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_conv3d_and_its_gradients_match_torch(dtype, case, rng):
    check_against_torch(_convolution("conv3d", case[2]), *_conv3d_inputs(rng, case, dtype))


@pytest.mark.slow
def test_conv3d_gradient_matches_finite_differences(rng):
    case = CONV3D_CASES["dilation-groups"]
    check_finite_differences(_convolution("conv3d", case[2]), *_conv3d_inputs(rng, case, "float64"))


@pytest.mark.parametrize("x, w, kwargs", [
    ((1, 3, 4, 4, 4), (2, 2, 3, 3, 3), {}),  # channels
    ((1, 4, 4, 4, 4), (3, 2, 3, 3, 3), {"groups": 2}),  # out channels not divisible by groups
    ((1, 2, 2, 4, 4), (1, 2, 3, 3, 3), {}),  # the kernel is deeper than the input
    ((1, 2, 5, 5, 5), (1, 2, 3, 3, 3), {"padding": "same", "stride": 2}),
    ((1, 2, 5, 5), (1, 2, 3, 3), {}),  # a 2-d weight
], ids=["channels", "groups", "kernel-too-deep", "same-strided", "weight-rank"])
def test_conv3d_misuse_raises_like_torch(x, w, kwargs):
    with pytest.raises((RuntimeError, ValueError)):
        torch.nn.functional.conv3d(torch.ones(x), torch.ones(w), **kwargs)
    with pytest.raises((ember.ShapeError, ValueError)):
        ember.conv3d(ember.ones(x), ember.ones(w), **kwargs)


@pytest.mark.parametrize("padding_mode, padding", [
    ("zeros", "same"), ("replicate", (1, 0, 2)),
    pytest.param("reflect", 1, marks=pytest.mark.slow), pytest.param("circular", "same", marks=pytest.mark.slow)])
def test_conv3d_module_pads_as_torch_in_every_padding_mode(padding_mode, padding, rng, device):
    if device == "cuda" and padding_mode != "replicate":
        pytest.skip("the padding modes share their kernels (slices and concatenations): replicate covers them")
    torch.manual_seed(0)
    t_conv = torch.nn.Conv3d(2, 4, (3, 2, 3), padding=padding, padding_mode=padding_mode, groups=2)
    e_conv = nn.Conv3d(2, 4, (3, 2, 3), padding=padding, padding_mode=padding_mode, groups=2)
    check_layer_against_torch(e_conv, t_conv, *arrays(rng, "float32", (2, 2, 4, 5, 4)))
    assert f"padding_mode={padding_mode}" in repr(e_conv) or padding_mode == "zeros"


def test_conv3d_module_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match="strided"):
        nn.Conv3d(2, 2, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding_mode"):
        nn.Conv3d(2, 2, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="divisible by groups"):
        nn.Conv3d(3, 2, 3, groups=2)


def check_layer_against_torch(e_conv, t_conv, x: np.ndarray) -> None:
    """The ember layer, on the torch layer's parameters, gives its output and the gradients of the input and of
    every parameter."""
    assert tuple(e_conv.weight.shape) == tuple(t_conv.weight.shape)
    e_conv.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in t_conv.state_dict().items()})
    tx, ex = torch.tensor(x, requires_grad=True), ember.tensor(x, requires_grad=True)
    t_out, e_out = t_conv(tx), e_conv(ex)
    np.testing.assert_allclose(e_out.numpy(), t_out.detach().numpy(), rtol=1e-5, atol=1e-5)
    t_out.square().sum().backward()
    e_out.square().sum().backward()
    np.testing.assert_allclose(ex.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    for name, p in t_conv.named_parameters():
        np.testing.assert_allclose(getattr(e_conv, name).grad.numpy(), p.grad.numpy(), rtol=1e-4, atol=1e-4,
                                   err_msg=name)


# -- conv_transpose3d -----------------------------------------------------------------------------

CONV_TRANSPOSE3D_CASES = {  # name: (input shape, weight shape, keyword arguments)
    "basic": ((2, 3, 3, 4, 3), (3, 4, 2, 3, 2), {}),
    "stride-padding-output-padding": ((1, 2, 3, 2, 3), (2, 3, 3, 2, 3), {"bias": True, "stride": (2, 1, 3),
                                                                          "padding": (1, 0, 1),
                                                                          "output_padding": (1, 0, 2)}),
    "dilation-groups": ((2, 4, 3, 3, 2), (4, 3, 2, 2, 3), {"dilation": (2, 1, 2), "groups": 2, "bias": True}),
    "padding-past-the-taps": ((1, 2, 4, 2, 3), (2, 2, 3, 2, 2), {"stride": 3, "padding": 2,
                                                                  "output_padding": (2, 1, 0), "dilation": 2}),
    "size-one-dims": ((1, 1, 1, 1, 1), (1, 2, 1, 2, 1), {"bias": True, "stride": 2, "output_padding": 1}),
    "unbatched": ((2, 3, 2, 2), (2, 3, 2, 2, 2), {"stride": (1, 2, 1)}),
    "empty-batch": ((0, 2, 2, 2, 2), (2, 3, 2, 2, 2), {}),
    "everything": pytest.param(((2, 6, 4, 3, 5), (6, 2, 3, 2, 3), {"stride": (2, 3, 1), "padding": (1, 0, 2),
                                                                    "output_padding": (1, 2, 0),
                                                                    "dilation": (1, 2, 2), "groups": 3,
                                                                    "bias": True}),
                               marks=pytest.mark.slow),
}


def _conv_transpose3d_inputs(rng, case, dtype):
    return _convolution_inputs(rng, case, dtype, lambda ws, kwargs: ws[1] * kwargs.get("groups", 1))


@pytest.mark.parametrize("case", CONV_TRANSPOSE3D_CASES.values(), ids=CONV_TRANSPOSE3D_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_conv_transpose3d_and_its_gradients_match_torch(dtype, case, rng):
    check_against_torch(_convolution("conv_transpose3d", case[2]),
                        *_conv_transpose3d_inputs(rng, case, dtype))


def test_float16_conv_transpose3d_matches_torch_within_float16_tolerance(rng):
    case = CONV_TRANSPOSE3D_CASES["stride-padding-output-padding"]
    check_against_torch(_convolution("conv_transpose3d", case[2]),
                        *_conv_transpose3d_inputs(rng, case, "float16"))


@pytest.mark.slow
def test_conv_transpose3d_gradient_matches_finite_differences(rng):
    case = CONV_TRANSPOSE3D_CASES["dilation-groups"]
    check_finite_differences(_convolution("conv_transpose3d", case[2]),
                             *_conv_transpose3d_inputs(rng, case, "float64"))


@pytest.mark.parametrize("x, w, kwargs", [
    ((1, 3, 2, 2, 2), (2, 2, 3, 3, 3), {}),  # channels
    ((1, 3, 2, 2, 2), (3, 2, 2, 2, 2), {"groups": 2}),  # in channels not divisible by groups
    ((1, 2, 2, 2, 2), (2, 1, 2, 2, 2), {"stride": 2, "output_padding": 2}),  # output_padding not below the stride
    ((1, 2, 1, 1, 1), (2, 1, 1, 1, 1), {"padding": 1}),  # nothing left of the output
    ((1, 2, 5, 5), (2, 1, 3, 3), {}),  # a 2-d weight
], ids=["channels", "groups", "output-padding", "empty-output", "weight-rank"])
def test_conv_transpose3d_misuse_raises_like_torch(x, w, kwargs):
    with pytest.raises((RuntimeError, ValueError)):
        torch.nn.functional.conv_transpose3d(torch.ones(x), torch.ones(w), **kwargs)
    with pytest.raises((ember.ShapeError, ValueError)):
        ember.conv_transpose3d(ember.ones(x), ember.ones(w), **kwargs)


def test_conv_transpose3d_module_matches_torch_with_its_parameters_gradients(rng, device):
    if device == "cuda":
        pytest.skip("the module calls the functional form, whose kernels are tested above")
    torch.manual_seed(0)
    t_conv = torch.nn.ConvTranspose3d(4, 6, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1), output_padding=(1, 0, 1),
                                      groups=2, dilation=(1, 2, 1))
    e_conv = nn.ConvTranspose3d(4, 6, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1), output_padding=(1, 0, 1),
                                groups=2, dilation=(1, 2, 1))
    check_layer_against_torch(e_conv, t_conv, *arrays(rng, "float32", (2, 4, 3, 4, 3)))
    with pytest.raises(ValueError, match="padding_mode"):
        nn.ConvTranspose3d(2, 2, 3, padding_mode="reflect")


@pytest.mark.parametrize("kind, shape, asked", [
    ("ConvTranspose3d", (1, 2, 2, 3, 2), (4, 5, 4)),
    ("ConvTranspose3d", (2, 3, 2, 2), (2, 6, 3, 4)),  # unbatched, the whole shape asked
    ("ConvTranspose2d", (1, 2, 3, 2), (1, 2, 6, 3)),
], ids=["3d", "3d-unbatched-whole-shape", "2d-whole-shape"])
def test_transposed_convolution_modules_give_the_output_size_asked_as_torch(kind, shape, asked):
    torch.manual_seed(0)
    channels = shape[-4] if kind == "ConvTranspose3d" else shape[-3]
    t_conv = getattr(torch.nn, kind)(channels, 2, 3, stride=2, padding=1)
    e_conv = getattr(nn, kind)(channels, 2, 3, stride=2, padding=1)
    e_conv.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in t_conv.state_dict().items()})
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    expected = t_conv(torch.tensor(x), output_size=asked)
    got = e_conv(ember.tensor(x), output_size=asked)
    assert tuple(got.shape) == tuple(expected.shape)
    np.testing.assert_allclose(got.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    too_large = tuple(n + 2 for n in asked)
    with pytest.raises(ValueError, match="requested an output size of"):
        t_conv(torch.tensor(x), output_size=too_large)
    with pytest.raises(ValueError, match="requested an output size of"):
        e_conv(ember.tensor(x), output_size=too_large)


# -- pooling --------------------------------------------------------------------------------------

MAX_POOLS_3D = {
    "stride-padding": pytest.param((2, 2, 5, 6, 5), dict(kernel_size=3, stride=2, padding=1), marks=pytest.mark.slow),
    "padding": ((1, 1, 3, 4, 4), dict(kernel_size=(1, 2, 3), stride=2, padding=(0, 1, 1))),
    "dilation": ((1, 2, 5, 6, 7), dict(kernel_size=(2, 2, 3), stride=1, dilation=(2, 1, 2))),
    "ceil-mode": pytest.param((1, 1, 5, 5, 6), dict(kernel_size=2, stride=2, ceil_mode=True), marks=pytest.mark.slow),
    "unbatched": pytest.param((2, 4, 4, 4), dict(kernel_size=2), marks=pytest.mark.slow),
    "size-one": ((1, 1, 1, 1, 1), dict(kernel_size=1)),
}


@pytest.mark.parametrize("shape, kwargs", MAX_POOLS_3D.values(), ids=list(MAX_POOLS_3D))
def test_max_pool3d_values_indices_and_gradients_match_torch_with_ties_going_to_the_first_maximum(shape, kwargs):
    x = ties(3, shape)
    check_against_torch(lambda m, x: m.nn.functional.max_pool3d(x, return_indices=True, **kwargs), x)


AVG_POOLS_3D = {
    "basic": ((2, 2, 4, 6, 4), dict(kernel_size=2)),
    "padding-counted": pytest.param((1, 2, 5, 5, 6), dict(kernel_size=3, stride=2, padding=1),
                                    marks=pytest.mark.slow),
    "padding-not-counted-ceil": ((1, 1, 3, 4, 5), dict(kernel_size=(2, 2, 3), stride=2, padding=(1, 1, 0),
                                                       ceil_mode=True, count_include_pad=False)),
    "divisor": ((1, 2, 4, 4, 4), dict(kernel_size=2, divisor_override=3)),
    "unbatched": ((2, 3, 4, 5), dict(kernel_size=(1, 2, 2), stride=1)),
}


@pytest.mark.parametrize("shape, kwargs", AVG_POOLS_3D.values(), ids=list(AVG_POOLS_3D))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_avg_pool3d_and_its_gradients_match_torch(dtype, shape, kwargs, rng):
    check_against_torch(lambda m, x: m.nn.functional.avg_pool3d(x, **kwargs), *arrays(rng, dtype, shape))


ADAPTIVE_3D = {
    "uneven-bins": ((2, 2, 5, 7, 6), (3, 4, 2)),
    "global": ((1, 3, 4, 3, 5), 1),
    "kept-axis": ((1, 1, 4, 6, 3), (2, None, 3)),
    "unbatched": pytest.param((2, 3, 4, 5), (2, 2, 3), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("shape, size", ADAPTIVE_3D.values(), ids=list(ADAPTIVE_3D))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_adaptive_avg_pool3d_and_its_gradients_match_torch(dtype, shape, size, rng):
    check_against_torch(lambda m, x: m.nn.functional.adaptive_avg_pool3d(x, size), *arrays(rng, dtype, shape))


ADAPTIVE_MAX_3D = {  # each output's bin is one window per offset: small bins, few windows
    "uneven-bins": ((1, 2, 3, 5, 4), (2, 3, 2)),
    "global": ((1, 2, 2, 3, 2), 1),
    "kept-axis": ((1, 1, 4, 2, 3), (2, None, 3)),
    "unbatched": ((2, 3, 4, 2), (2, 2, 1)),
}


@pytest.mark.parametrize("shape, size", ADAPTIVE_MAX_3D.values(), ids=ADAPTIVE_MAX_3D)
def test_adaptive_max_pool3d_indices_and_gradients_match_torch(shape, size):
    check_against_torch(lambda m, x: m.nn.functional.adaptive_max_pool3d(x, size, return_indices=True),
                        ties(5, shape))


def test_pooling_modules_over_volumes_match_torch(rng, device):
    if device == "cuda":
        pytest.skip("the module calls the functional form, whose kernels are tested above")
    (x,) = arrays(rng, "float32", (2, 3, 6, 5, 6))
    pairs = [(nn.MaxPool3d(2, return_indices=True), torch.nn.MaxPool3d(2, return_indices=True)),
             (nn.AvgPool3d(3, 2, 1, count_include_pad=False), torch.nn.AvgPool3d(3, 2, 1, count_include_pad=False)),
             (nn.AdaptiveAvgPool3d((2, 1, 3)), torch.nn.AdaptiveAvgPool3d((2, 1, 3))),
             (nn.AdaptiveMaxPool3d(2), torch.nn.AdaptiveMaxPool3d(2))]
    for mine, theirs in pairs:
        got, expected = mine(ember.tensor(x)), theirs(torch.tensor(x))
        for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple)
                        else (expected,)):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-6, err_msg=repr(mine))


def test_3d_pooling_refuses_what_torch_refuses():
    with pytest.raises(ember.ShapeError, match="max_pool3d: expects input"):
        ember.max_pool3d(ember.zeros((2, 3, 4)), 2)
    with pytest.raises(ValueError, match="at most half"):
        ember.avg_pool3d(ember.zeros((1, 1, 4, 4, 4)), 2, padding=2)
    with pytest.raises(ValueError, match="triple"):
        ember.adaptive_avg_pool3d(ember.zeros((1, 1, 4, 4, 4)), (2, 2))
    with pytest.raises(ember.ShapeError, match="too small"):
        ember.max_pool3d(ember.zeros((1, 1, 1, 4, 4)), 2)


# -- interpolate over rows and volumes ------------------------------------------------------------

RESAMPLES = {
    "nearest-up": ((1, 2, 3, 4, 3), dict(scale_factor=2, mode="nearest")),
    "nearest-down": ((1, 2, 5, 6, 7), dict(size=(3, 4, 2), mode="nearest")),
    "nearest-exact": ((2, 1, 3, 5, 4), dict(size=(4, 3, 7), mode="nearest-exact")),
    "trilinear": ((1, 2, 3, 4, 5), dict(size=(5, 3, 7), mode="trilinear")),
    "trilinear-corners": ((2, 1, 4, 3, 3), dict(scale_factor=(2, 1.5, 2), mode="trilinear", align_corners=True)),
    "trilinear-size-one": ((1, 1, 1, 3, 2), dict(size=(2, 1, 4), mode="trilinear", align_corners=False)),
    "area": ((1, 2, 6, 5, 4), dict(size=(3, 2, 4), mode="area")),
    "linear": ((2, 3, 5), dict(size=8, mode="linear")),
    "linear-corners": ((1, 2, 6), dict(scale_factor=0.5, mode="linear", align_corners=True)),
    "nearest-1d": ((1, 2, 5), dict(size=7, mode="nearest")),
}


@pytest.mark.parametrize("shape, kwargs", RESAMPLES.values(), ids=RESAMPLES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_interpolate_over_rows_and_volumes_matches_torch_with_gradients(dtype, shape, kwargs, rng):
    check_against_torch(lambda m, x: m.nn.functional.interpolate(x, **kwargs), *arrays(rng, dtype, shape))


def test_upsample_module_resamples_volumes_as_torch(rng, device):
    if device == "cuda":
        pytest.skip("the module calls the functional form, whose kernels are tested above")
    (x,) = arrays(rng, "float32", (1, 2, 3, 3, 4))
    for kwargs in (dict(scale_factor=2, mode="trilinear"), dict(size=(4, 5, 6), mode="nearest")):
        np.testing.assert_allclose(nn.Upsample(**kwargs)(ember.tensor(x)).numpy(),
                                   torch.nn.Upsample(**kwargs)(torch.tensor(x)).numpy(), rtol=1e-6, atol=1e-6)


def test_interpolate_refuses_a_mode_for_another_rank_as_torch():
    for shape, mode in (((1, 1, 2, 2, 2), "bilinear"), ((1, 1, 2, 2), "trilinear"), ((1, 1, 2), "bicubic"),
                        ((1, 1, 2, 2, 2), "linear")):
        with pytest.raises(NotImplementedError):
            torch.nn.functional.interpolate(torch.zeros(shape), size=shape[2:], mode=mode)
        with pytest.raises(NotImplementedError, match=f"mode '{mode}'"):
            ember.nn.functional.interpolate(ember.zeros(shape), size=shape[2:], mode=mode)


# -- normalisation over volumes --------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["BatchNorm3d", "InstanceNorm3d"])
def test_3d_normalisation_layers_train_and_evaluate_as_torch(cls, rng):
    (x,) = arrays(rng, "float64", (3, 4, 3, 2, 5))
    t_norm = getattr(torch.nn, cls)(4, affine=True, track_running_stats=True).double()
    e_norm = getattr(nn, cls)(4, affine=True, track_running_stats=True, dtype=ember.float64)
    for train in (True, False):
        t_norm.train(train)
        e_norm.train(train)
        tx, ex = torch.tensor(x, requires_grad=True), ember.tensor(x, requires_grad=True)
        t_out, e_out = t_norm(tx), e_norm(ex)
        np.testing.assert_allclose(e_out.numpy(), t_out.detach().numpy(), rtol=1e-10, atol=1e-10)
        (t_out * t_out).sum().backward()
        (e_out * e_out).sum().backward()
        np.testing.assert_allclose(ex.grad.numpy(), tx.grad.numpy(), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(e_norm.running_var.numpy(), t_norm.running_var.numpy(), rtol=1e-10)
    with pytest.raises(ember.ShapeError, match="5-d"):
        nn.BatchNorm3d(4)(ember.zeros((2, 4, 3, 3)))


# -- from_torch -----------------------------------------------------------------------------------

class Volumes(torch.nn.Module):
    """A small 3-d segmentation-style network: down through Conv3d, BatchNorm3d and MaxPool3d, back up by trilinear
    upsampling and by a ConvTranspose3d, a skip connection, then pooled features classified."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.BatchNorm3d(4),
                                        torch.nn.ReLU())
        self.pool = torch.nn.MaxPool3d(2)
        self.mid = torch.nn.Conv3d(4, 4, (1, 3, 3), padding="same", padding_mode="replicate", groups=2)
        self.up = torch.nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
        self.unpool = torch.nn.ConvTranspose3d(4, 4, 2, stride=2, groups=2)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        skip = self.down(x)
        low = torch.nn.functional.relu(self.mid(self.pool(skip)))
        h = self.up(low) + self.unpool(low, output_size=skip.shape) + skip
        return self.head(torch.nn.functional.adaptive_avg_pool3d(h, 1).flatten(1))


def torch_step(model, x, y) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def close_states(mine: dict, model) -> None:
    assert list(mine) == list(model.state_dict())
    for k, v in model.state_dict().items():
        np.testing.assert_allclose(np.asarray(mine[k]), v.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("via", ["fx", "export"])
def test_a_3d_network_imports_and_matches_torchs_forward_and_training_step(via, device):
    if device == "cuda":
        pytest.skip("the reference backend covers the import; the layers' kernels are tested above")
    torch.manual_seed(0)
    model = Volumes()
    em = ember.from_torch(copy.deepcopy(model), via=via)
    x, y = torch.randn(2, 2, 4, 6, 4), torch.tensor([0, 2])
    expected = torch_step(model, x, y)
    e_opt = ember.optim.SGD(em.parameters(), lr=0.1)
    e_loss = ember.nn.functional.cross_entropy(em(ember.tensor(x.numpy())), ember.tensor(y.numpy()))
    e_opt.zero_grad()
    e_loss.backward()
    e_opt.step()
    assert e_loss.item() == pytest.approx(expected, rel=1e-5)
    close_states({k: v.numpy() for k, v in em.state_dict().items()}, model)
    model.eval()
    em.eval()
    with torch.no_grad():
        np.testing.assert_allclose(em(ember.tensor(x.numpy())).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)


def test_torch_compile_with_embers_backend_trains_the_3d_network_as_torch(device):
    """The ATen forward and backward graphs of every 3-d layer (the convolution's and pooling's backward operators,
    the replicate padding's, the upsampling's decomposed into an accumulating index_put)."""
    if device == "cuda":
        pytest.skip("the reference backend runs the compiled graphs; the layers' kernels are tested above")
    import ember.frontends.dynamo  # noqa: F401  (registers the backend where the entry point is not installed)

    torch.manual_seed(0)
    model = Volumes()
    twin = copy.deepcopy(model)
    x, y = torch.randn(2, 2, 4, 6, 4), torch.tensor([0, 2])
    expected = torch_step(model, x, y)
    assert torch_step(torch.compile(twin, backend="ember"), x, y) == pytest.approx(expected, rel=1e-5)
    close_states({k: v.detach().numpy() for k, v in twin.state_dict().items()}, model)
