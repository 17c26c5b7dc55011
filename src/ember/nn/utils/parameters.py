"""Gradient clipping and flat parameter vectors, with torch.nn.utils's names and formulas.

Everything here is built lazily from ember ops, outside autograd: the total norm of the gradients is one
graph over all of them, and a clipped gradient is the same `.grad` Tensor showing its scaled value (an
in-place op, as in torch), so a clip before `optimizer.step()` is computed in the step's graph, and a step
captured by `ember.jit` replays it. `foreach` is accepted for torch's signatures and changes nothing: the
updates of a realize are fused whatever the Python loop looks like.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable

from ember.autograd import no_grad
from ember.ops.creation import tensor
from ember.ops.movement import cat, stack
from ember.ops.pointwise import clamp
from ember.ops.reduce import norm
from ember.tensor import Tensor

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm", "parameters_to_vector",
           "vector_to_parameters"]


def _tensors(tensors: Tensor | Iterable[Tensor]) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def get_total_norm(tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> Tensor:
    """The `norm_type`-norm of all of `tensors` as one vector (the norm of their norms), a 0-d Tensor on the
    first one's device. `error_if_nonfinite=True` reads the norm on the host to check it: the graph so far is
    computed there and then, and a step captured by `ember.jit` that does so runs as written instead of replaying."""
    tensors = _tensors(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return tensor(0.0)
    with no_grad():
        device = tensors[0].device
        total = norm(stack([norm(t, norm_type).to(device) for t in tensors]), norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                           "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                           "anyway, set `error_if_nonfinite=False`")
    return total


def clip_grads_with_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, total_norm: Tensor,
                          foreach: bool | None = None) -> None:
    """Scale each gradient in place by min(max_norm / (total_norm + 1e-6), 1): a factor computed in the graph,
    so no value is read on the host."""
    grads = [p.grad for p in _tensors(parameters) if p.grad is not None]
    if not grads:
        return
    with no_grad():
        scale = clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale.to(grad.device))


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Scale the gradients of `parameters` in place so that their total `norm_type`-norm (all gradients as one
    vector; 'inf' for the largest magnitude) is at most `max_norm`; returns the total norm before clipping.
    It is `get_total_norm` then `clip_grads_with_norm_` (see the first for what `error_if_nonfinite` costs)."""
    if isinstance(parameters, types.GeneratorType):
        parameters = list(parameters)
        if not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    parameters = _tensors(parameters)
    total = get_total_norm([p.grad for p in parameters if p.grad is not None], norm_type, error_if_nonfinite)
    clip_grads_with_norm_(parameters, max_norm, total)
    return total


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float, foreach: bool | None = None) -> None:
    """Clamp each gradient of `parameters` into [-clip_value, clip_value], in place."""
    clip_value = float(clip_value)
    with no_grad():
        for p in _tensors(parameters):
            if p.grad is not None:
                p.grad.clamp_(min=-clip_value, max=clip_value)


def _same_device(parameters: Iterable[Tensor]):
    """The parameters, each checked to be on the first one's device."""
    device = None
    for p in parameters:
        if device is None:
            device = p.device
        elif p.device != device:
            raise TypeError("Found two parameters on different devices, this is currently not supported.")
        yield p


def parameters_to_vector(parameters: Iterable[Tensor]) -> Tensor:
    """The parameters flattened and concatenated into one vector (a new Tensor, part of autograd's graph)."""
    return cat([p.reshape(-1) for p in _same_device(parameters)])


def vector_to_parameters(vec: Tensor, parameters: Iterable[Tensor]) -> None:
    """Make each parameter show its slice of `vec` (in order, reshaped), as torch's `param.data = ...` does."""
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected ember.Tensor, but got: {type(vec).__name__}")
    start = 0
    for p in _same_device(parameters):
        p.data = vec[start:start + p.numel()].view_as(p).data
        start += p.numel()
