"""ember.optim against torch.optim: update trajectories, the one-graph step, schedules."""

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember import nn, optim
from ember.ir import Op
from ember.optim import lr_scheduler
from ember.recording import Recorder, record

torch = pytest.importorskip("torch")


def make_models(seed=0):
    """The same small MLP in torch and in ember."""
    torch.manual_seed(seed)
    theirs = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ours = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    ours.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in theirs.state_dict().items()})
    return theirs, ours


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((6, 5)).astype(np.float32), rng.integers(0, 3, 6)) for _ in range(steps)]


def train(model, opt, data, framework):
    losses = []
    for x, y in data:
        if framework == "torch":
            loss = torch.nn.functional.cross_entropy(model(torch.tensor(x)), torch.tensor(y))
        else:
            loss = F.cross_entropy(model(ember.tensor(x)), ember.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_same_parameters(theirs, ours, rtol=1e-5, atol=1e-6):
    for (name, tp), (_, ep) in zip(theirs.named_parameters(), ours.named_parameters()):
        np.testing.assert_allclose(ep.numpy(), tp.detach().numpy(), rtol=rtol, atol=atol, err_msg=name)


CONFIGS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.1, momentum=0.5, weight_decay=0.01)),
    ("SGD", dict(lr=0.01, momentum=0.9, maximize=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, amsgrad=True)),
    ("Adam", dict(lr=0.01, maximize=True)),
    ("AdamW", dict(lr=0.01)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
]


@pytest.mark.parametrize("name,kwargs", CONFIGS, ids=[f"{n}-{'-'.join(k)}" for n, k in CONFIGS])
def test_trajectory_over_ten_steps_matches_torch(name, kwargs):
    theirs, ours = make_models()
    topt = getattr(torch.optim, name)(theirs.parameters(), **kwargs, foreach=False)
    eopt = getattr(optim, name)(ours.parameters(), **kwargs)
    data = batches(10)
    tlosses = train(theirs, topt, data, "torch")
    elosses = train(ours, eopt, data, "ember")
    np.testing.assert_allclose(elosses, tlosses, rtol=1e-5)
    assert_same_parameters(theirs, ours)


def test_param_groups_with_their_own_hyper_parameters_match_torch():
    theirs, ours = make_models()
    tgroups = [{"params": theirs[0].parameters()}, {"params": theirs[2].parameters(), "lr": 0.001, "momentum": 0.5}]
    egroups = [{"params": ours[0].parameters()}, {"params": ours[2].parameters(), "lr": 0.001, "momentum": 0.5}]
    topt = torch.optim.SGD(tgroups, lr=0.1, momentum=0.9)
    eopt = optim.SGD(egroups, lr=0.1, momentum=0.9)
    assert eopt.param_groups[1]["lr"] == 0.001 and eopt.param_groups[0]["momentum"] == 0.9
    data = batches(5)
    train(theirs, topt, data, "torch")
    train(ours, eopt, data, "ember")
    assert_same_parameters(theirs, ours)


def test_add_param_group_takes_defaults_and_rejects_duplicates():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = optim.Adam(a.parameters(), lr=0.1)
    opt.add_param_group({"params": b.parameters(), "lr": 0.5})
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [a.weight]})


def test_step_computes_the_whole_step_at_once_and_leaves_no_history():
    _, model = make_models()
    opt = optim.Adam(model.parameters(), lr=0.01)
    params = list(model.parameters())
    for x, y in batches(2):
        loss = F.cross_entropy(model(ember.tensor(x)), ember.tensor(y))
        opt.zero_grad()
        loss.backward()
        assert not any(p.grad._node.realized for p in params)  # nothing computed yet
        opt.step()
        assert all(a is b for a, b in zip(model.parameters(), params))  # updated in place
        for p in params:
            assert p._node.op is Op.BUFFER and p.is_leaf and p.requires_grad
            assert p.grad._node.op is Op.BUFFER
            for value in opt.state[p].values():
                assert not isinstance(value, ember.Tensor) or value._node.op is Op.BUFFER


def test_step_skips_parameters_without_gradients_and_zero_grad_clears_them():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    opt = optim.SGD(model.parameters(), lr=0.1)
    before = model[0].weight.numpy()
    model(ember.randn(4, 3)).sum().backward()
    opt.step()
    np.testing.assert_array_equal(model[0].weight.numpy(), before)
    assert model[0].weight not in opt.state
    opt.zero_grad()
    assert model[1].weight.grad is None
    model(ember.randn(4, 3)).sum().backward()
    opt.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(model[1].weight.grad.numpy(), np.zeros((1, 3)))


def test_step_with_closure_returns_the_loss():
    _, model = make_models()
    opt = optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(ember.tensor(x)), ember.tensor(y))
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss._node.realized and np.isfinite(loss.item())


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam(nn.Linear(2, 2).parameters(), betas=(1.0, 0.9))


def test_optimizer_state_dict_has_torchs_layout():
    theirs, ours = make_models()
    topt = torch.optim.Adam(theirs.parameters(), lr=0.01, foreach=False)
    eopt = optim.Adam(ours.parameters(), lr=0.01)
    data = batches(2)
    train(theirs, topt, data, "torch")
    train(ours, eopt, data, "ember")
    tsd, esd = topt.state_dict(), eopt.state_dict()
    assert esd["param_groups"][0]["params"] == tsd["param_groups"][0]["params"]
    assert sorted(esd["state"]) == sorted(tsd["state"])
    assert set(esd["state"][0]) == set(tsd["state"][0])
    step = esd["state"][0]["step"]  # a 0-d float32 tensor, as torch keeps it
    assert isinstance(step, ember.Tensor) and step.shape == () and step.dtype is ember.float32
    assert tsd["state"][0]["step"].dtype == torch.float32 and step.item() == tsd["state"][0]["step"].item() == 2
    np.testing.assert_allclose(esd["state"][3]["exp_avg_sq"].numpy(), tsd["state"][3]["exp_avg_sq"].numpy(),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("saved_step", ["tensor", "number"])
@pytest.mark.parametrize("name,kwargs", [("Adam", dict(lr=0.01)), ("AdamW", dict(lr=0.01, amsgrad=True))])
def test_adam_resumed_from_its_state_dict_continues_as_torch_does(name, kwargs, saved_step):
    theirs, ours = make_models()
    topt = getattr(torch.optim, name)(theirs.parameters(), **kwargs, foreach=False)
    eopt = getattr(optim, name)(ours.parameters(), **kwargs)
    data = batches(6)
    train(theirs, topt, data[:3], "torch")
    train(ours, eopt, data[:3], "ember")
    saved = eopt.state_dict()
    if saved_step == "number":  # a checkpoint that holds the count as a Python number
        for values in saved["state"].values():
            values["step"] = int(values["step"].item())
    resumed = getattr(optim, name)(ours.parameters(), lr=0.5)  # the state dict brings back lr too
    resumed.load_state_dict(saved)
    for values in resumed.state.values():
        step = values["step"]
        assert isinstance(step, ember.Tensor) and step.shape == () and step.dtype is ember.float32
        assert step.item() == 3
    train(theirs, topt, data[3:], "torch")
    train(ours, resumed, data[3:], "ember")
    assert_same_parameters(theirs, ours)


def test_a_python_float_to_a_float32_tensor_power_is_float32(device):
    """Adam's bias correction `1 - beta ** step`, with the step count a 0-d float32 tensor."""
    step = ember.tensor(3.0)
    correction = 1 - 0.999**step
    assert correction.dtype is ember.float32 and correction.shape == () and correction.device.type == device
    assert correction.item() == pytest.approx(1 - 0.999**3, rel=1e-4)  # 0.999 rounds to float32


BF16_CONFIGS = [
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-3)),
    ("Adam", dict(lr=0.01, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
]


@pytest.mark.parametrize("name,kwargs", BF16_CONFIGS, ids=[f"{n}-{'-'.join(k)}" for n, k in BF16_CONFIGS])
def test_bfloat16_parameters_follow_torchs_bfloat16_adam(device, name, kwargs):
    """Each of torch's ops rounds to bfloat16 once and the bias corrections stay float32, so all but
    rare values are bit for bit torch's. (torch's CPU kernel rounds an L2 weight_decay to bfloat16, its
    CUDA kernel does not, nor does ember: those few values may be two roundings apart.)"""
    rng = np.random.default_rng(0)
    values = [rng.uniform(-1, 1, shape).astype(np.float32) for shape in [(40, 50), (64,), ()]]
    theirs = [torch.tensor(v).to(torch.bfloat16).requires_grad_() for v in values]
    ours = [nn.Parameter(ember.tensor(v, dtype=ember.bfloat16)) for v in values]
    topt = getattr(torch.optim, name)(theirs, **kwargs, foreach=False)
    eopt = getattr(optim, name)(ours, **kwargs)
    for _ in range(10):
        for t, e in zip(theirs, ours):
            g = rng.standard_normal(t.shape).astype(np.float32) * 0.1
            t.grad, e.grad = torch.tensor(g).to(torch.bfloat16), ember.tensor(g, dtype=ember.bfloat16)
        topt.step()
        eopt.step()
    for e in ours:
        assert e.dtype is ember.bfloat16 and eopt.state[e]["exp_avg"].dtype is ember.bfloat16
        step = eopt.state[e]["step"]
        assert step.dtype is ember.float32 and step.device == e.device and step.item() == 10
    got = np.concatenate([e.numpy().astype(np.float32).ravel() for e in ours])
    want = np.concatenate([t.detach().float().numpy().ravel() for t in theirs])
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=1e-3)
    assert np.mean(got == want) >= 0.97
    resumed = getattr(optim, name)(ours, **kwargs)
    resumed.load_state_dict(eopt.state_dict())
    for values in resumed.state.values():  # the count stays float32 next to bfloat16 moments
        assert values["step"].dtype is ember.float32 and values["exp_avg"].dtype is ember.bfloat16


@pytest.mark.slow
@pytest.mark.usefixtures("cuda_backend")
@pytest.mark.parametrize("name,kwargs", [("Adam", {}), ("AdamW", dict(amsgrad=True))])
def test_adam_step_over_fifty_cuda_parameters_is_two_launches(name, kwargs):
    """One launch counts every step up; one updates every parameter and moment, computing the bias
    corrections from the new counts as scalars (the counts must be stored before they are read)."""
    rng = np.random.default_rng(0)
    params = [nn.Parameter(ember.tensor(rng.standard_normal(rng.integers(1, 40, 2)).astype(np.float32),
                                        device="cuda")) for _ in range(50)]
    opt = getattr(optim, name)(params, lr=1e-3, **kwargs)
    for _ in range(2):  # the first step starts from zero state, the second from stored state
        for p in params:
            p.grad = ember.randn(*p.shape, device="cuda")
        ember.realize(*[p.grad for p in params])
        with ember.explain.capture() as plans:
            opt.step()
        assert sum(plan.launches for plan in plans) == 2


def test_step_guards_every_hyper_parameter_but_the_parameters_and_the_rate(monkeypatch):
    """A captured step (`ember.jit`) is replayed only while the hyper-parameters it read still hold; the
    learning rate is read from a tensor instead, which a replay brings up to date."""
    guards, refreshers = [], []
    monkeypatch.setattr(Recorder, "guard", lambda self, read: guards.append(read))
    monkeypatch.setattr(Recorder, "refresh", lambda self, update: refreshers.append(update))
    model = nn.Linear(3, 2)
    opt = optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=0.01)
    model(ember.randn(4, 3)).sum().backward()
    with record():
        opt.step()
    assert len(guards) == 1 and len(refreshers) == 1
    read = guards[0]
    before = read()
    opt.step()  # new state, the same hyper-parameters
    assert read() == before
    opt.param_groups[1]["lr"] = 0.05
    assert read() == before
    rate = opt._lr(opt.param_groups[1], model.bias.device, model.bias.dtype)
    assert rate.item() == pytest.approx(0.05)
    opt.param_groups[1]["lr"] = 0.02
    refreshers[0]()
    assert rate.item() == pytest.approx(0.02)  # the same Tensor shows the new rate
    opt.param_groups[0]["betas"] = (0.8, 0.999)
    assert read() != before


# -- schedules -----------------------------------------------------------------------------

def two_group_optimizer(framework, kind):
    """An SGD (with momentum) or Adam of two parameter groups with their own rates and momenta, in torch or ember."""
    lib = torch if framework == "torch" else ember
    first, second = lib.nn.Parameter(lib.zeros(1)), lib.nn.Parameter(lib.zeros(2))
    if kind == "SGD":
        return lib.optim.SGD([{"params": [first]}, {"params": [second], "lr": 0.05, "momentum": 0.5}],
                             lr=0.2, momentum=0.9)
    return lib.optim.Adam([{"params": [first]}, {"params": [second], "lr": 0.05, "betas": (0.8, 0.99)}], lr=0.2)


def group_values(opt):
    """Each group's learning rate and momentum (SGD's `momentum`, Adam's `betas`)."""
    return [(g["lr"], g.get("momentum"), g.get("betas")) for g in opt.param_groups]


# each made alike from torch.optim.lr_scheduler and from ember's: f(module, optimizer) -> scheduler
SCHEDULES = {
    "StepLR": lambda s, opt: s.StepLR(opt, step_size=3, gamma=0.5),
    "MultiStepLR": lambda s, opt: s.MultiStepLR(opt, milestones=[2, 5, 5, 9], gamma=0.3),
    "ExponentialLR": lambda s, opt: s.ExponentialLR(opt, gamma=0.9),
    "CosineAnnealingLR": lambda s, opt: s.CosineAnnealingLR(opt, T_max=7),
    "CosineAnnealingLR-eta_min": lambda s, opt: s.CosineAnnealingLR(opt, T_max=5, eta_min=0.01),
    "LambdaLR": lambda s, opt: s.LambdaLR(opt, lr_lambda=lambda epoch: 1 / (epoch + 1)),
    "LinearLR": lambda s, opt: s.LinearLR(opt),
    "LinearLR-down": lambda s, opt: s.LinearLR(opt, start_factor=0.9, end_factor=0.05, total_iters=11),
    "CosineAnnealingWarmRestarts": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=4, eta_min=0.01),
    "CosineAnnealingWarmRestarts-T_mult": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=3),
    "OneCycleLR": lambda s, opt: s.OneCycleLR(opt, max_lr=[1.0, 0.4], total_steps=25),
    "OneCycleLR-linear-three-phase": lambda s, opt: s.OneCycleLR(
        opt, max_lr=0.8, epochs=5, steps_per_epoch=5, pct_start=0.35, anneal_strategy="linear", three_phase=True,
        base_momentum=[0.7, 0.6], max_momentum=0.9, div_factor=10.0, final_div_factor=50.0),
    "OneCycleLR-without-momentum": lambda s, opt: s.OneCycleLR(opt, max_lr=0.5, total_steps=26, pct_start=0.5,
                                                               cycle_momentum=False),
    "SequentialLR": lambda s, opt: s.SequentialLR(opt, [s.LinearLR(opt, start_factor=0.1, total_iters=4),
                                                        s.CosineAnnealingLR(opt, T_max=6),
                                                        s.ExponentialLR(opt, gamma=0.8)], milestones=[5, 12]),
    "SequentialLR-into-StepLR-and-MultiStepLR": lambda s, opt: s.SequentialLR(
        opt, [s.ExponentialLR(opt, gamma=0.7), s.StepLR(opt, step_size=2, gamma=0.5),
              s.MultiStepLR(opt, milestones=[3, 4], gamma=0.5)], milestones=[3, 10]),
    "SequentialLR-into-LambdaLR-and-warm-restarts": lambda s, opt: s.SequentialLR(
        opt, [s.LambdaLR(opt, lambda epoch: epoch + 1), s.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2)],
        milestones=[4]),
    "ChainedScheduler": lambda s, opt: s.ChainedScheduler([s.LinearLR(opt, start_factor=0.5, total_iters=6),
                                                           s.ExponentialLR(opt, gamma=0.9)]),
}


def run_schedule(opt, scheduler, steps):
    values = [group_values(opt)]
    for _ in range(steps):
        opt.step()
        scheduler.step()
        values.append(group_values(opt))
        assert scheduler.get_last_lr() == [lr for lr, _, _ in values[-1]]
    return values


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_learning_rates_and_momenta_of_every_group_match_torch_to_the_bit(name, kind):
    """25 steps cover every phase of each schedule (warm-up, restarts, milestones, each cycle's phases)."""
    topt, eopt = two_group_optimizer("torch", kind), two_group_optimizer("ember", kind)
    theirs = run_schedule(topt, SCHEDULES[name](torch.optim.lr_scheduler, topt), 25)
    ours = run_schedule(eopt, SCHEDULES[name](lr_scheduler, eopt), 25)
    assert ours == theirs


def test_one_cycle_cycles_sgds_momentum_and_adams_first_beta():
    sgd, adam = two_group_optimizer("ember", "SGD"), two_group_optimizer("ember", "Adam")
    for opt in (sgd, adam):
        lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10, base_momentum=0.8, max_momentum=0.9)
    assert [g["momentum"] for g in sgd.param_groups] == [0.9, 0.9]
    assert [g["betas"] for g in adam.param_groups] == [(0.9, 0.999), (0.9, 0.99)]


def test_one_cycle_refuses_to_step_past_total_steps_as_torch_does():
    messages = []
    for framework, schedulers in (("torch", torch.optim.lr_scheduler), ("ember", lr_scheduler)):
        opt = two_group_optimizer(framework, "SGD")
        scheduler = schedulers.OneCycleLR(opt, max_lr=1.0, total_steps=3)
        for _ in range(3):
            opt.step()
            scheduler.step()
        with pytest.raises(ValueError) as error:
            scheduler.step()
        messages.append(str(error.value))
    assert messages[0] == messages[1] == "Tried to step 4 times. The specified number of total steps is 3"


@pytest.mark.parametrize("T_mult", [1, 2])
def test_warm_restarts_stepped_with_fractional_epochs_match_torch(T_mult):  # noqa: N803
    """`step(epoch + batch / batches)` once per batch, as torch's documentation shows."""
    values = []
    for framework, schedulers in (("torch", torch.optim.lr_scheduler), ("ember", lr_scheduler)):
        opt = two_group_optimizer(framework, "SGD")
        scheduler = schedulers.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=T_mult, eta_min=0.001)
        lrs = []
        for epoch in range(9):
            for batch in range(4):
                opt.step()
                scheduler.step(epoch + batch / 4)
                lrs.append((scheduler.get_last_lr(), scheduler.T_cur, scheduler.T_i, scheduler.last_epoch))
        values.append(lrs)
    assert values[0] == values[1]


# a first plateau (bad epochs, a reduction, a cooldown), an improvement that resets the count, one smaller than the
# threshold that does not, then a long plateau: a reduction every patience + cooldown + 1 epochs down to min_lr
PLATEAU_METRICS = [1.0, 0.8, 0.8, 0.81, 0.8, 0.8, 0.8, 0.8, 0.7, 0.69995, 0.7] + [0.7] * 17


@pytest.mark.parametrize("threshold_mode", ["rel", "abs"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_reduce_on_plateau_waits_patience_then_cools_down_and_stops_at_min_lr_as_torch_does(mode, threshold_mode):
    """A plateau reduces the rates after `patience` bad epochs, then ignores `cooldown` epochs; the rates stop at
    each group's min_lr; an improvement smaller than `threshold` is not one."""
    metrics = PLATEAU_METRICS if mode == "min" else [2 - m for m in PLATEAU_METRICS]  # the same run, upside down
    kwargs = dict(mode=mode, factor=0.5, patience=2, threshold=1e-3, threshold_mode=threshold_mode, cooldown=2,
                  min_lr=[0.02, 0.01])
    runs = []
    for framework, schedulers in (("torch", torch.optim.lr_scheduler), ("ember", lr_scheduler)):
        opt = two_group_optimizer(framework, "SGD")
        scheduler = schedulers.ReduceLROnPlateau(opt, **kwargs)
        run = [scheduler.get_last_lr()]
        for metric in metrics:
            opt.step()
            scheduler.step((torch if framework == "torch" else ember).tensor(metric))  # a 0-d float32 tensor
            run.append((scheduler.get_last_lr(), scheduler.best, scheduler.num_bad_epochs,
                        scheduler.cooldown_counter, scheduler.in_cooldown, scheduler.last_epoch))
        runs.append(run)
    assert runs[1] == runs[0]
    lrs = [step[0] for step in runs[1][1:]]
    assert lrs[-1] == [0.02, 0.01] and lrs[-2] == lrs[-1]  # the sequence reaches min_lr and stays there
    assert len({tuple(lr) for lr in lrs}) >= 4  # several reductions


def test_reduce_on_plateau_takes_one_min_lr_for_all_groups():
    opt = two_group_optimizer("ember", "SGD")
    scheduler = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1, min_lr=0.01)
    for _ in range(4):
        scheduler.step(1.0)
    assert scheduler.get_last_lr() == [0.01, 0.01]


RESUMABLE = {**SCHEDULES, "ReduceLROnPlateau": lambda s, opt: s.ReduceLROnPlateau(opt, patience=1, cooldown=1)}


def step_scheduler(opt, scheduler, i):
    opt.step()
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(PLATEAU_METRICS[i])
    else:
        scheduler.step()
    return group_values(opt), scheduler.get_last_lr()


@pytest.mark.parametrize("name", RESUMABLE)
def test_a_scheduler_loaded_from_a_state_dict_continues_the_schedule(name):
    opt = two_group_optimizer("ember", "Adam")
    scheduler = RESUMABLE[name](lr_scheduler, opt)
    for i in range(7):
        step_scheduler(opt, scheduler, i)
    state = scheduler.state_dict()
    assert "optimizer" not in state
    resumed_opt = two_group_optimizer("ember", "Adam")
    resumed = RESUMABLE[name](lr_scheduler, resumed_opt)
    resumed_opt.load_state_dict(opt.state_dict())
    resumed.load_state_dict(state)
    for i in range(7, 20):
        assert step_scheduler(resumed_opt, resumed, i) == step_scheduler(opt, scheduler, i)


def test_scheduler_state_dict_resumes_the_schedule():
    opt = optim.SGD([nn.Parameter(ember.zeros(1))], lr=0.2)
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(4):
        sched.step()
    state = sched.state_dict()
    opt2 = optim.SGD([nn.Parameter(ember.zeros(1))], lr=0.2)
    sched2 = lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


# each made from torch.optim.lr_scheduler and from ember's: f(module, optimizer) raises
BAD_SCHEDULES = {
    "not-an-optimizer": lambda s, opt: s.OneCycleLR(object(), max_lr=1.0, total_steps=3),
    "LinearLR-start_factor-0": lambda s, opt: s.LinearLR(opt, start_factor=0),
    "LinearLR-start_factor-above-1": lambda s, opt: s.LinearLR(opt, start_factor=1.5),
    "LinearLR-end_factor-negative": lambda s, opt: s.LinearLR(opt, end_factor=-0.1),
    "warm-restarts-T_0-0": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=0),
    "warm-restarts-T_0-float": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=2.5),
    "warm-restarts-T_mult-0": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=0),
    "warm-restarts-eta_min-str": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=2, eta_min="0"),
    "warm-restarts-negative-epoch": lambda s, opt: s.CosineAnnealingWarmRestarts(opt, T_0=2).step(-1),
    "OneCycleLR-no-length": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0),
    "OneCycleLR-total_steps-0": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, total_steps=0),
    "OneCycleLR-epochs-0": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, epochs=0, steps_per_epoch=2),
    "OneCycleLR-steps_per_epoch-negative": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, epochs=2,
                                                                       steps_per_epoch=-1),
    "OneCycleLR-pct_start-1.5": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, total_steps=9, pct_start=1.5),
    "OneCycleLR-pct_start-int": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, total_steps=9, pct_start=1),
    "OneCycleLR-anneal_strategy": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, total_steps=9, anneal_strategy="exp"),
    "OneCycleLR-max_lr-per-group": lambda s, opt: s.OneCycleLR(opt, max_lr=[1.0, 2.0, 3.0], total_steps=9),
    "OneCycleLR-momentum-per-group": lambda s, opt: s.OneCycleLR(opt, max_lr=1.0, total_steps=9,
                                                                 max_momentum=[0.9]),
    "SequentialLR-empty": lambda s, opt: s.SequentialLR(opt, [], []),
    "SequentialLR-milestones": lambda s, opt: s.SequentialLR(opt, [s.StepLR(opt, 2), s.StepLR(opt, 3)], [1, 2]),
    "SequentialLR-plateau": lambda s, opt: s.SequentialLR(opt, [s.ReduceLROnPlateau(opt)], []),
    "SequentialLR-not-a-scheduler": lambda s, opt: s.SequentialLR(opt, [object()], []),
    "ChainedScheduler-empty": lambda s, opt: s.ChainedScheduler([]),
    "ReduceLROnPlateau-factor": lambda s, opt: s.ReduceLROnPlateau(opt, factor=1.0),
    "ReduceLROnPlateau-mode": lambda s, opt: s.ReduceLROnPlateau(opt, mode="avg"),
    "ReduceLROnPlateau-threshold_mode": lambda s, opt: s.ReduceLROnPlateau(opt, threshold_mode="pct"),
    "ReduceLROnPlateau-min_lr-per-group": lambda s, opt: s.ReduceLROnPlateau(opt, min_lr=[0.1]),
}


@pytest.mark.parametrize("name", BAD_SCHEDULES)
def test_bad_scheduler_arguments_raise_torchs_errors(name):
    errors = []
    for framework, schedulers in (("torch", torch.optim.lr_scheduler), ("ember", lr_scheduler)):
        with pytest.raises(Exception) as error:
            BAD_SCHEDULES[name](schedulers, two_group_optimizer(framework, "SGD"))
        errors.append((type(error.value), str(error.value)))
    assert errors[1] == errors[0]


def test_schedulers_of_another_optimizer_are_refused():
    opt, other = two_group_optimizer("ember", "SGD"), two_group_optimizer("ember", "SGD")
    with pytest.raises(ValueError, match="expects all schedulers to belong to the same optimizer"):
        lr_scheduler.SequentialLR(opt, [lr_scheduler.StepLR(other, 2)], [])
    with pytest.raises(ValueError, match="expects all schedulers to belong to the same optimizer"):
        lr_scheduler.ChainedScheduler([lr_scheduler.StepLR(opt, 2), lr_scheduler.StepLR(other, 2)])


@pytest.mark.usefixtures("cuda_backend")
@pytest.mark.parametrize("amsgrad", [False, True])
def test_an_adam_training_loop_compiles_one_plan(amsgrad):
    """Adam's state starts as zero buffers, not pending constants, made before the first update, and every
    update, the first included, is built from a template: the first step's graph is every later step's, so the
    loop compiles one plan."""
    from ember.runtime import cuda, plan_cache

    plan_cache.clear()
    ember.manual_seed(3)
    model = ember.nn.Sequential(ember.nn.Linear(5, 7), ember.nn.Tanh(), ember.nn.Linear(7, 7), ember.nn.Tanh(),
                                ember.nn.Linear(7, 7), ember.nn.Tanh(), ember.nn.Linear(7, 2)).to("cuda")
    opt = ember.optim.Adam(model.parameters(), lr=0.01, amsgrad=amsgrad)
    x = ember.randn(6, 5, device="cuda").realize()
    compiled = []
    for _ in range(4):
        before = cuda.stats["plans_compiled"] + cuda.stats["plans_loaded"]
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        loss.item()
        compiled.append(cuda.stats["plans_compiled"] + cuda.stats["plans_loaded"] - before)
    assert compiled[0] >= 1 and compiled[1:] == [0, 0, 0]
