"""ember.nn.utils (gradient clipping, parameter vectors) and nn.init.trunc_normal_ against torch."""

import math
import warnings

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember import nn

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)
SHAPES = [(3, 4), (5,), (), (1,), (0,), (2, 0, 3), (1, 1)]  # size-0 and size-1 gradients among them


def parameters_with_gradients(shapes, scale=1.0, seed=0):
    """The same parameters with the same gradients in torch and ember; one parameter has no gradient."""
    rng = np.random.default_rng(seed)
    grads = [(rng.standard_normal(shape) * scale).astype(np.float32) for shape in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(shape)) for shape in [*shapes, (2,)]]
    ours = [nn.Parameter(ember.zeros(shape)) for shape in [*shapes, (2,)]]
    for tp, ep, g in zip(theirs, ours, grads):
        tp.grad, ep.grad = torch.tensor(g), ember.tensor(g)
    return theirs, ours


def assert_same_gradients(theirs, ours):
    for tp, ep in zip(theirs, ours):
        assert ep.grad is None if tp.grad is None else ep.grad is not None
        if tp.grad is not None:
            np.testing.assert_allclose(ep.grad.numpy(), tp.grad.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("clipped", [True, False], ids=["clipping", "under-max_norm"])
@pytest.mark.parametrize("norm_type", [2.0, 1, math.inf, "inf", 3.0, 0.0, -math.inf])
def test_clip_grad_norm_returns_the_total_norm_and_scales_the_gradients_as_torch_does(norm_type, clipped):
    shapes = SHAPES if norm_type not in (math.inf, "inf", -math.inf) else [s for s in SHAPES if 0 not in s]
    theirs, ours = parameters_with_gradients(shapes)
    norm = torch.nn.utils.get_total_norm([p.grad for p in theirs if p.grad is not None], norm_type).item()
    max_norm = norm / 2 if clipped else norm * 2
    before = [p.grad.numpy().copy() for p in ours if p.grad is not None]
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    total = nn.utils.clip_grad_norm_(ours, max_norm, norm_type)
    assert total.shape == () and total.dtype is ember.float32
    np.testing.assert_allclose(total.item(), expected.item(), rtol=1e-6)
    assert_same_gradients(theirs, ours)
    after = [p.grad.numpy() for p in ours if p.grad is not None]
    assert all(np.array_equal(a, b) for a, b in zip(after, before)) != clipped  # under max_norm: times exactly 1


@pytest.mark.parametrize("norm_type", [math.inf, -math.inf])
def test_an_infinity_norm_over_an_empty_gradient_is_refused_as_in_torch(norm_type):
    theirs, ours = parameters_with_gradients([(3,), (0,)])
    with pytest.raises(RuntimeError, match="empty tensor"):
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    with pytest.raises(ValueError, match="empty dimension"):
        nn.utils.clip_grad_norm_(ours, 1.0, norm_type)


def test_clipping_scales_each_gradient_tensor_in_place_lazily():
    _, ours = parameters_with_gradients([(4, 3), (2,)], scale=10.0)
    grads = [p.grad for p in ours]
    total = nn.utils.clip_grad_norm_(ours, 1.0)
    assert [p.grad for p in ours] == grads  # the same Tensors, showing the clipped values, as torch's mul_
    assert not total._node.realized and not grads[0]._node.realized  # computed with whatever reads them next
    clipped = np.concatenate([g.numpy().ravel() for g in grads if g is not None])
    assert np.linalg.norm(clipped) == pytest.approx(1.0, rel=1e-5)


def test_get_total_norm_then_clip_grads_with_norm_is_clip_grad_norm():
    theirs, ours = parameters_with_gradients(SHAPES)
    total = nn.utils.get_total_norm([p.grad for p in ours if p.grad is not None], 1.0)
    nn.utils.clip_grads_with_norm_(ours, 2.0, total)
    expected = torch.nn.utils.get_total_norm([p.grad for p in theirs if p.grad is not None], 1.0)
    torch.nn.utils.clip_grads_with_norm_(theirs, 2.0, expected)
    np.testing.assert_allclose(total.item(), expected.item(), rtol=1e-6)
    assert_same_gradients(theirs, ours)


def test_one_tensor_an_empty_list_and_an_empty_generator_are_taken_as_torch_takes_them():
    theirs, ours = parameters_with_gradients([(3,)])
    np.testing.assert_allclose(nn.utils.clip_grad_norm_(ours[0], 0.1).item(),
                               torch.nn.utils.clip_grad_norm_(theirs[0], 0.1).item(), rtol=1e-6)
    assert_same_gradients(theirs, ours)
    assert nn.utils.clip_grad_norm_([], 1.0).item() == 0.0
    assert nn.utils.get_total_norm([]).item() == 0.0
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur."):
        nn.utils.clip_grad_norm_((p for p in []), 1.0)


def test_a_nonfinite_total_norm_raises_torchs_error_only_when_asked():
    messages = []
    for lib in (torch, ember):
        p = lib.nn.Parameter(lib.zeros(2))
        p.grad = lib.tensor([1.0, math.inf])
        with pytest.raises(RuntimeError) as error:
            lib.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
        messages.append(str(error.value))
        assert math.isinf(lib.nn.utils.clip_grad_norm_([p], 1.0).item())  # without it: scaled by the inf norm
    assert messages[1] == messages[0]


def test_clip_grad_value_clamps_each_gradient_as_torch_does():
    theirs, ours = parameters_with_gradients(SHAPES, scale=2.0)
    torch.nn.utils.clip_grad_value_(theirs, 0.7)
    assert nn.utils.clip_grad_value_(ours, 0.7) is None
    assert_same_gradients(theirs, ours)


def test_parameters_to_vector_and_back_round_trip_as_in_torch():
    rng = np.random.default_rng(1)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in [(2, 3), (4,), (), (0,)]]
    theirs = [torch.nn.Parameter(torch.tensor(v)) for v in values]
    ours = [nn.Parameter(ember.tensor(v)) for v in values]
    vector = nn.utils.parameters_to_vector(ours)
    np.testing.assert_array_equal(vector.numpy(), torch.nn.utils.parameters_to_vector(theirs).detach().numpy())
    new = np.arange(vector.shape[0], dtype=np.float32)
    torch.nn.utils.vector_to_parameters(torch.tensor(new), theirs)
    nn.utils.vector_to_parameters(ember.tensor(new), ours)
    for tp, ep in zip(theirs, ours):
        assert ep.shape == tuple(tp.shape) and ep.requires_grad
        np.testing.assert_array_equal(ep.numpy(), tp.detach().numpy())


def test_vector_to_parameters_takes_only_a_tensor():
    with pytest.raises(TypeError, match="but got: list"):
        torch.nn.utils.vector_to_parameters([1.0], [torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(TypeError, match="but got: list"):
        nn.utils.vector_to_parameters([1.0], [nn.Parameter(ember.zeros(1))])


@pytest.mark.usefixtures("cuda_backend")
def test_a_step_that_clips_gradients_is_replayed_by_jit_to_what_running_it_computes():
    def make():
        ember.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("cuda")
        return model, ember.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step_fn(model, opt):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss, norm
        return step

    batches = [(ember.tensor(RNG.standard_normal((6, 8)).astype(np.float32), device="cuda"),
                ember.tensor(RNG.integers(0, 4, 6), device="cuda")) for _ in range(6)]
    results = []
    for jitted in (False, True):
        model, opt = make()
        step = ember.jit(step_fn(model, opt)) if jitted else step_fn(model, opt)
        results.append([[t.item() for t in step(x, y)] for x, y in batches]
                       + [p.numpy() for p in model.parameters()] + [p.grad.numpy() for p in model.parameters()])
    assert step.stats["replays"] >= 3, step.why_not_replayed
    for ours, expected in zip(results[1], results[0]):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
    assert results[1][0][1] > 0.5  # the gradients were clipped


# -- trunc_normal_ ------------------------------------------------------------------------------------------------

def truncated_normal_cdf(x, mean, std, a, b):
    def phi(z):
        return (1 + math.erf(z / math.sqrt(2))) / 2
    low, high = phi((a - mean) / std), phi((b - mean) / std)
    return np.array([(phi((v - mean) / std) - low) / (high - low) for v in x])


@pytest.mark.parametrize("mean,std,a,b", [(0.0, 1.0, -2.0, 2.0), (1.0, 2.0, -1.0, 4.0), (0.0, 0.02, -0.04, 0.04),
                                          (0.5, 1.0, 0.0, 5.0)])
def test_trunc_normal_draws_the_truncated_normal_distribution(mean, std, a, b):
    """Values in [a, b] whose empirical CDF is within 0.01 of the truncated normal's everywhere (a fixed seed:
    ember's random stream is a pure function of it; for 100000 values a typical distance is about 0.003)."""
    ember.manual_seed(0)
    values = nn.init.trunc_normal_(ember.empty(100_000), mean, std, a, b).numpy()
    assert a <= values.min() and values.max() <= b
    values.sort()
    empirical = np.arange(1, values.size + 1) / values.size
    expected = truncated_normal_cdf(values[::97], mean, std, a, b)
    assert np.abs(empirical[::97] - expected).max() < 0.01


def test_trunc_normal_defaults_and_moments_match_torchs_draws():
    ember.manual_seed(1)
    torch.manual_seed(1)
    ours = nn.init.trunc_normal_(ember.empty(300, 400)).numpy()
    theirs = torch.nn.init.trunc_normal_(torch.empty(300, 400)).numpy()
    assert -2.0 <= ours.min() and ours.max() <= 2.0
    assert ours.mean() == pytest.approx(theirs.mean(), abs=0.01)
    assert ours.std() == pytest.approx(theirs.std(), abs=0.01)  # both near 0.88, the truncated normal's


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_trunc_normal_fills_a_parameter_of_any_float_dtype_in_place(dtype):
    ember.manual_seed(5)
    p = nn.Parameter(ember.zeros(64, 64, dtype=getattr(ember, dtype)))
    assert nn.init.trunc_normal_(p, std=0.5, a=-0.3, b=0.6) is p
    values = p.numpy().astype(np.float64)
    assert p.dtype is getattr(ember, dtype) and p.requires_grad
    # the bounds as the dtype holds them (float16's nearest to 0.6 is 0.60009765625), as torch's clamp in it
    low, high = np.array([-0.3, 0.6]).astype(getattr(ember, dtype).np).astype(np.float64)
    assert low <= values.min() and values.max() <= high and np.unique(values).size > 100


def test_trunc_normal_warns_as_torch_does_and_takes_no_generator():
    with pytest.warns(UserWarning, match="mean is more than 2 std from"):
        torch.nn.init.trunc_normal_(torch.empty(3), mean=5.0, a=-2.0, b=2.0)
    with pytest.warns(UserWarning, match="mean is more than 2 std from"):
        nn.init.trunc_normal_(ember.empty(3), mean=5.0, a=-2.0, b=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.init.trunc_normal_(ember.empty(3), mean=1.0)
    with pytest.raises(ValueError, match="manual_seed"):
        nn.init.trunc_normal_(ember.empty(3), generator=object())
