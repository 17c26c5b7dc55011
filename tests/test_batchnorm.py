"""ember.nn.BatchNorm1d and BatchNorm2d trained side by side with torch.nn's, step by step.

Each step feeds both the same random batch (its mean and spread change from step to step), takes the
gradient of a random weighting of the output, and updates weight and bias with SGD; after every step the
outputs, the gradients of input, weight and bias, the updated parameters and the running statistics
(mean, unbiased variance, batches tracked) must be torch's. Then both switch to eval and normalise a new
batch with what they tracked. Cases cover batches of one image, one pixel per image and one channel;
momentum None (a cumulative average), no affine parameters, no running statistics; float32, float64, and
half-precision input with float32 parameters (as mixed-precision training feeds them) or half parameters.
Every test runs on the cpu and on the cuda device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GRAD_TOLERANCES, TOLERANCES, assert_same, random_array, to_torch

import ember
from ember import nn

pytestmark = pytest.mark.usefixtures("device")

STEPS = 5
LR = 0.1

CASES = {  # name: (module class, input shape)
    "2d": ("BatchNorm2d", (4, 3, 5, 5)),
    "2d_batch_of_one": ("BatchNorm2d", (1, 2, 3, 3)),
    "2d_one_pixel": ("BatchNorm2d", (6, 3, 1, 1)),
    "2d_one_channel": ("BatchNorm2d", (3, 1, 4, 4)),
    "1d_matrix": ("BatchNorm1d", (6, 4)),
    "1d_sequence": ("BatchNorm1d", (4, 3, 5)),
    "1d_sequence_batch_of_one": ("BatchNorm1d", (1, 2, 7)),
}


def train_side_by_side(rng, kind: str, shape, dtype: str = "float32", param_dtype: str | None = None,
                       steps: int = STEPS, eval_rtol: float | None = None, **options) -> None:
    """Train ember's and torch's `kind` (a BatchNorm class name) on the same batches and compare every step,
    then eval; `options` are the modules' keyword arguments."""
    param_dtype = param_dtype or dtype
    tbn = getattr(torch.nn, kind)(shape[1], dtype=getattr(torch, param_dtype), **options)
    ebn = getattr(nn, kind)(shape[1], dtype=ember.dtypes.as_dtype(param_dtype), **options)
    if tbn.affine:  # start from random parameters, not ones and zeros
        for name in ("weight", "bias"):
            value = random_array(rng, (shape[1],), param_dtype, 0.5, 1.5)
            getattr(tbn, name).data = to_torch(value)
            with ember.no_grad():
                getattr(ebn, name).copy_(ember.tensor(value))
    topt = torch.optim.SGD(tbn.parameters(), lr=LR) if tbn.affine else None
    eopt = ember.optim.SGD(ebn.parameters(), lr=LR) if ebn.affine else None
    rtol, atol = TOLERANCES[dtype]
    grad_rtol, grad_atol = GRAD_TOLERANCES[dtype]
    stat_rtol, stat_atol = TOLERANCES[param_dtype]
    for step in range(steps):
        x = random_array(rng, shape, dtype, -2.0 - step, 2.0 + 2 * step)  # a new mean and spread each step
        cotangent = random_array(rng, shape, dtype)
        tx, ex = to_torch(x).requires_grad_(), ember.tensor(x, requires_grad=True)
        ty, ey = tbn(tx), ebn(ex)
        assert_same(ey, ty, rtol, atol, what=f"step {step}: output")
        (ty * to_torch(cotangent)).sum().backward()
        (ey * ember.tensor(cotangent)).sum().backward()
        assert_same(ex.grad, tx.grad, grad_rtol, grad_atol, what=f"step {step}: input gradient")
        if tbn.affine:
            for name in ("weight", "bias"):
                assert_same(getattr(ebn, name).grad, getattr(tbn, name).grad, grad_rtol, grad_atol,
                            what=f"step {step}: {name} gradient")
            topt.step()
            eopt.step()
            topt.zero_grad()
            eopt.zero_grad()
            for name in ("weight", "bias"):
                assert_same(getattr(ebn, name), getattr(tbn, name).detach(), grad_rtol, grad_atol,
                            what=f"step {step}: {name} after the update")
        if tbn.track_running_stats:
            assert_same(ebn.running_mean, tbn.running_mean, stat_rtol, stat_atol, what=f"step {step}: running_mean")
            assert_same(ebn.running_var, tbn.running_var, stat_rtol, stat_atol, what=f"step {step}: running_var")
            assert ebn.num_batches_tracked.item() == tbn.num_batches_tracked.item() == step + 1
        else:
            assert ebn.running_mean is None and ebn.running_var is None and ebn.num_batches_tracked is None
    tbn.eval()
    ebn.eval()
    x = random_array(rng, shape, dtype, -3.0, 5.0)
    tx, ex = to_torch(x).requires_grad_(), ember.tensor(x, requires_grad=True)
    ty, ey = tbn(tx), ebn(ex)
    assert_same(ey, ty, eval_rtol or rtol, atol, what="eval: output")
    cotangent = random_array(rng, shape, dtype)
    (ty * to_torch(cotangent)).sum().backward()
    (ey * ember.tensor(cotangent)).sum().backward()
    assert_same(ex.grad, tx.grad, grad_rtol, grad_atol, what="eval: input gradient")
    if tbn.track_running_stats:  # eval reads the statistics and leaves them alone
        assert_same(ebn.running_mean, tbn.running_mean, stat_rtol, stat_atol, what="eval: running_mean")
        assert ebn.num_batches_tracked.item() == steps


@pytest.mark.parametrize("case", list(CASES))
def test_batchnorm_trains_step_by_step_as_torch(case, rng):
    kind, shape = CASES[case]
    train_side_by_side(rng, kind, shape)


@pytest.mark.parametrize("options", [dict(momentum=None), dict(momentum=0.5, eps=1e-3), dict(affine=False),
                                     dict(track_running_stats=False), dict(affine=False, track_running_stats=False)],
                         ids=["cumulative_average", "momentum_and_eps", "no_affine", "no_running_stats",
                              "no_affine_no_running_stats"])
@pytest.mark.parametrize("kind", ["BatchNorm2d", "BatchNorm1d"])
def test_batchnorm_options_train_as_torch(kind, options, rng):
    train_side_by_side(rng, kind, (3, 2, 3, 3) if kind == "BatchNorm2d" else (5, 3), **options)


@pytest.mark.parametrize("kind", ["BatchNorm2d", "BatchNorm1d"])
def test_batchnorm_in_float64_trains_as_torch(kind, rng):
    train_side_by_side(rng, kind, (3, 2, 3, 3) if kind == "BatchNorm2d" else (4, 3, 5), "float64", momentum=None)


@pytest.mark.parametrize("param_dtype", ["float32", "same"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_batchnorm_of_half_precision_input_trains_as_torch(dtype, param_dtype, rng):
    """Half input with float32 parameters and statistics (mixed precision) or with half ones: the output and
    the input's gradient in the input's dtype, the parameters' gradients and statistics in theirs.

    Statistics kept in half precision are updated in float32 and rounded once: torch's float16 ones to the
    bit; its bfloat16 ones come out up to an ulp away (its CPU kernel rounds them otherwise), which moves an
    eval output by up to two ulps of its own."""
    half_stats = param_dtype == "same"
    train_side_by_side(rng, "BatchNorm2d", (3, 2, 3, 3), dtype, dtype if half_stats else param_dtype,
                       eval_rtol=2e-2 if half_stats and dtype == "bfloat16" else None)


@pytest.mark.parametrize("dtype,param_dtype", [("float32", "bfloat16"), ("float64", "float32"),
                                               ("float16", "bfloat16"), ("bfloat16", "float64")])
def test_batchnorm_refuses_parameters_of_a_dtype_torch_refuses(dtype, param_dtype):
    """Parameters in the input's dtype, or float32 ones for half input: anything else is a DTypeError naming both."""
    bn = nn.BatchNorm2d(2, dtype=ember.dtypes.as_dtype(param_dtype))
    x = ember.randn(3, 2, 2, 2).to(ember.dtypes.as_dtype(dtype))
    with pytest.raises(ember.DTypeError, match=f"batch_norm: .*{param_dtype}.*{dtype}"):
        bn(x)
    bn.eval()
    with pytest.raises(ember.DTypeError, match=f"batch_norm: .*{param_dtype}.*{dtype}"):
        bn(x)


def test_a_training_step_with_batch_norms_is_one_realization(rng):
    """The running statistics of every batch norm are updated in the plan of the step that computes their
    batch statistics (the optimizer's), not each in a realization of its own, and the graph does not grow."""
    from ember.runtime import executor

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    optimizer = ember.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    realized = []
    observe = lambda order, keep: realized.append(len(order))  # noqa: E731
    batches = [ember.tensor(random_array(rng, (2, 3, 7, 7), "float32")) for _ in range(4)]
    ember.realize(*model.parameters(), *model.buffers(), *batches)  # initialisation and inputs
    executor.this_thread.observers.append(observe)
    try:
        for x in batches:
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        executor.this_thread.observers.remove(observe)
    assert len(realized) == len(batches), realized  # one plan a step, batch norms' buffers included
    assert len(set(realized[1:])) == 1  # steps after the first (which creates the momentum) are alike
    for bn in (model[1], model[4]):
        assert bn.running_mean._node.realized and bn.running_var._node.realized
        assert int(bn.num_batches_tracked.item()) == len(batches)


def test_eval_batch_norm_is_one_pass_after_its_convolution(device, rng):
    """In eval mode the statistics are constants: normalisation, scale, shift and activation are one
    pointwise pass over the convolution's output (the convolution's epilogue), with no reduction, and the
    values are torch's."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)).to(device)
    for bn_stat in (model[1].running_mean, model[1].running_var):
        bn_stat.data = ember.tensor(random_array(rng, (4,), "float32"), device=device).abs() + 0.5
    model.eval()
    x = random_array(rng, (2, 3, 7, 6), "float32")
    ember.realize(*model.parameters(), *model.buffers())
    out = model(ember.tensor(x, device=device))
    if device == "cuda":  # the first convolution's bias, batch norm and ReLU in one pass; the last's bias added
        kinds = [k.kind.value for k in ember.explain.plan(out).kernels]  # by it (compiler/conv_folding.py)
        assert kinds == ["conv2d", "pointwise", "conv2d"], kinds
    reference = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                    torch.nn.Conv2d(4, 2, 1))
    reference.load_state_dict({k: to_torch(v) for k, v in model.state_dict().items()})
    reference.eval()
    assert_same(out, reference(torch.tensor(x)), *TOLERANCES["float32"])
