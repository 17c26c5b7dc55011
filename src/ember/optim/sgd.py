"""Stochastic gradient descent with momentum, dampening, Nesterov momentum and weight decay."""

from __future__ import annotations

from collections.abc import Iterable

from ember.optim.optimizer import TEMPLATED, Optimizer
from ember.tensor import Tensor


class SGD(Optimizer):
    """torch.optim.SGD, update for update:

    g = ±grad + weight_decay * p;  buf = momentum * buf + (1 - dampening) * g (buf = g at the first step);
    g = g + momentum * buf (nesterov) or buf;  p = p - lr * g
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"SGD: invalid learning rate {lr}")
        if momentum < 0.0:
            raise ValueError(f"SGD: invalid momentum {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"SGD: invalid weight_decay {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize))

    def _update(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        if group["maximize"]:
            grad = -grad
        if group["weight_decay"] != 0:
            grad = grad + param * group["weight_decay"]
        momentum = group["momentum"]
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.detach()
            else:
                buf.assign(buf * momentum + grad * (1 - group["dampening"]))
            grad = grad + buf * momentum if group["nesterov"] else buf
        param.assign(param - grad * self._lr(group, param.device, param.dtype))


TEMPLATED.add(SGD._update)
