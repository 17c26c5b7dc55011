"""unfold / fold, max pooling's indices and max_unpool, and EmbeddingBag against torch: values, gradients, modules,
from_torch and argument errors."""

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember import nn
from ember.errors import DTypeError, ShapeError
from ember.frontends.torch import from_torch
from tests.conftest import check_against_torch, random_array

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("device")


def arrays(seed: int, *shapes) -> list[np.ndarray]:
    """float32 inputs uniform in [-2, 2], one per shape."""
    rng = np.random.default_rng(seed)
    return [random_array(rng, shape, "float32") for shape in shapes]


def ties(seed, shape):
    """Small integers as floats: most windows hold their maximum more than once."""
    return np.random.default_rng(seed).integers(0, 3, shape).astype(np.float32)


# -- unfold and fold ------------------------------------------------------------------------

SLIDING = [
    ((2, 3, 5, 6), dict(kernel_size=2)),
    ((1, 1, 1, 1), dict(kernel_size=1)),
    ((1, 2, 7, 5), dict(kernel_size=(3, 2), dilation=(2, 1), padding=1, stride=(2, 3))),
    ((2, 1, 4, 4), dict(kernel_size=3, padding=2, stride=2)),
    ((3, 6, 5), dict(kernel_size=(1, 3), dilation=2)),
    pytest.param((2, 4, 9, 8), dict(kernel_size=3, dilation=2, padding=(1, 2), stride=(1, 2)), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,kwargs", SLIDING)
def test_unfold_and_its_gradients_match_torch(shape, kwargs):
    (x,) = arrays(0, shape)
    check_against_torch(lambda m, x: m.nn.functional.unfold(x, **kwargs), x)


@pytest.mark.parametrize("shape,kwargs", SLIDING)
def test_fold_is_unfolds_adjoint_and_matches_torch_with_its_gradients(shape, kwargs):
    columns = torch.nn.functional.unfold(torch.zeros(shape), **kwargs)
    (cols,) = arrays(1, tuple(columns.shape))
    check_against_torch(lambda m, c: m.nn.functional.fold(c, shape[-2:], **kwargs), cols)


def test_unfold_and_fold_modules_match_torch():
    (x,) = arrays(2, (2, 2, 5, 5))
    e_cols = nn.Unfold(3, padding=1, stride=2)(ember.tensor(x))
    t_cols = torch.nn.Unfold(3, padding=1, stride=2)(torch.tensor(x))
    np.testing.assert_allclose(e_cols.numpy(), t_cols.numpy(), rtol=1e-6)
    e_back = nn.Fold((5, 5), 3, padding=1, stride=2)(e_cols)
    t_back = torch.nn.Fold((5, 5), 3, padding=1, stride=2)(t_cols)
    np.testing.assert_allclose(e_back.numpy(), t_back.numpy(), rtol=1e-5, atol=1e-6)
    assert "kernel_size=3" in repr(nn.Unfold(3))


def test_unfold_and_fold_reject_what_torch_rejects():
    x = ember.zeros((1, 2, 2, 2))
    with pytest.raises(ShapeError, match="sliding blocks"):
        F.unfold(x, 3)
    with pytest.raises(ShapeError, match="unfold: expects input"):
        F.unfold(ember.zeros((2, 3)), 2)
    with pytest.raises(ValueError, match="kernel_size must be positive"):
        F.unfold(x, 0)
    with pytest.raises(ValueError, match="padding must be non-negative"):
        F.unfold(x, 1, padding=-1)
    with pytest.raises(ShapeError, match="divisible by the product of kernel_size"):
        F.fold(ember.zeros((1, 5, 4)), (3, 3), 2)
    with pytest.raises(ShapeError, match=r"give 2 \* 2 sliding blocks"):
        F.fold(ember.zeros((1, 4, 5)), (3, 3), 2)


# -- max pooling's indices and max_unpool -----------------------------------------------------

MAX_POOLS = [
    ((2, 3, 7, 6), dict(kernel_size=3, stride=2, padding=1)),
    ((1, 2, 6, 7), dict(kernel_size=(2, 3), stride=1, dilation=2)),
    ((2, 1, 7, 7), dict(kernel_size=3, stride=2, ceil_mode=True)),
    ((3, 5, 4), dict(kernel_size=2)),
    ((1, 1, 1, 1), dict(kernel_size=1)),
]


@pytest.mark.parametrize("shape,kwargs", MAX_POOLS)
def test_max_pool2d_indices_and_gradients_match_torch_with_ties_going_to_the_first_maximum(shape, kwargs):
    x = ties(3, shape)
    check_against_torch(lambda m, x: m.nn.functional.max_pool2d(x, return_indices=True, **kwargs), x)


@pytest.mark.parametrize("shape,size", [((2, 3, 7, 6), (3, 4)), ((1, 2, 5, 5), 1), ((1, 1, 4, 6), (4, None)),
                                        ((3, 5, 7), (5, 2))])
def test_adaptive_max_pool2d_indices_and_gradients_match_torch(shape, size):
    x = ties(4, shape)
    check_against_torch(lambda m, x: m.nn.functional.adaptive_max_pool2d(x, size, return_indices=True), x)


@pytest.mark.parametrize("name", ["max_pool1d", "adaptive_max_pool1d"])
def test_1d_max_pool_indices_match_torch(name):
    x = ties(5, (2, 3, 9))
    args = {"max_pool1d": (3, 2, 1), "adaptive_max_pool1d": (4,)}[name]
    check_against_torch(lambda m, x: getattr(m.nn.functional, name)(x, *args, return_indices=True), x)


@pytest.mark.parametrize("shape,kwargs,output_size", [
    ((2, 3, 6, 6), dict(kernel_size=2), None),
    ((1, 2, 7, 7), dict(kernel_size=3, stride=2, padding=1), (7, 7)),
    ((1, 1, 5, 5), dict(kernel_size=3, stride=1), None),  # overlapping windows share maxima
])
def test_max_unpool2d_places_the_pooled_values_and_gets_torchs_gradients(shape, kwargs, output_size):
    x = ties(6, shape)
    check_against_torch(lambda m, x: m.nn.functional.max_unpool2d(
        *m.nn.functional.max_pool2d(x, return_indices=True, **kwargs), output_size=output_size, **kwargs), x)


def test_pooling_modules_return_indices_and_unpool_as_torch():
    x = ties(8, (2, 2, 6, 6))
    t_values, t_index = torch.nn.MaxPool2d(2, return_indices=True)(torch.tensor(x))
    e_values, e_index = nn.MaxPool2d(2, return_indices=True)(ember.tensor(x))
    np.testing.assert_array_equal(e_index.numpy(), t_index.numpy())
    np.testing.assert_array_equal(nn.MaxUnpool2d(2)(e_values, e_index).numpy(),
                                  torch.nn.MaxUnpool2d(2)(t_values, t_index).numpy())
    _, e_adaptive = nn.AdaptiveMaxPool2d(3, return_indices=True)(ember.tensor(x))
    _, t_adaptive = torch.nn.AdaptiveMaxPool2d(3, return_indices=True)(torch.tensor(x))
    np.testing.assert_array_equal(e_adaptive.numpy(), t_adaptive.numpy())
    row = ties(9, (2, 3, 8))
    t_values, t_index = torch.nn.MaxPool1d(2, return_indices=True)(torch.tensor(row))
    e_values, e_index = nn.MaxPool1d(2, return_indices=True)(ember.tensor(row))
    np.testing.assert_array_equal(e_index.numpy(), t_index.numpy())
    np.testing.assert_array_equal(nn.MaxUnpool1d(2)(e_values, e_index).numpy(),
                                  torch.nn.MaxUnpool1d(2)(t_values, t_index).numpy())


def test_max_unpool2d_rejects_a_bad_output_size_and_indices():
    values, index = F.max_pool2d(ember.zeros((1, 1, 4, 4)), 2, return_indices=True)
    with pytest.raises(ValueError, match="output_size"):
        F.max_unpool2d(values, index, 2, output_size=(9, 9))
    with pytest.raises(ShapeError, match="indices must be int64"):
        F.max_unpool2d(values, index.to(ember.int32), 2)


# -- EmbeddingBag ------------------------------------------------------------------------------

BAGS = [
    dict(input=[[1, 2, 4], [4, 3, 2]], offsets=None),
    dict(input=[[0]], offsets=None),
    dict(input=[1, 2, 4, 5, 4, 3, 2, 9], offsets=[0, 4]),
    dict(input=[1, 2, 4, 5, 4, 3], offsets=[0, 2, 2, 5]),  # an empty bag gives zeros
    dict(input=[1, 2, 4, 5, 4, 3], offsets=[0, 1, 6], include_last_offset=True),
]


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("bags", range(len(BAGS)))
def test_embedding_bag_and_its_weight_gradient_match_torch(mode, bags):
    case = BAGS[bags]
    (weight,) = arrays(10, (10, 3))
    index = np.array(case["input"], dtype=np.int64)
    offsets = None if case["offsets"] is None else np.array(case["offsets"], dtype=np.int64)
    check_against_torch(lambda m, w, i, o: m.nn.functional.embedding_bag(
        i, w, o, mode=mode, include_last_offset=case.get("include_last_offset", False)), weight, index, offsets)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_leaves_out_padding_idx_as_torch(mode):
    (weight,) = arrays(11, (6, 4))
    index = np.array([2, 0, 0, 3, 0, 5, 2], dtype=np.int64)
    offsets = np.array([0, 3, 4], dtype=np.int64)  # the second bag holds only padding
    check_against_torch(lambda m, w, i, o: m.nn.functional.embedding_bag(i, w, o, mode=mode, padding_idx=0),
                        weight, index, offsets)
    check_against_torch(lambda m, w, i: m.nn.functional.embedding_bag(i, w, mode=mode, padding_idx=-1),
                        weight, index[:6].reshape(2, 3) % 6)


def test_embedding_bag_per_sample_weights_scale_rows_in_sum_mode_as_torch():
    weight, per_sample = arrays(12, (8, 3), (7,))
    index = np.array([1, 2, 7, 2, 0, 5, 3], dtype=np.int64)
    offsets = np.array([0, 2, 5], dtype=np.int64)
    check_against_torch(lambda m, w, i, o, p: m.nn.functional.embedding_bag(i, w, o, mode="sum",
                                                                              per_sample_weights=p),
                        weight, index, offsets, per_sample)
    check_against_torch(lambda m, w, i, p: m.nn.functional.embedding_bag(i, w, mode="sum", per_sample_weights=p,
                                                                           padding_idx=2),
                        weight, index[:6].reshape(3, 2), per_sample[:6].reshape(3, 2))


def test_embedding_bag_module_has_torchs_state_and_trains_its_weight():
    torch.manual_seed(0)
    t_bag = torch.nn.EmbeddingBag(10, 4, mode="max", padding_idx=1)
    e_bag = nn.EmbeddingBag.from_pretrained(ember.tensor(t_bag.weight.detach().numpy()), freeze=False, mode="max",
                                            padding_idx=1)
    assert list(e_bag.state_dict()) == list(t_bag.state_dict())
    assert np.all(nn.EmbeddingBag(5, 2, padding_idx=3).weight.numpy()[3] == 0)
    assert not nn.EmbeddingBag.from_pretrained(ember.zeros((3, 2))).weight.requires_grad
    index, offsets = np.array([1, 4, 1, 7, 7]), np.array([0, 2])
    t_bag(torch.tensor(index), torch.tensor(offsets)).sum().backward()
    out = e_bag(ember.tensor(index), ember.tensor(offsets))
    out.sum().backward()
    np.testing.assert_allclose(e_bag.weight.grad.numpy(), t_bag.weight.grad.numpy())
    assert "mode='max'" in repr(e_bag)


def test_embedding_bag_rejects_what_torch_rejects():
    w = ember.zeros((10, 3))
    i = ember.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="offsets has to be a 1-d tensor"):
        F.embedding_bag(i, w)
    with pytest.raises(ValueError, match="offsets has to be None"):
        F.embedding_bag(i.reshape(2, 2), w, ember.tensor([0]))
    with pytest.raises(ValueError, match="mode has to be one of"):
        F.embedding_bag(i, w, ember.tensor([0]), mode="median")
    with pytest.raises(NotImplementedError, match="only supported for mode='sum'"):
        F.embedding_bag(i, w, ember.tensor([0]), per_sample_weights=ember.ones(4))
    with pytest.raises(ShapeError, match="per_sample_weights"):
        F.embedding_bag(i, w, ember.tensor([0]), mode="sum", per_sample_weights=ember.ones(3))
    with pytest.raises(DTypeError, match="integer"):
        F.embedding_bag(i.to(ember.float32), w, ember.tensor([0]))
    with pytest.raises(ValueError, match="padding_idx"):
        F.embedding_bag(i, w, ember.tensor([0]), padding_idx=10)
    with pytest.raises(ValueError, match="mode"):
        nn.EmbeddingBag(3, 2, mode="min")


# -- from_torch ------------------------------------------------------------------------------------

class PatchModel(torch.nn.Module):
    """Uses every new layer: patches as tokens, pooling with indices unpooled again, and a bag of words."""

    def __init__(self):
        super().__init__()
        self.unfold = torch.nn.Unfold(2, stride=2)
        self.fold = torch.nn.Fold((4, 4), 2, stride=2)
        self.pool = torch.nn.MaxPool2d(2, return_indices=True)
        self.unpool = torch.nn.MaxUnpool2d(2)
        self.adaptive = torch.nn.AdaptiveMaxPool2d(2)
        self.bag = torch.nn.EmbeddingBag(6, 8, mode="sum")

    def forward(self, x, words, offsets):
        patches = self.fold(self.unfold(x) * 2)
        values, index = self.pool(patches)
        restored = self.unpool(values, index)
        return self.adaptive(restored).flatten(1) + self.bag(words, offsets)[:1]


def test_from_torch_imports_a_model_using_the_new_layers_and_shares_their_weights(device):
    if device == "cuda":
        pytest.skip("the reference backend covers the import; the layers' kernels are tested above")
    torch.manual_seed(0)
    t_model = PatchModel()
    e_model = from_torch(t_model)
    (x,) = arrays(13, (1, 2, 4, 4))
    words, offsets = np.array([1, 5, 2, 0]), np.array([0, 3])
    t_out = t_model(torch.tensor(x), torch.tensor(words), torch.tensor(offsets))
    e_out = e_model(ember.tensor(x), ember.tensor(words), ember.tensor(offsets))
    np.testing.assert_allclose(e_out.numpy(), t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert list(e_model.state_dict()) == list(t_model.state_dict())
    e_out.sum().backward()
    t_out.sum().backward()
    np.testing.assert_allclose(e_model.bag.weight.grad.numpy(), t_model.bag.weight.grad.numpy(), rtol=1e-5)
