"""Activations (hardswish, hardsigmoid, prelu, glu and the modules of the existing ones), losses and distances
(kl_div, huber_loss, cosine_similarity, normalize) and small layers (padding, unflatten, channel dropout, pixel
shuffles, parameter containers) against torch: values, gradients, state_dict keys and argument errors."""

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import HALVES, check_against_torch, random_array

import ember
import ember.nn.functional as F
from ember import nn

TF = torch.nn.functional

pytestmark = pytest.mark.usefixtures("device")


def functional(m):
    """ember.nn.functional or torch.nn.functional, for the library `m` a check runs under."""
    return F if m is ember else TF


def nn_of(m):
    return nn if m is ember else torch.nn


# -- activations -----------------------------------------------------------------------------------

ACTIVATIONS = {
    "hardswish": lambda m, x: functional(m).hardswish(x),
    "hardsigmoid": lambda m, x: functional(m).hardsigmoid(x),
    "relu6": lambda m, x: functional(m).relu6(x),
    "elu": lambda m, x: functional(m).elu(x, alpha=0.7),
    "hardtanh": lambda m, x: functional(m).hardtanh(x, -2.0, 1.5),
    "mish": lambda m, x: functional(m).mish(x),
    "glu": lambda m, x: functional(m).glu(x, dim=-1),
}


@pytest.mark.parametrize("shape", [(4, 6), (0, 4), (1, 2), (2, 0)])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_values_and_gradients_match_torch(name, shape, rng):
    x = random_array(rng, shape, "float32", -5.0, 7.0, avoid=0.0)
    check_against_torch(ACTIVATIONS[name], x)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name", ["hardswish", "hardsigmoid", "glu", "elu"])
def test_activation_in_half_precision_matches_torch(name, dtype, rng):
    x = random_array(rng, (3, 8), dtype, -5.0, 5.0, avoid=0.0)
    check_against_torch(ACTIVATIONS[name], x)


KINKS = np.array([-3.0, 3.0, 0.0, 6.0, -1.0, 1.0, -2.0, 1.5, -3.5, 3.5, 6.5, -0.25], np.float64)


@pytest.mark.parametrize("name", ["hardswish", "hardsigmoid", "relu6", "elu", "hardtanh"])
def test_gradients_at_the_kinks_follow_torch(name):
    """hardswish's gradient is 0 at -3 and 1 at 3, hardsigmoid's 0 at both, the clamps' 0 at their bounds."""
    # (torch's hardsigmoid scales its float64 gradient by a float32 1/6)
    check_against_torch(ACTIVATIONS[name], KINKS, grad_rtol=1e-7 if name == "hardsigmoid" else None)


@pytest.mark.parametrize("dim", [1, -3, 2])
def test_glu_halves_any_even_dim_as_torch(dim, rng):
    check_against_torch(lambda m, x: functional(m).glu(x, dim), random_array(rng, (2, 4, 6), "float32"))


def test_hardswish_gradient_at_its_kinks_is_torchs_convention():
    x = ember.tensor(np.array([-3.0, 3.0, 0.0]), requires_grad=True)
    (g,) = ember.grad(F.hardswish(x).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), [0.0, 1.0, 0.5])


@pytest.mark.parametrize("case", ["per_channel", "shared", "shared_0d", "one_d_input", "three_d", "zero_point"])
def test_prelu_matches_torch_for_input_and_weight(case, rng):
    shapes = {"per_channel": ((2, 3, 4, 2), (3,)), "shared": ((2, 3, 4), (1,)), "shared_0d": ((4, 5), ()),
              "one_d_input": ((5,), (1,)), "three_d": ((2, 4, 3), (4,)), "zero_point": ((2, 3), (3,))}
    x_shape, w_shape = shapes[case]
    x = random_array(rng, x_shape, "float32", avoid=0.0)
    if case == "zero_point":
        x[0, :] = 0.0  # the negative side's gradient at 0
    w = random_array(rng, w_shape, "float32", 0.05, 0.5)
    check_against_torch(lambda m, x, w: functional(m).prelu(x, w), x, w)
    if case != "zero_point":
        check_against_torch(lambda m, x, w: m.prelu(x, w), x, w)


@pytest.mark.parametrize("dtype", HALVES)
def test_prelu_in_half_precision_matches_torch(dtype, rng):
    check_against_torch(lambda m, x, w: functional(m).prelu(x, w), random_array(rng, (2, 3, 4), dtype, avoid=0.0),
                        random_array(rng, (3,), dtype, 0.1, 0.4))


@pytest.mark.parametrize("weight_shape", [(2,), (1, 3), (4,)])
def test_prelu_refuses_a_weight_that_fits_neither_one_slope_nor_the_channels(weight_shape):
    with pytest.raises(ember.ShapeError):
        F.prelu(ember.ones((2, 3)), ember.ones(weight_shape))
    with pytest.raises(RuntimeError):
        TF.prelu(torch.ones(2, 3), torch.ones(weight_shape))


@pytest.mark.parametrize("shape, dim", [((3,), -1), ((2, 3), 1), ((2, 4), 2)])
def test_glu_refuses_an_odd_or_missing_dim(shape, dim):
    with pytest.raises((ember.ShapeError, IndexError)):
        F.glu(ember.ones(shape), dim)


def test_glu_refuses_a_0d_tensor():
    with pytest.raises(ember.ShapeError, match="0-d"):
        F.glu(ember.tensor(1.0))


ACTIVATION_MODULES = {
    "ReLU6": lambda m: nn_of(m).ReLU6(),
    "Hardswish": lambda m: nn_of(m).Hardswish(),
    "Hardsigmoid": lambda m: nn_of(m).Hardsigmoid(),
    "Hardtanh": lambda m: nn_of(m).Hardtanh(-0.5, 2.0),
    "Mish": lambda m: nn_of(m).Mish(),
    "ELU": lambda m: nn_of(m).ELU(alpha=0.3),
    "GLU": lambda m: nn_of(m).GLU(dim=1),
    "PReLU": lambda m: nn_of(m).PReLU(),
}


@pytest.mark.parametrize("name", sorted(ACTIVATION_MODULES))
def test_activation_modules_match_torch(name, rng):
    x = random_array(rng, (3, 4, 2), "float32", -4.0, 7.0, avoid=0.0)
    check_against_torch(lambda m, x: ACTIVATION_MODULES[name](m)(x), x)


def test_prelu_module_has_torchs_parameter_and_initial_slope(rng):
    ours, theirs = nn.PReLU(3, init=0.1), torch.nn.PReLU(3, init=0.1)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    np.testing.assert_allclose(ours.weight.numpy(), theirs.weight.detach().numpy())
    x = random_array(rng, (2, 3, 2), "float32", avoid=0.0)
    w = random_array(rng, (3,), "float32", 0.1, 0.3)
    check_against_torch(lambda m, x, w: functional(m).prelu(x, w), x, w)
    with ember.no_grad():
        ours.weight.assign(ember.tensor(w))
    out = ours(ember.tensor(x)).numpy()
    np.testing.assert_allclose(out, np.where(x > 0, x, w.reshape(3, 1) * x), rtol=1e-6)


def test_inplace_activation_modules_write_their_input():
    x = ember.tensor(np.array([-4.0, -1.0, 0.5, 4.0], np.float32))
    out = nn.Hardswish(inplace=True)(x)
    np.testing.assert_allclose(x.numpy(), out.numpy())
    np.testing.assert_allclose(x.numpy(), TF.hardswish(torch.tensor([-4.0, -1.0, 0.5, 4.0])).numpy(), rtol=1e-6)


def test_hardtanh_refuses_bounds_out_of_order():
    with pytest.raises(ValueError):
        nn.Hardtanh(1.0, -1.0)


# -- losses and distances ----------------------------------------------------------------------------

def _quietly(fn):
    """fn with the warnings both libraries give for kl_div's reduction='mean' silenced."""
    def run(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    return run


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["none", "batchmean", "mean", "sum"])
def test_kl_div_matches_torch(reduction, log_target, rng):
    logp = np.log(random_array(rng, (3, 5), "float64", 0.05, 1.0))
    target = random_array(rng, (3, 5), "float64", 0.05, 1.0)
    if log_target:
        target = np.log(target)
    check_against_torch(_quietly(lambda m, x, t: functional(m).kl_div(x, t, reduction=reduction,
                                                                      log_target=log_target)), logp, target)


def test_kl_div_module_and_zero_targets_match_torch(rng):
    """A zero target contributes 0, whatever the input; a 0-d input's 'batchmean' is its sum."""
    logp = np.log(random_array(rng, (4, 3), "float32", 0.05, 1.0))
    target = random_array(rng, (4, 3), "float32", 0.0, 1.0)
    target[1, 2] = 0.0
    check_against_torch(lambda m, x, t: nn_of(m).KLDivLoss(reduction="batchmean")(x, t), logp, target, grad=False)
    check_against_torch(lambda m, x, t: functional(m).kl_div(x, t, reduction="batchmean"),
                        np.array(-0.7, np.float32), np.array(0.4, np.float32))


def test_kl_div_with_mean_warns_as_torch_and_the_other_reductions_do_not():
    logp, target = ember.tensor([[-1.0, -0.5]]), ember.tensor([[0.3, 0.7]])
    with pytest.warns(UserWarning, match="batchmean"):
        F.kl_div(logp, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for reduction in ("batchmean", "sum", "none"):
            F.kl_div(logp, target, reduction=reduction)
            nn.KLDivLoss(reduction=reduction)(logp, target)


def test_kl_div_refuses_an_unknown_reduction():
    with pytest.raises(ValueError, match="batchmean"):
        F.kl_div(ember.ones((2,)), ember.ones((2,)), reduction="average")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("delta", [1.0, 0.3, 2.5])
def test_huber_loss_matches_torch(delta, reduction, rng):
    x, t = random_array(rng, (4, 5), "float32", -3, 3), random_array(rng, (4, 5), "float32", -3, 3)
    x[0, 0], t[0, 0] = t[0, 0] + delta, t[0, 0]  # the kink: |error| == delta
    x[0, 1] = t[0, 1]  # no error
    check_against_torch(lambda m, x, t: functional(m).huber_loss(x, t, reduction=reduction, delta=delta), x, t)
    check_against_torch(lambda m, x, t: nn_of(m).HuberLoss(reduction=reduction, delta=delta)(x, t), x, t)


@pytest.mark.parametrize("dtype", HALVES)
def test_huber_loss_in_half_precision_matches_torch(dtype, rng):
    x, t = random_array(rng, (3, 4), dtype, -3, 3), random_array(rng, (3, 4), dtype, -3, 3)
    check_against_torch(lambda m, x, t: functional(m).huber_loss(x, t, delta=0.5), x, t)


def test_huber_loss_refuses_a_non_positive_delta_and_warns_on_broadcasting():
    with pytest.raises(ValueError, match="delta"):
        F.huber_loss(ember.ones((2,)), ember.ones((2,)), delta=0.0)
    with pytest.raises(ValueError, match="reduction"):
        F.huber_loss(ember.ones((2,)), ember.ones((2,)), reduction="batchmean")
    with pytest.warns(UserWarning, match="broadcast"):
        F.huber_loss(ember.ones((2, 3)), ember.ones((3,)))


@pytest.mark.parametrize("shapes, dim", [(((4, 5), (4, 5)), 1), (((3, 1, 4), (5, 4)), -1), (((2, 3, 4), (2, 3, 4)), 0),
                                         (((1, 3), (1, 3)), 1), (((6,), (6,)), 0)])
def test_cosine_similarity_matches_torch(shapes, dim, rng):
    a, b = (random_array(rng, s, "float64") for s in shapes)
    check_against_torch(lambda m, a, b: functional(m).cosine_similarity(a, b, dim=dim), a, b)
    check_against_torch(lambda m, a, b: nn_of(m).CosineSimilarity(dim=dim)(a, b), a, b)
    if len(shapes[0]) == 2:
        check_against_torch(lambda m, a, b: m.cosine_similarity(a, b, dim), a, b)


def test_cosine_similarity_clamps_each_norm_and_differentiates_through_the_unclamped_one():
    """Vectors shorter than eps: the value uses the clamped norm, the gradient the norm itself; an all-zero
    vector has a finite gradient."""
    a = np.array([[1e-9, 0.0], [1.0, 2.0], [0.0, 0.0]])
    b = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 3.0]])
    check_against_torch(lambda m, a, b: functional(m).cosine_similarity(a, b), a, b, grad_rtol=1e-7)


@pytest.mark.parametrize("dtype", HALVES)
def test_cosine_similarity_in_half_precision_matches_torch(dtype, rng):
    a, b = random_array(rng, (3, 6), dtype), random_array(rng, (3, 6), dtype)
    check_against_torch(lambda m, a, b: functional(m).cosine_similarity(a, b), a, b, rtol=2e-2, atol=2e-2)


def test_cosine_similarity_refuses_integers_and_mismatched_shapes():
    with pytest.raises(ember.DTypeError):
        F.cosine_similarity(ember.ones((2, 3), dtype=ember.int64), ember.ones((2, 3), dtype=ember.int64))
    with pytest.raises(ember.ShapeError):
        F.cosine_similarity(ember.ones((3, 4)), ember.ones((5, 4)))
    with pytest.raises(IndexError):
        F.cosine_similarity(ember.ones((4,)), ember.ones((4,)))


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("shape, dim", [((3, 4), 1), ((2, 3, 2), 0), ((1, 1), 1), ((0, 3), 1)])
def test_normalize_matches_torch(p, shape, dim, rng):
    x = random_array(rng, shape, "float64", avoid=0.0)
    check_against_torch(lambda m, x: functional(m).normalize(x, p=p, dim=dim), x)


def test_normalize_clamps_short_vectors_at_eps():
    x = np.array([[0.0, 0.0, 0.0], [1e-14, -2e-14, 0.0], [1.0, -2.0, 0.5]])
    check_against_torch(lambda m, x: functional(m).normalize(x), x)
    check_against_torch(lambda m, x: functional(m).normalize(x, p=1.0, eps=1e-3), x)


def test_normalize_in_half_precision_matches_torch(rng):
    check_against_torch(lambda m, x: functional(m).normalize(x, dim=-1), random_array(rng, (3, 5), "bfloat16"))


def test_norm_of_a_zero_vector_has_a_zero_gradient_as_torchs():
    check_against_torch(lambda m, x: m.norm(x, 2, 1), np.array([[0.0, 0.0], [3.0, -4.0]]))


def test_norm_of_order_minus_infinity_is_the_smallest_magnitude_as_torchs():
    check_against_torch(lambda m, x: m.norm(x, -math.inf, 1, keepdim=True), np.array([[1.5, -0.5], [3.0, -4.0]]))


# -- small layers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("padding", [2, (1, 0, 2, 3), (1, -1, 0, -2)])
def test_zero_pad2d_matches_torch(padding, rng):
    check_against_torch(lambda m, x: nn_of(m).ZeroPad2d(padding)(x), random_array(rng, (1, 2, 4, 3), "float32"))


def test_zero_pad2d_refuses_padding_of_the_wrong_length():
    with pytest.raises(ValueError):
        nn.ZeroPad2d((1, 2, 3))


@pytest.mark.parametrize("dim, sizes", [(1, (2, 3)), (-1, (3, -1)), (0, (1, 2))])
def test_unflatten_matches_torch(dim, sizes, rng):
    x = random_array(rng, (2, 6) if dim != 0 else (2, 3), "float32")
    check_against_torch(lambda m, x: nn_of(m).Unflatten(dim, sizes)(x), x)


def test_unflatten_refuses_sizes_that_do_not_multiply_up():
    with pytest.raises(ember.ShapeError):
        nn.Unflatten(1, (4, 2))(ember.ones((4, 6)))


@pytest.mark.parametrize("r, shape", [(2, (1, 8, 2, 3)), (3, (9, 1, 2)), (1, (2, 2, 1, 3)), (2, (2, 1, 4, 0, 1))])
def test_pixel_shuffle_matches_torch(r, shape, rng):
    x = random_array(rng, shape, "float32")
    grad = 0 not in shape  # (torch's own backward refuses its gradient's shape for an empty input)
    check_against_torch(lambda m, x: functional(m).pixel_shuffle(x, r), x, grad=grad)
    check_against_torch(lambda m, x: nn_of(m).PixelShuffle(r)(x), x, grad=grad)
    check_against_torch(lambda m, x: m.pixel_shuffle(x, r), x, grad=grad)


@pytest.mark.parametrize("r, shape", [(2, (1, 2, 4, 6)), (3, (1, 3, 3)), (2, (1, 1, 2, 2))])
def test_pixel_unshuffle_matches_torch(r, shape, rng):
    x = random_array(rng, shape, "float32")
    check_against_torch(lambda m, x: functional(m).pixel_unshuffle(x, r), x)
    check_against_torch(lambda m, x: nn_of(m).PixelUnshuffle(r)(x), x)


def test_pixel_unshuffle_of_an_empty_input_has_the_documented_shape():
    """(torch returns an empty input unchanged instead.)"""
    assert F.pixel_unshuffle(ember.ones((0, 1, 2, 4)), 2).shape == (0, 4, 1, 2)


def test_pixel_unshuffle_inverts_pixel_shuffle(rng):
    x = ember.tensor(random_array(rng, (2, 12, 2, 3), "float32"))
    np.testing.assert_array_equal(F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2).numpy(), x.numpy())


def test_pixel_shuffles_refuse_bad_shapes_and_factors():
    with pytest.raises(ember.ShapeError, match="divisible"):
        nn.PixelShuffle(2)(ember.ones((1, 7, 2, 3)))
    with pytest.raises(ember.ShapeError, match="3 dims"):
        F.pixel_shuffle(ember.ones((4, 3)), 2)
    with pytest.raises(ValueError, match="positive"):
        F.pixel_shuffle(ember.ones((1, 4, 2, 2)), 0)
    with pytest.raises(ember.ShapeError, match="divisible"):
        nn.PixelUnshuffle(2)(ember.ones((1, 2, 5, 6)))
    with pytest.raises(ember.ShapeError, match="divisible"):
        F.pixel_unshuffle(ember.ones((1, 2, 4, 5)), 2)


def test_dropout2d_zeroes_whole_channels_and_scales_the_rest():
    x = ember.ones((4, 16, 3, 2))
    out = nn.Dropout2d(0.25)(x).numpy()
    per_channel = out.reshape(4, 16, -1)
    assert np.all((per_channel == 0) | np.isclose(per_channel, 1 / 0.75))
    assert np.all(per_channel.min(-1) == per_channel.max(-1))  # a channel is dropped or kept whole
    dropped = (per_channel[..., 0] == 0).mean()
    assert 0.05 < dropped < 0.5


def test_dropout2d_is_the_identity_in_eval_and_passes_the_kept_channels_gradient():
    layer = nn.Dropout2d(0.5).eval()
    x = ember.tensor(np.arange(1, 25, dtype=np.float32).reshape(1, 2, 3, 4), requires_grad=True)
    np.testing.assert_array_equal(layer(x).numpy(), x.numpy())
    out = F.dropout2d(x, 0.5)
    (g,) = ember.grad(out.sum(), [x])
    np.testing.assert_allclose(g.numpy(), np.where(out.numpy() != 0, 2.0, 0.0).reshape(1, 2, 3, 4))


def test_dropout2d_on_3d_input_drops_channels_of_n_c_l_with_a_warning_as_torch():
    with pytest.warns(UserWarning, match="3-d"):
        out = F.dropout2d(ember.ones((8, 6, 5)), 0.5).numpy()
    assert np.all(out.min(-1) == out.max(-1))


def test_dropout2d_refuses_bad_p_and_inputs_of_fewer_than_2_dims():
    with pytest.raises(ValueError):
        nn.Dropout2d(1.5)
    with pytest.raises(ValueError):
        F.dropout2d(ember.ones((2, 3, 4, 4)), -0.1)
    with pytest.raises(ember.ShapeError):
        F.dropout2d(ember.ones((3,)), 0.5)
    np.testing.assert_array_equal(F.dropout2d(ember.ones((2, 3, 2, 2)), 1.0).numpy(), np.zeros((2, 3, 2, 2)))


def test_stochastic_depth_drops_whole_samples_or_the_whole_batch_and_scales_the_rest():
    x = ember.ones((64, 3, 2))
    rows = F.stochastic_depth(x, 0.25, "row").numpy().reshape(64, -1)
    assert np.all(rows.min(-1) == rows.max(-1)) and np.all(np.isclose(rows, 0) | np.isclose(rows, 1 / 0.75))
    assert 0.05 < (rows[:, 0] == 0).mean() < 0.5
    batch = F.stochastic_depth(x, 0.5, "batch").numpy()
    assert np.all(batch == batch.flat[0]) and batch.flat[0] in (0.0, 2.0)
    for p, training in [(0.0, True), (0.5, False)]:
        np.testing.assert_array_equal(F.stochastic_depth(x, p, "row", training).numpy(), x.numpy())
    np.testing.assert_array_equal(F.stochastic_depth(x, 1.0, "row").numpy(), np.zeros((64, 3, 2)))
    with pytest.raises(ValueError, match="p must be"):
        F.stochastic_depth(x, 1.5, "row")
    with pytest.raises(ValueError, match="mode"):
        F.stochastic_depth(x, 0.5, "channel")


# -- parameter containers ----------------------------------------------------------------------------

def _holder(m, values):
    """A module of the library `m` that holds a ParameterList and a ParameterDict."""
    class Holder(m.nn.Module if m is torch else nn.Module):
        def __init__(self):
            super().__init__()
            lib = torch.nn if m is torch else nn
            self.plist = lib.ParameterList([m.tensor(v) for v in values[:2]])
            self.pdict = lib.ParameterDict({"zeta": m.tensor(values[2]), "alpha": m.tensor(values[3])})
    return Holder()


def test_parameter_containers_register_under_torchs_keys(rng):
    values = [random_array(rng, (k + 1,), "float32") for k in range(4)]
    ours, theirs = _holder(ember, values), _holder(torch, values)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["plist.0", "plist.1", "pdict.alpha",
                                                                   "pdict.zeta"]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert all(p.requires_grad for p in ours.parameters())
    for (name, p), (_, q) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)


def test_parameter_list_appends_indexes_and_slices_as_a_list():
    plist = nn.ParameterList([ember.ones((2,))])
    plist.append(nn.Parameter(ember.zeros((3,)))).extend([ember.ones((1,))])
    assert len(plist) == 3 and list(plist.state_dict()) == ["0", "1", "2"]
    assert isinstance(plist[2], nn.Parameter) and plist[-1] is plist[2]
    assert [p.shape for p in plist[1:]] == [(3,), (1,)]
    plist[0] = ember.full((4,), 2.0)
    assert plist[0].shape == (4,) and isinstance(plist[0], nn.Parameter)
    with pytest.raises(IndexError):
        plist[3]


def test_parameter_dict_keeps_an_ordered_mappings_order_and_deletes_keys():
    from collections import OrderedDict

    pdict = nn.ParameterDict(OrderedDict([("b", ember.ones((1,))), ("a", ember.ones((2,)))]))
    pdict["c"] = ember.ones((3,))
    assert list(pdict) == ["b", "a", "c"] == list(pdict.state_dict())
    assert "a" in pdict and pdict.get("z") is None
    del pdict["a"]
    assert list(pdict.keys()) == ["b", "c"] and [n for n, _ in pdict.named_parameters()] == ["b", "c"]
    assert pdict.pop("b").shape == (1,) and len(pdict) == 1
    with pytest.raises(KeyError):
        pdict["a"]


def test_parameters_in_containers_train_with_an_optimizer():
    holder = nn.ParameterList([ember.ones((2,))])
    opt = ember.optim.SGD(holder.parameters(), lr=0.5)
    (holder[0] * holder[0]).sum().backward()
    opt.step()
    np.testing.assert_allclose(holder[0].numpy(), [0.0, 0.0])
