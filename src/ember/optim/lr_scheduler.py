"""Learning-rate schedules, with torch.optim.lr_scheduler's names and update rules.

A scheduler rewrites `group["lr"]` of its optimizer's parameter groups at every
`step()`. The rules are PyTorch's recursive forms, so the learning rates match
PyTorch's to the last bit in the usual loop (optimizer.step(), then scheduler.step()).
Where torch has a closed form too (the rate at an epoch from the base rates alone), so
does ember: SequentialLR starts each scheduler after the first from it. OneCycleLR also
sets the momentum; ReduceLROnPlateau is stepped with a metric and sets nothing otherwise.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable

from ember.optim.optimizer import Optimizer
from ember.runtime import executor


def _expect_optimizer(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")


def _cosine(base: float, eta_min: float, t: float, period: float) -> float:
    """The rate `t` epochs into half a cosine from `base` down to `eta_min` over `period` epochs."""
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / period)) / 2


def _outside_a_recording() -> None:
    # a replay does not run Python: the rate a scheduler would set is read before each replay instead
    recorder = executor.this_thread.recorder
    if recorder is not None:
        recorder.fail("it steps a learning-rate scheduler inside itself; step the scheduler outside the step")


class LRScheduler:
    """Base class: subclasses implement `get_lr()`, the rates of epoch `last_epoch` (recursive, from the current
    rates), and where torch has one, `_closed_form_lr()` (from `base_lrs` alone: what SequentialLR sets when it
    hands over to a scheduler at a milestone)."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        _expect_optimizer(optimizer)
        self.optimizer = optimizer
        for i, group in enumerate(optimizer.param_groups):
            if last_epoch == -1:
                group.setdefault("initial_lr", group["lr"])
            elif "initial_lr" not in group:
                raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a "
                               "scheduler with last_epoch >= 0 (load the optimizer's state dict first)")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        """The step a scheduler takes when it is made: it sets the rates of epoch `last_epoch + 1`."""
        self._step_count = 0
        self._is_initial = True
        self.step()
        self._is_initial = False

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def get_last_lr(self) -> list[float]:
        """The learning rates the last `step()` set."""
        return self._last_lr

    def step(self) -> None:
        _outside_a_recording()
        self._step_count += 1
        self._update_lr()

    def _update_lr(self, epoch: int | None = None) -> None:
        """Set the rates of the next epoch, or of `epoch` (from the closed form)."""
        if epoch is None:
            self.last_epoch += 1
            self._set_lrs(self.get_lr())
        else:
            self.last_epoch = epoch
            self._set_lrs(self._closed_form_lr())

    def _set_lrs(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = self._group_lrs()

    def _group_lrs(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    _unsaved = ("optimizer",)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._unsaved}

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update(state_dict)


class LambdaLR(LRScheduler):
    """lr = base_lr * lr_lambda(epoch), one function for all groups or one per group."""

    _unsaved = ("optimizer", "lr_lambdas")

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Iterable[Callable[[int], float]],
                 last_epoch: int = -1) -> None:
        groups = len(optimizer.param_groups)
        self.lr_lambdas = list(lr_lambda) if not callable(lr_lambda) else [lr_lambda] * groups
        if len(self.lr_lambdas) != groups:
            raise ValueError(f"LambdaLR: expected {groups} lr_lambdas, got {len(self.lr_lambdas)}")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs)]


class StepLR(LRScheduler):
    """Multiply the learning rate by gamma every `step_size` epochs."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]

    def _closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Multiply the learning rate by gamma at each milestone epoch."""

    def __init__(self, optimizer: Optimizer, milestones: Iterable[int], gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        self.milestones, self.gamma = Counter(milestones), gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch not in self.milestones:
            return self._group_lrs()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._group_lrs()]

    def _closed_form_lr(self) -> list[float]:
        passed = bisect_right(sorted(self.milestones.elements()), self.last_epoch)
        return [base * self.gamma ** passed for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """Multiply the learning rate by gamma every epoch."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]

    def _closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Anneal from base_lr to eta_min along half a cosine over T_max epochs (then back up, periodically)."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:  # noqa: N803
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        epoch, t_max, eta_min = self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return self._group_lrs()
        if self._step_count == 1 and epoch > 0:
            return self._closed_form_lr()
        if (epoch - 1 - t_max) % (2 * t_max) == 0:
            return [lr + (base - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
                    for base, lr in zip(self.base_lrs, self._group_lrs())]
        return [(1 + math.cos(math.pi * epoch / t_max)) / (1 + math.cos(math.pi * (epoch - 1) / t_max))
                * (lr - eta_min) + eta_min for lr in self._group_lrs()]

    def _closed_form_lr(self) -> list[float]:
        return [_cosine(base, self.eta_min, self.last_epoch, self.T_max) for base in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale the learning rate by a factor going linearly from start_factor to end_factor over total_iters epochs."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1) -> None:
        if start_factor > 1.0 or start_factor <= 0:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if end_factor > 1.0 or end_factor < 0:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        start, change = self.start_factor, self.end_factor - self.start_factor
        if self.last_epoch == 0:
            return [lr * start for lr in self._group_lrs()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._group_lrs()
        return [lr * (1.0 + change / (self.total_iters * start + (self.last_epoch - 1) * change))
                for lr in self._group_lrs()]

    def _closed_form_lr(self) -> list[float]:
        start, change = self.start_factor, self.end_factor - self.start_factor
        return [base * (start + change * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing from base_lr to eta_min over T_i epochs, restarting at base_lr with T_i = T_0, T_0 * T_mult,
    ... `step(epoch)` may be given a fractional epoch (a step per batch: epoch + batch / batches)."""

    def __init__(self, optimizer: Optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0,  # noqa: N803
                 last_epoch: int = -1) -> None:
        if T_0 <= 0 or not isinstance(T_0, int):
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if T_mult < 1 or not isinstance(T_mult, int):
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        if not isinstance(eta_min, (float, int)):
            raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}")
        self.T_0 = self.T_i = T_0
        self.T_mult, self.eta_min = T_mult, eta_min
        self.T_cur = last_epoch  # epochs since the last restart
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [_cosine(base, self.eta_min, self.T_cur, self.T_i) for base in self.base_lrs]

    def step(self, epoch: float | None = None) -> None:
        _outside_a_recording()
        if epoch is None and self.last_epoch < 0:
            epoch = 0
        if epoch is None:
            epoch = self.last_epoch + 1
            self.T_cur += 1
            if self.T_cur >= self.T_i:
                self.T_cur, self.T_i = self.T_cur % self.T_i, self.T_i * self.T_mult
        elif epoch < 0:
            raise ValueError(f"Expected non-negative epoch, but got {epoch}")
        elif epoch >= self.T_0 and self.T_mult == 1:
            self.T_cur = epoch % self.T_0
        elif epoch >= self.T_0:  # in restart n, which began at epoch T_0 * (T_mult^n - 1) / (T_mult - 1)
            n = int(math.log(epoch / self.T_0 * (self.T_mult - 1) + 1, self.T_mult))
            self.T_cur = epoch - self.T_0 * (self.T_mult**n - 1) / (self.T_mult - 1)
            self.T_i = self.T_0 * self.T_mult**n
        else:
            self.T_i, self.T_cur = self.T_0, epoch
        self.last_epoch = math.floor(epoch)
        self._set_lrs(self.get_lr())


def _per_group(name: str, optimizer: Optimizer, value) -> list:
    """A setting given once for all parameter groups or as one value per group, as a list with one per group."""
    groups = len(optimizer.param_groups)
    if not isinstance(value, (list, tuple)):
        return [value] * groups
    if len(value) != groups:
        raise ValueError(f"{name} must have the same length as optimizer.param_groups. "
                         f"{name} has {len(value)} values, param_groups has {groups}.")
    return list(value)


class OneCycleLR(LRScheduler):
    """The 1cycle policy, stepped once per batch: the rate rises from max_lr / div_factor to max_lr over the first
    pct_start of total_steps, then falls to max_lr / div_factor / final_div_factor (three_phase: back down to the
    start first). With cycle_momentum, the momentum (SGD's `momentum`, Adam's `betas[0]`) moves the other way,
    between max_momentum and base_momentum. Each phase anneals along a cosine or a line (anneal_strategy).

    Unlike the learning rate, the momentum is a hyper-parameter that a step captured by `ember.jit` guards: with
    cycle_momentum, every call of such a step is recorded again rather than replayed."""

    def __init__(self, optimizer: Optimizer, max_lr: float | list[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float | list[float] = 0.85, max_momentum: float | list[float] = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1) -> None:
        _expect_optimizer(optimizer)
        if total_steps is not None:
            if total_steps <= 0 or not isinstance(total_steps, int):
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            self.total_steps = total_steps
        elif epochs is not None and steps_per_epoch is not None:
            if not isinstance(epochs, int) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
                raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        if pct_start < 0 or pct_start > 1 or not isinstance(pct_start, float):
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
        self.anneal_strategy = anneal_strategy
        # (last step, then the group settings the rate and the momentum go from and to) per phase
        rise = (float(pct_start * self.total_steps) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum")
        if three_phase:
            self._phases = [rise, (float(2 * pct_start * self.total_steps) - 2, "max_lr", "initial_lr",
                                   "base_momentum", "max_momentum"),
                            (self.total_steps - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum")]
        else:
            self._phases = [rise, (self.total_steps - 1, "max_lr", "min_lr", "base_momentum", "max_momentum")]
        max_lrs = _per_group("max_lr", optimizer, max_lr)
        if last_epoch == -1:
            for group, top in zip(optimizer.param_groups, max_lrs):
                group["initial_lr"] = top / div_factor
                group["max_lr"] = top
                group["min_lr"] = group["initial_lr"] / final_div_factor
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
            self.use_beta1 = "betas" in optimizer.defaults
            highs = _per_group("max_momentum", optimizer, max_momentum)
            lows = _per_group("base_momentum", optimizer, base_momentum)
            if last_epoch == -1:
                for group, high, low in zip(optimizer.param_groups, highs, lows):
                    self._set_momentum(group, high)
                    group["max_momentum"], group["base_momentum"] = high, low
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, group: dict, momentum: float) -> None:
        if self.use_beta1:
            group["betas"] = (momentum, *group["betas"][1:])
        else:
            group["momentum"] = momentum

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _phase(self, step: int) -> tuple[tuple, float]:
        """The phase `step` is in, and how far into it (0 at its start, 1 at its last step)."""
        start = 0.0
        for phase in self._phases[:-1]:
            if step <= phase[0]:
                return phase, (step - start) / (phase[0] - start)
            start = phase[0]
        return self._phases[-1], (step - start) / (self._phases[-1][0] - start)

    def get_lr(self) -> list[float]:
        """The rates of step `last_epoch`; sets the momentum of that step too (with cycle_momentum)."""
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times. The specified number of total steps is {self.total_steps}")
        (_, lr_from, lr_to, momentum_from, momentum_to), pct = self._phase(step)
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                self._set_momentum(group, self._anneal(group[momentum_from], group[momentum_to], pct))
        return [self._anneal(group[lr_from], group[lr_to], pct) for group in self.optimizer.param_groups]


class _SchedulerOfSchedulers(LRScheduler):
    """A scheduler that steps others of the same optimizer (SequentialLR, ChainedScheduler); their states are
    saved within its own."""

    _unsaved = ("optimizer", "_schedulers")

    def _check(self, optimizer: Optimizer, schedulers: list[LRScheduler]) -> None:
        name = type(self).__name__
        for i, scheduler in enumerate(schedulers):
            if not hasattr(scheduler, "optimizer"):
                raise TypeError(f"{name} at index {i} should have `optimizer` as its attribute.")
            if isinstance(scheduler, ReduceLROnPlateau):
                raise ValueError(f"{name} does not support `ReduceLROnPlateau` scheduler as it requires additional "
                                 f"kwargs to be specified when calling `step`, but got one at index {i} in the "
                                 "given schedulers sequence.")
            if optimizer != scheduler.optimizer:
                raise ValueError(f"{name} expects all schedulers to belong to the same optimizer, but got "
                                 f"scheduler {type(scheduler).__name__} at index {i} has {scheduler.optimizer}, "
                                 f"which is different from {type(optimizer).__name__}.")

    def state_dict(self) -> dict:
        return {**super().state_dict(), "_schedulers": [s.state_dict() for s in self._schedulers]}

    def load_state_dict(self, state_dict: dict) -> None:
        own = dict(state_dict)
        for scheduler, state in zip(self._schedulers, own.pop("_schedulers")):
            scheduler.load_state_dict(state)
        super().load_state_dict(own)


def _undo_initial_steps(scheduler: LRScheduler) -> None:
    """Take back the step each scheduler took when it was made (in schedulers of schedulers too)."""
    if hasattr(scheduler, "_schedulers"):
        for inner in scheduler._schedulers:
            _undo_initial_steps(inner)
    elif hasattr(scheduler, "last_epoch"):
        scheduler.last_epoch -= 1


class SequentialLR(_SchedulerOfSchedulers):
    """Step schedulers[0] until milestones[0], then schedulers[1] (from its epoch 0) until milestones[1], ..."""

    def __init__(self, optimizer: Optimizer, schedulers: list[LRScheduler], milestones: list[int],
                 last_epoch: int = -1) -> None:
        if len(schedulers) < 1:
            raise ValueError(f"{type(self).__name__} expects at least one scheduler, but got no scheduler.")
        self._check(optimizer, schedulers)
        if len(milestones) != len(schedulers) - 1:
            raise ValueError("Sequential Schedulers expects number of schedulers provided to be one more than the "
                             f"number of milestone points, but got number of schedulers {len(schedulers)} and the "
                             f"number of milestones to be equal to {len(milestones)}")
        self._schedulers, self._milestones = schedulers, milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        _undo_initial_steps(self)
        first = schedulers[bisect_right(milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def step(self) -> None:
        _outside_a_recording()
        self.last_epoch += 1
        index = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[index]
        if index > 0 and self._milestones[index - 1] == self.last_epoch:
            scheduler._update_lr(0)  # its epoch 0, from its closed form
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()


class ChainedScheduler(_SchedulerOfSchedulers):
    """Step every scheduler of the chain at each step, in order: their changes to the rates compose."""

    def __init__(self, schedulers: list[LRScheduler], optimizer: Optimizer | None = None) -> None:
        if len(schedulers) < 1:
            raise ValueError(f"{type(self).__name__} expects at least one scheduler to be chained, "
                             "but got no scheduler.")
        optimizer = optimizer or schedulers[0].optimizer
        self._check(optimizer, schedulers)
        self._schedulers, self.optimizer = schedulers, optimizer
        self._last_lr = self._group_lrs()

    def step(self) -> None:
        for scheduler in self._schedulers:
            scheduler.step()
        self._last_lr = self._group_lrs()


class ReduceLROnPlateau(LRScheduler):
    """Multiply the rates by `factor` (down to `min_lr`) once a metric has not improved (by more than `threshold`,
    relative or absolute) for more than `patience` epochs, then ignore `cooldown` epochs. `step(metrics)` takes the
    metric (a number or a 0-d Tensor, read on the host). It sets no rate when made, and has no `get_lr()`."""

    def __init__(self, optimizer: Optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0,
                 min_lr: float | list[float] = 0, eps: float = 1e-8) -> None:
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        self.factor = factor
        _expect_optimizer(optimizer)
        self.optimizer = optimizer
        groups = len(optimizer.param_groups)
        if isinstance(min_lr, (list, tuple)):
            if len(min_lr) != groups:
                raise ValueError(f"expected {groups} min_lrs, got {len(min_lr)}")
            self.default_min_lr, self.min_lrs = None, list(min_lr)
        else:
            self.default_min_lr, self.min_lrs = min_lr, [min_lr] * groups
        self.patience, self.cooldown, self.eps = patience, cooldown, eps
        self.last_epoch = 0
        self._last_lr = self._group_lrs()
        self._init_is_better(mode, threshold, threshold_mode)
        self._reset()

    def _init_is_better(self, mode: str, threshold: float, threshold_mode: str) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        self.mode_worse = math.inf if mode == "min" else -math.inf
        self.mode, self.threshold, self.threshold_mode = mode, threshold, threshold_mode

    def _reset(self) -> None:
        self.best = self.mode_worse
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    @property
    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def _is_better(self, a: float, best: float) -> bool:
        rel = self.threshold_mode == "rel"
        if self.mode == "min":
            return a < (best * (1.0 - self.threshold) if rel else best - self.threshold)
        return a > (best * (self.threshold + 1.0) if rel else best + self.threshold)

    def step(self, metrics) -> None:
        _outside_a_recording()
        current = float(metrics)
        self.last_epoch += 1
        if self._is_better(current, self.best):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad epochs in the cooldown do not count
        if self.num_bad_epochs > self.patience:
            self._reduce_lr()
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = self._group_lrs()

    def _reduce_lr(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.min_lrs):
            if self.default_min_lr is None:
                raise RuntimeError(f"The number of param groups in the `optimizer` ({len(groups)}) differs from when "
                                   f"`ReduceLROnPlateau` was initialized ({len(self.min_lrs)}), usually due to a new "
                                   "param group being added to the optimizer. Please modify the `min_lrs` field to "
                                   "match the length of the `optimizer` param groups.")
            self.min_lrs = [self.default_min_lr] * len(groups)
        for group, min_lr in zip(groups, self.min_lrs):
            old = float(group["lr"])
            new = max(old * self.factor, min_lr)
            if old - new > self.eps:
                group["lr"] = new

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._init_is_better(self.mode, self.threshold, self.threshold_mode)
