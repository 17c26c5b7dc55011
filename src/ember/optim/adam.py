"""Adam and AdamW, with bias correction, amsgrad and maximize as in PyTorch.

The step count is a 0-d float32 tensor, as PyTorch stores it, and the bias corrections
are computed from it inside the step's graph, so a captured step (`ember.jit`) replays
with the right corrections instead of the ones of the step it was captured at. The
learning rate and the betas stay Python floats (runtime scalars of the kernels).

Half-precision parameters are updated as torch's single-tensor Adam updates them: each
of torch's ops (lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_) is computed in float32
and rounded once to the parameter's dtype; the scalar chain stays float32 throughout.
"""

from __future__ import annotations

from collections.abc import Iterable

from ember import dtypes
from ember.ir import Node
from ember.ops.pointwise import cast, maximum
from ember.optim.optimizer import TEMPLATED, Optimizer
from ember.runtime.executor import filled
from ember.tensor import Tensor


def _zeros(shape: tuple[int, ...], dtype: dtypes.DType, device) -> Tensor:
    """State that starts at zero, made as a buffer now rather than as pending constants: the first step's graph
    is then every later step's, so a training loop compiles one plan, not two."""
    return Tensor(Node.from_buffer(filled(shape, dtype, device, 0), dtype, device))


def _wide(x: Tensor) -> Tensor:
    """x in the dtype torch computes its ops in: float32 for half types, else x itself."""
    return cast(x, dtypes.compute_dtype(x.dtype))


def _rounded(x: Tensor, dtype: dtypes.DType) -> Tensor:
    """The result of one torch op on `dtype` tensors: rounded to `dtype`, then widened for the next op."""
    return _wide(cast(x, dtype))


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

    def _init_state(self, param: Tensor, state: dict, group: dict) -> None:
        state["step"] = _zeros((), dtypes.float32, param.device)
        state["exp_avg"] = _zeros(param.shape, param.dtype, param.device)
        state["exp_avg_sq"] = _zeros(param.shape, param.dtype, param.device)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = _zeros(param.shape, param.dtype, param.device)

    def _update(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        if not state:
            self._init_state(param, state, group)
        if group["maximize"]:
            grad = -grad
        (beta1, beta2), eps, weight_decay = group["betas"], group["eps"], group["weight_decay"]
        lr = self._lr(group, param.device, param.dtype)
        dtype = param.dtype
        step = state["step"].assign(state["step"] + 1)
        grad = _wide(grad)
        if weight_decay != 0:
            if self._decoupled_weight_decay:
                param.assign(_wide(param) * (1 - lr * weight_decay))
            else:
                grad = _rounded(grad + _wide(param) * weight_decay, dtype)
        exp_avg = state["exp_avg"].assign(_lerp(_wide(state["exp_avg"]), grad, 1 - beta1))
        decayed = _rounded(_wide(state["exp_avg_sq"]) * beta2, dtype)
        exp_avg_sq = state["exp_avg_sq"].assign(decayed + grad * (1 - beta2) * grad)
        # 0-d float32 tensors: scalar work inside the update's kernel, not work per element
        neg_step_size = -lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step).sqrt()
        if group["amsgrad"]:
            second_moment = state["max_exp_avg_sq"].assign(maximum(state["max_exp_avg_sq"], exp_avg_sq))
        else:
            second_moment = exp_avg_sq
        # eps is added in the parameter's dtype, as torch adds a Python number to a tensor
        denom = _wide(cast(_wide(second_moment.sqrt()) / bias_correction2_sqrt, dtype) + eps)
        param.assign(_wide(param) + _wide(exp_avg) * neg_step_size / denom)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with weight decay applied to the parameters directly (decoupled)."""

    _decoupled_weight_decay = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


TEMPLATED.add(Adam._update)
