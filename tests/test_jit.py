"""ember.jit: a recorded step replays to exactly what running the Python would compute."""

from __future__ import annotations

import os
import signal
import warnings

import numpy as np
import pytest

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.runtime import graphs, launcher, plan_cache

pytestmark = pytest.mark.usefixtures("cuda_backend")

RNG = np.random.default_rng(0)
BATCHES = [(RNG.standard_normal((6, 8)).astype(np.float32), RNG.integers(0, 4, 6)) for _ in range(6)]


def make(optimizer="adam", dropout=0.0, seed=0):
    ember.manual_seed(seed)
    layers = [nn.Linear(8, 16), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(16, 4)]
    model = nn.Sequential(*layers).to("cuda")
    if optimizer == "adam":
        opt = ember.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = ember.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def step_fn(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def train(step, batches, between=None):
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append(step(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda")))
        if between:
            between(i)
    return [loss.item() for loss in losses]


def assert_same_values(a, b) -> None:
    """Values computed by the same math cut into kernels differently (a replay against a run as written,
    an update fused into a GEMM's epilogue or not): equal through the interpreter, and on a GPU within
    the rounding of a multiply-add contracted differently."""
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def params(model):
    return [p.numpy() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_replayed_training_equals_running_the_python(optimizer):
    model, opt = make(optimizer)
    expected = train(step_fn(model, opt), BATCHES)
    expected_params = params(model)

    model, opt = make(optimizer)
    step = ember.jit(step_fn(model, opt))
    got = train(step, BATCHES)

    # calls as written until two ran the same plans (Adam's state starts as zero buffers, so its first step
    # is its second; SGD's first momentum step differs), one recorded, the rest replayed
    eager = 1 if optimizer == "adam" else 2
    assert step.stats == {"calls": 6, "captures": 1, "replays": 5 - eager, "eager": eager}
    assert got == expected  # the same kernels on the same values: bit for bit
    for a, b in zip(params(model), expected_params):
        assert_same_values(a, b)


def test_state_is_updated_in_place_without_copies():
    model, opt = make("adam")
    step = ember.jit(step_fn(model, opt))
    train(step, BATCHES[:3])
    (entry,) = step._entries.values()
    assert all(not s.copies for s in entry.program.plans.steps)


def test_nodes_compare_by_identity():
    """A replay checks its state Tensors' nodes with one list comparison: only right while nodes compare as
    objects do."""
    from ember.ir import Node

    assert Node.__eq__ is object.__eq__ and Node.__ne__ is object.__ne__


def test_returned_tensors_are_new_each_call():
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    x, y = (ember.tensor(v, device="cuda") for v in BATCHES[0])
    first = [step(x, y) for _ in range(4)]
    values = [loss.item() for loss in first]
    assert len(set(values)) == 4  # training moves the loss, and no call's result was overwritten


def test_arguments_are_read_where_they_are(monkeypatch):
    import torch

    step = ember.jit(lambda x, w: (x * 1.5 + w).relu())
    xs = [RNG.standard_normal((5, 7)).astype(np.float32) for _ in range(8)]
    w = RNG.standard_normal(7).astype(np.float32)
    wt = ember.tensor(w, device="cuda")
    for x in xs[:3]:
        step(ember.tensor(x, device="cuda"), wt)
    copies = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: copies.append(self) or original(self, *a, **k))
    before = step.stats["replays"]
    kept = [(x, step(ember.tensor(x, device="cuda"), wt)) for x in xs[3:]]
    monkeypatch.undo()
    assert step.stats["replays"] - before == 5 and copies == []
    for x, got in kept:  # every call's result kept its value through the replays after it
        np.testing.assert_allclose(got.numpy(), np.maximum(x * np.float32(1.5) + w, 0), rtol=1e-6)


def test_a_result_fed_back_as_the_argument_alternates_buffers():
    step = ember.jit(lambda h, w: (h @ w).tanh() + h)
    h0 = RNG.standard_normal((4, 6)).astype(np.float32)
    w = (RNG.standard_normal((6, 6)) * 0.3).astype(np.float32)
    h, wt = ember.tensor(h0, device="cuda"), ember.tensor(w, device="cuda")
    history, expected = [], [h0]
    for _ in range(7):
        h = step(h, wt)
        history.append(h)
        expected.append(np.tanh(expected[-1] @ w) + expected[-1])
    assert step.stats["replays"] >= 5
    (entry,) = step._entries.values()
    assert len(entry.program.results) == 2  # the argument shows one set while the replay writes the other
    for got, want in zip(history, expected[1:]):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_an_older_result_passed_back_is_never_overwritten_while_read():
    step = ember.jit(lambda h, w: (h @ w) * 0.5 + 1.25)
    w0 = (RNG.standard_normal((6, 6)) * 0.3).astype(np.float32)
    x0 = RNG.standard_normal((4, 6)).astype(np.float32)
    x, w = ember.tensor(x0, device="cuda"), ember.tensor(w0, device="cuda")
    for _ in range(3):
        step(x, w)
    a, b = step(x, w), step(x, w)  # both result sets shown
    c = step(a, w)  # reads the older set: written elsewhere
    expected_a = (x0 @ w0) * 0.5 + 1.25
    np.testing.assert_allclose(a.numpy(), expected_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), expected_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.numpy(), (expected_a @ w0) * 0.5 + 1.25, rtol=1e-5, atol=1e-5)


def test_a_value_sharing_a_results_buffer_keeps_its_value():
    """`step(x) / 1` is the result's own buffer (a division by one is simplified away): later replays must not
    write it."""
    step = ember.jit(lambda x: x.exp() + 1)
    data = [RNG.standard_normal(5).astype(np.float32) for _ in range(6)]
    kept = []
    for x in data:
        kept.append((x, step(ember.tensor(x, device="cuda")) / 1))
    for x, value in kept:
        np.testing.assert_allclose(value.numpy(), np.exp(x) + 1, rtol=1e-6)


def test_an_argument_passed_through_is_returned_as_the_argument():
    step = ember.jit(lambda x, s: (x * s, (x * x).sum()))
    for x0 in [RNG.standard_normal(4).astype(np.float32) for _ in range(5)]:
        same, total = step(ember.tensor(x0, device="cuda"), 1.0)
        np.testing.assert_array_equal(same.numpy(), x0)
        np.testing.assert_allclose(total.item(), (x0 * x0).sum(), rtol=1e-5)
    assert step.stats["replays"] >= 2


def test_a_result_shared_through_dlpack_keeps_its_value():
    import torch

    step = ember.jit(lambda x: x.exp() - 1)
    data = [RNG.standard_normal(9).astype(np.float32) for _ in range(6)]
    results = [step(ember.tensor(x, device="cuda")) for x in data[:3]]
    shared = torch.from_dlpack(results[-1])
    later = [step(ember.tensor(x, device="cuda")) for x in data[3:]]
    assert step.stats["replays"] >= 3
    np.testing.assert_allclose(shared.cpu().numpy(), np.expm1(data[2]), rtol=1e-5, atol=1e-6)
    for x, got in zip(data[3:], later):
        np.testing.assert_allclose(got.numpy(), np.expm1(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_scheduler_changing_the_learning_rate_every_step_is_replayed(optimizer):
    def schedule(opt):
        scheduler = ember.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return lambda i: scheduler.step()

    model, opt = make(optimizer)
    expected = train(step_fn(model, opt), BATCHES, schedule(opt))
    model, opt = make(optimizer)
    step = ember.jit(step_fn(model, opt))
    got = train(step, BATCHES, schedule(opt))
    assert step.stats["captures"] == 1 and step.stats["replays"] == (4 if optimizer == "adam" else 3)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_other_hyper_parameter_changes_record_the_step_again():
    def change_betas(opt):
        return lambda i: [g.__setitem__("betas", (0.8, 0.99)) for g in opt.param_groups] if i == 3 else None

    model, opt = make()
    expected = train(step_fn(model, opt), BATCHES, change_betas(opt))
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    got = train(step, BATCHES, change_betas(opt))
    assert got == expected
    assert step.stats["captures"] == 2


def test_dropout_draws_fresh_masks_each_replay():
    model, opt = make(dropout=0.5)
    expected = train(step_fn(model, opt), BATCHES)
    model, opt = make(dropout=0.5)
    step = ember.jit(step_fn(model, opt))
    got = train(step, BATCHES)
    assert step.stats["replays"] == 4
    assert got == expected


def test_a_new_shape_is_recorded_on_its_own_and_both_replay():
    small = [(x[:3], y[:3]) for x, y in BATCHES[:3]]
    batches = BATCHES[:3] + small + BATCHES[3:5] + small[:2]
    model, opt = make()
    expected = train(step_fn(model, opt), batches)
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    assert train(step, batches) == expected
    assert step.stats["captures"] == 2
    assert step.stats["replays"] == 6  # switching shapes hands the parameters over, no new recording


def test_steady_replays_copy_nothing_for_the_state():
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    train(step, BATCHES[:4])
    (entry,) = step._entries.values()
    shown = [id(node) for node in entry.program.state_nodes]  # ids: holding the nodes would count as a use
    train(step, BATCHES[4:])
    assert shown == [id(node) for node in entry.program.state_nodes]


def test_values_kept_from_before_a_replay_keep_their_value():
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    train(step, BATCHES[:4])
    snapshot = model[0].weight.detach()
    pending = model[0].weight * 1  # a graph still to compute from the weight as it is now
    before = snapshot.numpy().copy()
    train(step, BATCHES[4:5])
    np.testing.assert_array_equal(snapshot.numpy(), before)
    np.testing.assert_array_equal(pending.numpy(), before)
    assert not np.array_equal(model[0].weight.numpy(), before)
    assert step.stats["replays"] == 3


def test_loading_a_state_dict_records_again():
    model, opt = make()
    reference, ref_opt = make(seed=1)
    expected_step = step_fn(reference, ref_opt)
    step = ember.jit(step_fn(model, opt))
    train(step, BATCHES[:3])
    model.load_state_dict(reference.state_dict())
    opt.load_state_dict(ref_opt.state_dict())
    assert train(step, BATCHES[3:]) == train(expected_step, BATCHES[3:])


def test_a_step_reading_the_host_runs_as_written():
    model, opt = make()

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    jitted = ember.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = [jitted(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda")) for x, y in BATCHES[:4]]
    assert jitted.stats["replays"] == 0 and jitted.stats["eager"] == 3
    assert any("reads a value" in str(w.message) for w in caught)
    assert "reads a value" in jitted.why_not_replayed[0]
    model, opt = make()
    assert values == train(step_fn(model, opt), BATCHES[:4])


def test_cpu_steps_run_as_written():
    ember.manual_seed(0)
    model = nn.Linear(8, 4)
    step = ember.jit(lambda x: model(x).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = [step(ember.tensor(x)).item() for x, _ in BATCHES[:3]]
    assert values == [model(ember.tensor(x)).sum().item() for x, _ in BATCHES[:3]]
    assert "cpu" in step.why_not_replayed[0]


def test_host_arguments_are_uploaded_each_replay():
    ember.manual_seed(0)
    model = nn.Linear(8, 4).to("cuda")
    step = ember.jit(lambda x: model(x.to("cuda")).relu())
    got = [step(ember.tensor(x)).numpy() for x, _ in BATCHES[:4]]
    assert step.stats["replays"] == 2
    for value, (x, _) in zip(got, BATCHES):
        assert_same_values(value, model(ember.tensor(x, device="cuda")).relu().numpy())


def test_an_interrupt_waits_for_the_replay_to_finish(monkeypatch):
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    train(step, BATCHES[:3])
    run = graphs.Replay.run

    def interrupted(self, draws):
        os.kill(os.getpid(), signal.SIGINT)  # arrives as the replay starts
        return run(self, draws)

    monkeypatch.setattr(graphs.Replay, "run", interrupted)
    # Ctrl-C as an interactive Python has it: a process started in the background ignores SIGINT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    calls, replays = 3, step.stats["replays"]
    try:
        with pytest.raises(KeyboardInterrupt):
            for batch in BATCHES[3:]:  # the first call that replays is interrupted
                calls += 1
                step(*(ember.tensor(v, device="cuda") for v in batch))
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(graphs.Replay, "run", run)
    assert step.stats["replays"] == replays + 1 and calls == 4, (step.stats, step.why_not_replayed)
    reference, ref_opt = make()
    train(step_fn(reference, ref_opt), BATCHES[:calls])
    for a, b in zip(params(model), params(reference)):  # the interrupted step was completed, not cut
        assert_same_values(a, b)


def test_an_interrupted_eager_step_is_never_half_applied(monkeypatch):
    """Buffers are bound to the step's results only after all its kernels ran: an interrupted step
    leaves its graph pending, so the parameters still show the whole update, computed when read."""
    model, opt = make()
    train(step_fn(model, opt), BATCHES[:1])
    launches = launcher._run_launches
    count = {"n": 0}

    def failing(*args, **kwargs):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt
        return launches(*args, **kwargs)

    monkeypatch.setattr(launcher, "_run_launches", failing)
    plan_cache.clear()  # launch recipes are bound when a plan is first run
    with pytest.raises(KeyboardInterrupt):
        train(step_fn(model, opt), BATCHES[1:2])
    assert not any(p._node.realized for p in model.parameters())
    reference, ref_opt = make()
    train(step_fn(reference, ref_opt), BATCHES[:2])
    for a, b in zip(params(model), params(reference)):
        assert_same_values(a, b)


def test_gradients_cleared_outside_the_step_are_set_by_each_replay():
    model, opt = make()

    def forward_backward(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    step = ember.jit(forward_backward)
    for x, y in BATCHES:
        opt.zero_grad()
        step(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda"))
        assert all(p.grad is not None for p in model.parameters())
        opt.step()  # parameters change outside the step: the replay follows them
    assert step.stats["replays"] == 4
    reference, ref_opt = make()
    for x, y in BATCHES:
        ref_opt.zero_grad()
        F.cross_entropy(reference(ember.tensor(x, device="cuda")), ember.tensor(y, device="cuda")).backward()
        ref_opt.step()
    for a, b in zip(params(model), params(reference)):
        assert_same_values(a, b)


def test_gradient_accumulation_across_calls_runs_as_written():
    model, opt = make()

    def forward_backward(x, y):
        F.cross_entropy(model(x), y).backward()

    step = ember.jit(forward_backward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(BATCHES * 2):
            step(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda"))
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
    assert step.stats["replays"] == 0
    assert "accumulation" in " ".join(step.why_not_replayed)
    reference, ref_opt = make()
    for i, (x, y) in enumerate(BATCHES * 2):
        F.cross_entropy(reference(ember.tensor(x, device="cuda")), ember.tensor(y, device="cuda")).backward()
        if i % 4 == 3:
            ref_opt.step()
            ref_opt.zero_grad()
    for a, b in zip(params(model), params(reference)):
        assert_same_values(a, b)


def test_loading_only_the_optimizer_state_records_again():
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    train(step, BATCHES[:4])
    saved = opt.state_dict()
    train(step, BATCHES[4:5])
    opt.load_state_dict(saved)
    got = train(step, BATCHES[5:])

    reference, ref_opt = make()
    train(step_fn(reference, ref_opt), BATCHES[:4])
    saved = ref_opt.state_dict()
    train(step_fn(reference, ref_opt), BATCHES[4:5])
    ref_opt.load_state_dict(saved)
    assert got == train(step_fn(reference, ref_opt), BATCHES[5:])


def test_the_same_tensor_twice_is_a_step_of_its_own():
    step = ember.jit(lambda a, b: a - b)
    x = ember.tensor(BATCHES[0][0], device="cuda")
    for _ in range(3):
        assert not step(x, x).numpy().any()
    other = ember.tensor(BATCHES[1][0], device="cuda")
    np.testing.assert_array_equal(step(x, other).numpy(), BATCHES[0][0] - BATCHES[1][0])


def test_a_returned_argument_is_the_argument_of_the_call():
    step = ember.jit(lambda a: (a, a * 2))
    for x, _ in BATCHES[:4]:
        same, double = step(ember.tensor(x, device="cuda"))
        np.testing.assert_array_equal(same.numpy(), x)
        np.testing.assert_array_equal(double.numpy(), x * 2)
    assert step.stats["replays"] == 2


def test_numpy_arguments_are_not_replayed_from_stale_data():
    ember.manual_seed(0)
    w = ember.randn(4, device="cuda")
    step = ember.jit(lambda scale: (w * float(scale.sum())).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = [step(np.full(3, k, np.float32)).item() for k in range(4)]
    np.testing.assert_allclose(values, [w.sum().item() * 3 * k for k in range(4)], rtol=1e-6)
    assert step.stats["replays"] == 0


def test_a_copy_kept_while_another_shape_ran_keeps_its_value():
    model, opt = make()
    step = ember.jit(step_fn(model, opt))
    small = [(x[:3], y[:3]) for x, y in BATCHES]
    train(step, BATCHES[:3] + small[:3])  # both shapes recorded
    train(step, BATCHES[3:4])
    snapshot = model[0].weight.detach()
    before = snapshot.numpy().copy()
    train(step, small[3:4] + BATCHES[4:5])
    np.testing.assert_array_equal(snapshot.numpy(), before)


def test_switching_to_eval_mode_records_again():
    model, _ = make(dropout=0.5)
    step = ember.jit(lambda x: model(x))
    x = ember.tensor(BATCHES[0][0], device="cuda")
    for _ in range(3):
        step(x)
    model.eval()
    assert_same_values(step(x).numpy(), model(x).numpy())


@pytest.mark.parametrize("how", ["assign", "register", "delete and assign"])
def test_replacing_a_parameter_between_replays_records_again(how):
    model, _ = make()
    step = ember.jit(lambda x: model(x))
    x = ember.tensor(BATCHES[0][0], device="cuda")
    for _ in range(3):
        step(x)
    assert step.stats["replays"] == 1
    new = nn.Parameter(ember.tensor(RNG.standard_normal((16, 8)).astype(np.float32), device="cuda"))
    if how == "assign":
        model[0].weight = new
    elif how == "register":
        model[0].register_parameter("weight", new)
    else:
        del model[0].weight
        model[0].weight = new
    assert_same_values(step(x).numpy(), model(x).numpy())
    assert step.stats["captures"] == 2 and step.stats["replays"] == 1  # recorded anew, not replayed
    assert_same_values(step(x).numpy(), model(x).numpy())
    assert step.stats["replays"] == 2


def test_a_submodule_replaced_or_removed_between_replays_records_again():
    model, _ = make()
    head = model[2]
    step = ember.jit(lambda x: model(x) + head.weight.sum())  # also reads a weight without calling its module
    x = ember.tensor(BATCHES[0][0], device="cuda")
    for _ in range(3):
        step(x)
    model[2] = nn.Linear(16, 4).to("cuda")  # the layer the Sequential calls
    assert_same_values(step(x).numpy(), (model(x) + head.weight.sum()).numpy())
    with ember.no_grad():
        head.weight = nn.Parameter(head.weight * 2)  # read, its module not called
    for _ in range(2):
        assert_same_values(step(x).numpy(), (model(x) + head.weight.sum()).numpy())
    del model[1]  # the ReLU: no parameters change
    model.append(nn.ReLU())
    for _ in range(2):
        assert_same_values(step(x).numpy(), (model(x) + head.weight.sum()).numpy())


def test_a_step_replacing_a_parameter_itself_is_never_replayed_stale():
    def run(use_jit):
        ember.manual_seed(0)
        model = nn.Linear(8, 4).to("cuda")

        def step(x):
            y = model(x)
            with ember.no_grad():
                model.weight = nn.Parameter(model.weight * 0.5)
            return y
        step = ember.jit(step) if use_jit else step
        x = ember.tensor(BATCHES[0][0], device="cuda")
        return [step(x).numpy() for _ in range(5)]

    for a, b in zip(run(True), run(False)):
        assert_same_values(a, b)


def test_a_recorded_step_reads_what_another_recorded_step_updated():
    def run(use_jit):
        model, opt = make()
        train_step = step_fn(model, opt)
        evaluate = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
        if use_jit:
            train_step, evaluate = ember.jit(train_step), ember.jit(evaluate)
        batch = [ember.tensor(v, device="cuda") for v in BATCHES[0]]
        losses = [evaluate(*batch).item() for _ in range(2)]
        for x, y in BATCHES:
            train_step(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda"))
            losses.append(evaluate(*batch).item())
        return losses

    assert run(True) == run(False)


def test_a_recorded_update_that_clears_gradients_clears_them_each_replay():
    model, opt = make("sgd")

    @ember.jit
    def update():
        opt.step()
        opt.zero_grad()

    for x, y in BATCHES:
        F.cross_entropy(model(ember.tensor(x, device="cuda")), ember.tensor(y, device="cuda")).backward()
        ember.realize(*(p.grad for p in model.parameters()))  # gradients from outside, computed first
        update()
        assert all(p.grad is None for p in model.parameters())
    reference, ref_opt = make("sgd")
    for x, y in BATCHES:
        F.cross_entropy(reference(ember.tensor(x, device="cuda")), ember.tensor(y, device="cuda")).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(params(model), params(reference)):
        assert_same_values(a, b)


def test_gradients_of_a_backward_pass_outside_the_step_are_not_replayed():
    model, opt = make("sgd")
    update = ember.jit(lambda: opt.step())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in BATCHES[:4]:
            opt.zero_grad()
            F.cross_entropy(model(ember.tensor(x, device="cuda")), ember.tensor(y, device="cuda")).backward()
            update()
    assert update.stats["replays"] == 0 and "outside" in update.why_not_replayed[0]


def test_unfreezing_a_parameter_records_again():
    def run(use_jit):
        model, opt = make("sgd")
        model[0].weight.requires_grad_(False)
        step = ember.jit(step_fn(model, opt)) if use_jit else step_fn(model, opt)
        return train(step, BATCHES, lambda i: model[0].weight.requires_grad_(True) if i == 3 else None)

    assert run(True) == run(False)


def test_a_scheduler_stepped_inside_the_step_runs_as_written():
    def run(use_jit):
        model, opt = make()
        scheduler = ember.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        step = step_fn(model, opt)

        def with_schedule(x, y):
            loss = step(x, y)
            scheduler.step()
            return loss
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return train(ember.jit(with_schedule) if use_jit else with_schedule, BATCHES), opt.param_groups[0]["lr"]

    assert run(True) == run(False)


def test_float64_parameters_keep_a_float64_learning_rate():
    p = ember.ones(3, dtype=ember.float64, device="cuda", requires_grad=True)
    opt = ember.optim.SGD([p], lr=0.1)
    p.sum().backward()
    opt.step()
    np.testing.assert_array_equal(p.numpy(), np.full(3, 0.9))


def test_a_step_that_sets_the_mode_itself_is_replayed():
    model, opt = make(dropout=0.5)
    train_step = step_fn(model, opt)

    def train_mode_step(x, y):
        model.train()
        return train_step(x, y)

    def eval_step(x):
        model.eval()
        return model(x)

    jitted_train, jitted_eval = ember.jit(train_mode_step), ember.jit(eval_step)
    for x, y in BATCHES:
        jitted_train(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda"))
        jitted_eval(ember.tensor(x, device="cuda"))
    assert jitted_train.stats["replays"] == 4 and jitted_eval.stats["replays"] >= 3


def test_two_returned_values_the_plan_stores_once_are_both_written_by_each_replay():
    """Two results of one value (two nodes the compiler computes once, as a template's outputs that name the same
    node) share a slot: a replay into a fresh set of result buffers (the recording's still shown) writes both."""
    from ember.ir.template import recording, template

    def body(x):
        y = (x * 3).exp()
        return y, y * 1.0

    x0 = ember.randn(4, 5, device="cuda")
    with recording() as made:
        a, b = body(x0)
    built = template([x0._node], [a._node, a._node, b._node], made)

    def step(x):
        first, second, third = (ember.Tensor(n) for n in built.apply([x._node]))
        return first, second, third

    replayed = ember.jit(step)
    kept = []
    for _ in range(5):
        x = ember.randn(4, 5, device="cuda")
        outs = replayed(x)
        kept.append(outs)  # every set of results stays shown: each replay writes fresh buffers
        expected = np.exp(x.numpy() * 3)
        for out in outs:
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5)
    assert replayed.stats["replays"] >= 2


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_calls_before_the_recording_leave_no_arenas_behind(optimizer):
    """A step's first calls run plans its replays never run again (a first optimizer step creates its state): once
    the program exists, the thread keeps no arena for them, so the step's memory is the program's alone."""
    from ember.runtime import cuda

    model, opt = make(optimizer)
    step = ember.jit(step_fn(model, opt))
    batches = [(ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda")) for x, y in BATCHES]
    ember.realize(*(t for pair in batches for t in pair))
    before = set(cuda.this_thread.arenas)
    losses = [step(x, y) for x, y in batches[:4]]
    assert step.stats["captures"] == 1 and step.stats["replays"] >= 1, step.stats
    assert not set(cuda.this_thread.arenas) - before
    assert all(np.isfinite(loss.item()) for loss in losses)
