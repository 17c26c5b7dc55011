"""`from_torch`: a PyTorch model as an ember module sharing its parameters.

The parameters are shared without copies (DLPack): an ember Parameter's buffer is the torch tensor's memory,
on the GPU or the CPU, so the imported model computes with the weights the torch model holds at import time
and ember's planner fuses it like any ember model (a chain of narrow Linear layers becomes one MLP kernel).
ember updates are functional: training the imported model gives its Parameters new values, which torch's
tensors do not see (`module.load_state_dict` takes them back).

Supported layers: Sequential (nested too), Linear, ReLU, LeakyReLU, Sigmoid, Tanh, GELU, SiLU, Softplus,
Identity, Dropout and Flatten. Any other layer is an error naming it and where it sits.
"""

from __future__ import annotations

from collections import OrderedDict

from ember import nn
from ember.nn.module import Module, Parameter
from ember.ops.creation import from_dlpack


def from_torch(module) -> Module:
    """The ember module computing what the torch `module` computes, on the same (shared) parameters."""
    import torch  # only a caller with a torch model gets here

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    unsupported = [f"{path or '(the model)'}: {type(m).__name__}" for path, m in _walk(module, "")
                   if type(m).__name__ not in _LAYERS and not isinstance(m, torch.nn.Sequential)]
    if unsupported:
        raise TypeError(f"from_torch: unsupported layers {', '.join(unsupported)}; supported are Sequential, "
                        f"{', '.join(_LAYERS)}")
    converted = _convert(module)
    converted.train(module.training)
    return converted


def _walk(module, path: str):
    yield path, module
    import torch

    if isinstance(module, torch.nn.Sequential):
        for name, child in module.named_children():
            yield from _walk(child, f"{path}.{name}" if path else name)


def _convert(module) -> Module:
    import torch

    if isinstance(module, torch.nn.Sequential):
        return nn.Sequential(OrderedDict((name, _convert(child)) for name, child in module.named_children()))
    return _LAYERS[type(module).__name__](module)


def _shared(p) -> Parameter:
    return Parameter(from_dlpack(p.detach()), requires_grad=p.requires_grad)


def _linear(m) -> Module:
    out = nn.Linear.__new__(nn.Linear)
    Module.__init__(out)
    out.in_features, out.out_features = m.in_features, m.out_features
    out.weight = _shared(m.weight)
    if m.bias is not None:
        out.bias = _shared(m.bias)
    else:
        out.register_parameter("bias", None)
    return out


_LAYERS = {
    "Linear": _linear,
    "ReLU": lambda m: nn.ReLU(),
    "LeakyReLU": lambda m: nn.LeakyReLU(m.negative_slope),
    "Sigmoid": lambda m: nn.Sigmoid(),
    "Tanh": lambda m: nn.Tanh(),
    "GELU": lambda m: nn.GELU(m.approximate),
    "SiLU": lambda m: nn.SiLU(),
    "Softplus": lambda m: nn.Softplus(m.beta, m.threshold),
    "Identity": lambda m: nn.Identity(),
    "Dropout": lambda m: nn.Dropout(m.p),
    "Flatten": lambda m: nn.Flatten(m.start_dim, m.end_dim),
}
