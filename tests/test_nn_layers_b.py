"""GroupNorm, InstanceNorm, 1-d convolution and pooling, adaptive max pooling and interpolate against torch:
values, gradients, running statistics, state_dict layout and argument errors."""

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember import nn
from ember.errors import ShapeError
from tests.conftest import check_against_torch

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("device")


def arrays(seed, *shapes, dtype=np.float32):
    """Random inputs away from zero's special cases: uniform in [-2, 2]."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-2, 2, shape).astype(dtype) for shape in shapes]


def same_state_layout(e_module, t_module):
    e_state, t_state = e_module.state_dict(), t_module.state_dict()
    assert [(k, tuple(v.shape)) for k, v in e_state.items()] == [(k, tuple(v.shape)) for k, v in t_state.items()]


def copy_state(t_module, e_module):
    e_module.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in t_module.state_dict().items()})


# -- group and instance normalisation -----------------------------------------------------

@pytest.mark.parametrize("shape,groups,affine", [
    ((2, 6, 3, 5), 3, True),
    ((3, 4, 7), 4, True),
    ((1, 6, 1, 1), 2, False),
    ((2, 5), 1, True),
])
def test_group_norm_and_its_gradients_match_torch(shape, groups, affine):
    x, w, b = arrays(0, shape, shape[1:2], shape[1:2])
    inputs = (x, w, b) if affine else (x,)
    check_against_torch(lambda m, x, *wb: m.nn.functional.group_norm(x, groups, *wb, eps=1e-4), *inputs)


def test_bfloat16_group_norm_matches_torch_within_bfloat16_tolerance():
    x, w, b = arrays(1, (2, 4, 3, 3), (4,), (4,))
    check_against_torch(lambda m, x, w, b: m.nn.functional.group_norm(x, 2, w, b),
                        x.astype(ember.bfloat16.np), w.astype(ember.bfloat16.np), b.astype(ember.bfloat16.np),
                        rtol=2e-2, atol=2e-2, grad_rtol=5e-2, grad_atol=5e-2)


def test_group_norm_module_has_torchs_state_and_output():
    torch.manual_seed(0)
    t_module, e_module = torch.nn.GroupNorm(2, 6), nn.GroupNorm(2, 6)
    same_state_layout(e_module, t_module)
    same_state_layout(nn.GroupNorm(3, 6, affine=False), torch.nn.GroupNorm(3, 6, affine=False))
    same_state_layout(nn.GroupNorm(3, 6, bias=False), torch.nn.GroupNorm(3, 6, bias=False))
    (x,) = arrays(2, (2, 6, 4))
    np.testing.assert_allclose(e_module(ember.tensor(x)).numpy(), t_module(torch.tensor(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_group_norm_rejects_channels_not_divisible_by_groups_and_single_values():
    with pytest.raises(ValueError, match="divisible"):
        nn.GroupNorm(4, 6)
    with pytest.raises(ShapeError, match="divisible"):
        F.group_norm(ember.ones((2, 6, 3)), 4)
    with pytest.raises(ShapeError, match=r"shape \(6,\)"):
        F.group_norm(ember.ones((2, 6, 3)), 3, weight=ember.ones(4))
    with pytest.raises(ValueError, match="more than 1 value"):
        F.group_norm(ember.ones((1, 2, 1)), 2)


@pytest.mark.parametrize("shape,affine", [((2, 3, 4, 5), True), ((3, 2, 7), False), ((1, 1, 2, 1), True)])
def test_instance_norm_and_its_gradients_match_torch(shape, affine):
    x, w, b = arrays(3, shape, shape[1:2], shape[1:2])
    inputs = (x, w, b) if affine else (x,)

    def norm(m, x, *wb):
        return m.nn.functional.instance_norm(x, None, None, *wb, eps=1e-4)
    check_against_torch(norm, *inputs)


def test_instance_norm_2d_tracks_running_stats_in_training_and_uses_them_in_eval_as_torch():
    torch.manual_seed(0)
    t_module = torch.nn.InstanceNorm2d(3, momentum=0.2, affine=True, track_running_stats=True)
    e_module = nn.InstanceNorm2d(3, momentum=0.2, affine=True, track_running_stats=True)
    same_state_layout(e_module, t_module)
    copy_state(t_module, e_module)
    for seed in (4, 5):
        (x,) = arrays(seed, (2, 3, 4, 5))
        np.testing.assert_allclose(e_module(ember.tensor(x)).numpy(), t_module(torch.tensor(x)).detach().numpy(),
                                   rtol=1e-5, atol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        np.testing.assert_allclose(e_module.state_dict()[name].numpy(), t_module.state_dict()[name].numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    e_module.eval()
    t_module.eval()
    (x,) = arrays(6, (3, 4, 5))  # unbatched
    np.testing.assert_allclose(e_module(ember.tensor(x)).numpy(), t_module(torch.tensor(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-5)


def test_instance_norm_without_running_stats_has_torchs_empty_state_and_normalises_in_eval_too():
    t_module, e_module = torch.nn.InstanceNorm1d(3), nn.InstanceNorm1d(3)
    same_state_layout(e_module, t_module)
    e_module.eval()
    t_module.eval()
    (x,) = arrays(7, (2, 3, 6))
    np.testing.assert_allclose(e_module(ember.tensor(x)).numpy(), t_module(torch.tensor(x)).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_instance_norm_rejects_a_single_spatial_element_and_wrong_dims():
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        F.instance_norm(ember.ones((2, 3, 1, 1)))
    with pytest.raises(ShapeError, match="3-d or 4-d"):
        nn.InstanceNorm2d(3)(ember.ones((2, 3)))
    with pytest.raises(ShapeError, match="num_features"):
        nn.InstanceNorm2d(4, affine=True)(ember.ones((2, 3, 2, 2)))


# -- 1-d convolution and pooling ------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("shape,weight,kwargs", [
    ((2, 4, 11), (6, 2, 3), dict(stride=2, padding=1, dilation=2, groups=2)),
    ((1, 3, 5), (2, 3, 1), dict()),
    ((3, 9), (4, 3, 4), dict(padding="same")),
    ((2, 2, 7), (2, 1, 3), dict(padding="valid", groups=2)),
])
def test_conv1d_and_its_gradients_match_torch(shape, weight, kwargs):
    x, w, b = arrays(8, shape, weight, weight[:1])
    check_against_torch(lambda m, x, w, b: m.nn.functional.conv1d(x, w, b, **kwargs), x, w, b, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("make", [
    lambda m: m.Conv1d(4, 6, 3, stride=2, padding=1, groups=2),
    lambda m: m.Conv1d(3, 2, 4, padding="same", bias=False),
    lambda m: m.Conv1d(2, 3, 3, padding=2, padding_mode="reflect"),
])
def test_conv1d_module_has_torchs_weight_layout_and_output(make):
    torch.manual_seed(0)
    t_module, e_module = make(torch.nn), make(nn)
    same_state_layout(e_module, t_module)
    assert e_module.weight.shape == tuple(t_module.weight.shape)  # (out, in / groups, k)
    copy_state(t_module, e_module)
    (x,) = arrays(9, (2, t_module.in_channels, 8))
    np.testing.assert_allclose(e_module(ember.tensor(x)).numpy(), t_module(torch.tensor(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-5)


def test_conv1d_rejects_same_padding_with_a_stride_and_mismatched_channels():
    with pytest.raises(ValueError, match="strided"):
        nn.Conv1d(2, 2, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="strided"):
        F.conv1d(ember.ones((1, 2, 5)), ember.ones((2, 2, 3)), stride=2, padding="same")
    with pytest.raises(ShapeError):
        F.conv1d(ember.ones((1, 3, 5)), ember.ones((2, 2, 3)))
    with pytest.raises(ShapeError, match=r"\(N, C, L\)"):
        F.conv1d(ember.ones((1, 1, 2, 5)), ember.ones((2, 1, 3)))


@pytest.mark.parametrize("shape,weight,kwargs", [
    ((2, 4, 5), (4, 3, 3), dict(stride=2, padding=1, output_padding=1, dilation=2, groups=2)),
    ((1, 3, 1), (3, 2, 1), dict()),
    ((3, 4), (3, 2, 4), dict(stride=3, output_padding=2)),
])
def test_conv_transpose1d_and_its_gradients_match_torch(shape, weight, kwargs):
    x, w, b = arrays(10, shape, weight, (weight[1] * kwargs.get("groups", 1),))
    check_against_torch(lambda m, x, w, b: m.nn.functional.conv_transpose1d(x, w, b, **kwargs), x, w, b, rtol=1e-5,
                        atol=1e-5)


@pytest.mark.parametrize("via", ["fx", "export"])
def test_conv_transpose1d_module_imports_from_torch_and_gives_the_output_size_asked(via, device):
    if device == "cuda":
        pytest.skip("the import runs on the reference backend; the functional form's kernels are tested above")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3, stride=2), torch.nn.ConvTranspose1d(4, 3, 3, stride=2))
    em = ember.from_torch(model, via=via)
    assert via == "export" or isinstance(em[1], nn.ConvTranspose1d)
    (x,) = arrays(11, (2, 2, 9))
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), model(torch.tensor(x)).detach().numpy(), rtol=1e-5,
                               atol=1e-5)
    e_up, t_up = nn.ConvTranspose1d(4, 3, 3, stride=2), model[1]
    copy_state(t_up, e_up)
    (h,) = arrays(12, (2, 4, 4))
    np.testing.assert_allclose(e_up(ember.tensor(h), output_size=[10]).numpy(),
                               t_up(torch.tensor(h), output_size=[10]).detach().numpy(), rtol=1e-5, atol=1e-5)


POOLS_1D = {
    "max_pool1d": lambda m, x: m.nn.functional.max_pool1d(x, 3, 2, 1),
    "max_pool1d_dilated_ceil": lambda m, x: m.nn.functional.max_pool1d(x, 2, 2, dilation=2, ceil_mode=True),
    "avg_pool1d": lambda m, x: m.nn.functional.avg_pool1d(x, 3, 2, 1),
    "avg_pool1d_exclude_pad_ceil": lambda m, x: m.nn.functional.avg_pool1d(x, 3, 2, 1, ceil_mode=True,
                                                                          count_include_pad=False),
    "adaptive_avg_pool1d_overlapping_bins": lambda m, x: m.nn.functional.adaptive_avg_pool1d(x, 4),
    "adaptive_avg_pool1d_to_1": lambda m, x: m.nn.functional.adaptive_avg_pool1d(x, 1),
    "adaptive_max_pool1d": lambda m, x: m.nn.functional.adaptive_max_pool1d(x, 3),
}


@pytest.mark.parametrize("name", list(POOLS_1D))
def test_1d_pooling_and_its_gradients_match_torch(name):
    (x,) = arrays(10, (2, 3, 9))
    check_against_torch(POOLS_1D[name], x)


@pytest.mark.parametrize("shape,size", [((2, 3, 7, 5), (3, 2)), ((1, 2, 6, 6), 4), ((4, 5, 3), (None, 2)),
                                        ((1, 1, 5, 1), (2, 1))])
def test_adaptive_max_pool2d_matches_torch_with_torchs_bins(shape, size):
    (x,) = arrays(11, shape)
    check_against_torch(lambda m, x: m.nn.functional.adaptive_max_pool2d(x, size), x)


def test_pooling_modules_match_torch():
    (x,) = arrays(12, (2, 3, 10))
    (y,) = arrays(13, (2, 3, 7, 6))
    for make, inp in [(lambda m: m.MaxPool1d(3, 2, 1), x), (lambda m: m.AvgPool1d(4, 3), x),
                      (lambda m: m.AdaptiveAvgPool1d(3), x), (lambda m: m.AdaptiveMaxPool2d((2, 4)), y)]:
        np.testing.assert_allclose(make(nn)(ember.tensor(inp)).numpy(), make(torch.nn)(torch.tensor(inp)).numpy(),
                                   rtol=1e-6, atol=1e-6)


# -- interpolate ------------------------------------------------------------------------------

RESAMPLINGS = [
    ("nearest", None, dict(scale_factor=2)),
    ("nearest", None, dict(size=(7, 4))),
    ("nearest", None, dict(scale_factor=(1.5, 0.5))),
    ("nearest-exact", None, dict(size=(7, 3))),
    ("bilinear", False, dict(scale_factor=2)),
    ("bilinear", True, dict(size=(7, 9))),
    ("bilinear", False, dict(scale_factor=(0.6, 1.7))),
    ("bilinear", True, dict(size=(1, 3))),
    ("bilinear", False, dict(scale_factor=2.5, recompute_scale_factor=True)),
    ("bicubic", False, dict(size=(8, 3))),
    ("bicubic", True, dict(scale_factor=(1.5, 2))),
    ("area", None, dict(size=(2, 3))),
]


@pytest.mark.parametrize("mode,align_corners,kwargs", RESAMPLINGS)
def test_interpolate_and_its_gradients_match_torch(mode, align_corners, kwargs):
    (x,) = arrays(14, (2, 2, 5, 6))
    check_against_torch(lambda m, x: m.nn.functional.interpolate(x, mode=mode, align_corners=align_corners, **kwargs),
                        x)


def test_interpolate_of_a_size_1_image_matches_torch():
    (x,) = arrays(15, (1, 3, 1, 4))
    check_against_torch(lambda m, x: m.nn.functional.interpolate(x, size=(3, 5), mode="bicubic"), x)


def test_upsample_modules_match_torch():
    (x,) = arrays(16, (1, 2, 3, 4))
    for make in (lambda m: m.Upsample(scale_factor=3), lambda m: m.Upsample(size=(5, 7), mode="bilinear"),
                 lambda m: m.UpsamplingBilinear2d(scale_factor=2), lambda m: m.UpsamplingNearest2d(size=5)):
        np.testing.assert_allclose(make(nn)(ember.tensor(x)).numpy(), make(torch.nn)(torch.tensor(x)).numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert repr(nn.Upsample(scale_factor=2)) == repr(torch.nn.Upsample(scale_factor=2))


def test_interpolate_rejects_what_torch_rejects():
    x = ember.ones((1, 1, 4, 4))
    with pytest.raises(ValueError, match="only one of size or scale_factor"):
        F.interpolate(x, size=2, scale_factor=2)
    with pytest.raises(ValueError, match="either size or scale_factor"):
        F.interpolate(x)
    with pytest.raises(ValueError, match="align_corners"):
        F.interpolate(x, scale_factor=2, mode="nearest", align_corners=True)
    with pytest.raises(ValueError, match="one size per spatial dim"):
        F.interpolate(x, size=(2, 2, 2))
    with pytest.raises(NotImplementedError):
        F.interpolate(x, scale_factor=2, mode="cubic")
