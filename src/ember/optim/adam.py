"""Adam and AdamW, with bias correction, amsgrad and maximize as in PyTorch."""

from __future__ import annotations

from collections.abc import Iterable

from ember.ops.creation import zeros_like
from ember.ops.pointwise import maximum
from ember.optim.optimizer import Optimizer
from ember.tensor import Tensor


def _lerp(start: Tensor, end: Tensor, weight: float) -> Tensor:
    """start + weight * (end - start), evaluated from the nearer end as torch.lerp does."""
    if weight < 0.5:
        return start + (end - start) * weight
    return end - (end - start) * (1 - weight)


class Adam(Optimizer):
    """torch.optim.Adam; weight decay is added to the gradient (L2), unlike AdamW's decoupled decay."""

    _decoupled_weight_decay = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        name = type(self).__name__
        if lr < 0.0:
            raise ValueError(f"{name}: invalid learning rate {lr}")
        if eps < 0.0:
            raise ValueError(f"{name}: invalid epsilon {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{name}: invalid betas {betas}; each must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"{name}: invalid weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize))

    def _update(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        if not state:
            state["step"] = 0
            state["exp_avg"] = zeros_like(param)
            state["exp_avg_sq"] = zeros_like(param)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = zeros_like(param)
        if group["maximize"]:
            grad = -grad
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"]
        if weight_decay != 0:
            if self._decoupled_weight_decay:
                param.assign(param * (1 - lr * weight_decay))
            else:
                grad = grad + param * weight_decay
        exp_avg = state["exp_avg"].assign(_lerp(state["exp_avg"], grad, 1 - beta1))
        exp_avg_sq = state["exp_avg_sq"].assign(state["exp_avg_sq"] * beta2 + grad * (1 - beta2) * grad)
        # lr and the step count enter as Python floats, not as tensors of the graph
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        if group["amsgrad"]:
            second_moment = state["max_exp_avg_sq"].assign(maximum(state["max_exp_avg_sq"], exp_avg_sq))
        else:
            second_moment = exp_avg_sq
        denom = second_moment.sqrt() / bias_correction2_sqrt + eps
        param.assign(param + exp_avg / denom * -step_size)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with weight decay applied to the parameters directly (decoupled)."""

    _decoupled_weight_decay = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
