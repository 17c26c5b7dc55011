"""`from_torch`: a PyTorch model as an ember module sharing its parameters.

The parameters and buffers are shared without copies (DLPack): an ember Parameter's buffer is the torch
tensor's memory, on the GPU or the CPU, so the imported model computes with the weights the torch model holds
at import time and ember's planner fuses it like any ember model (a chain of narrow Linear layers becomes one
MLP kernel). ember updates are functional: training the imported model gives its Parameters new values,
which torch's tensors do not see (`module.load_state_dict` takes them back).

A torch `nn.Sequential` (nested too) becomes an ember `nn.Sequential` of the same layers. Any other module is
traced with torch.fx: its forward becomes a list of layer calls, torch functions, Tensor methods and Python
operators, which the imported module replays on ember Tensors (ember's functions and methods carry torch's
names). Layers keep their torch names and paths, so `state_dict()` keys are the torch model's.

Layers: Linear, Conv2d, ConvTranspose2d, BatchNorm1d, BatchNorm2d, LayerNorm, Embedding, MaxPool2d,
AvgPool2d, AdaptiveAvgPool2d, ReLU, LeakyReLU, Sigmoid, Tanh, GELU, SiLU, Softplus, Softmax, LogSoftmax,
Identity, Dropout and Flatten. Anything else is an error at import that names it and where it sits: another
layer, a function or Tensor method ember does not have, or a forward torch.fx cannot trace (one that branches
on its inputs' values).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import ember
from ember import dtypes, nn
from ember.nn import functional as F
from ember.nn.module import Module, Parameter
from ember.ops.creation import from_dlpack
from ember.tensor import Tensor


def from_torch(module) -> Module:
    """The ember module computing what the torch `module` computes, on the same (shared) parameters."""
    import torch  # only a caller with a torch model gets here

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    importer = _Importer()
    converted = importer.module(module, "")
    if importer.problems:
        raise TypeError(f"from_torch: cannot import {type(module).__name__}: {'; '.join(importer.problems)}. "
                        f"Supported layers are Sequential, {', '.join(_LAYERS)}; other modules are traced with "
                        "torch.fx")
    converted.train(module.training)
    return converted


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _where(path: str) -> str:
    return path or "(the model)"


class _Importer:
    """Converts a torch module tree, collecting every problem before one error names them all."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.done: dict[int, Module] = {}  # a layer used twice is one ember layer

    def module(self, m, path: str) -> Module:
        import torch

        if id(m) in self.done:
            return self.done[id(m)]
        if isinstance(m, torch.nn.Sequential):
            out: Module = nn.Sequential(OrderedDict((name, self.module(child, _join(path, name)))
                                                    for name, child in m.named_children()))
        elif _is_layer(m):
            out = self.layer(m, path)
        elif type(m).__module__.startswith("torch."):  # a torch layer ember does not have
            self.problems.append(f"unsupported layer {_where(path)}: {type(m).__name__}")
            out = nn.Identity()
        else:
            out = self.traced(m, path)
        self.done[id(m)] = out
        return out

    def layer(self, m, path: str) -> Module:
        try:
            return _LAYERS[type(m).__name__](m)
        except (NotImplementedError, ValueError) as error:
            self.problems.append(f"{_where(path)}: {type(m).__name__}: {error}")
            return nn.Identity()

    def traced(self, m, path: str) -> Module:
        import torch
        import torch.fx

        tracer = torch.fx.Tracer()
        tracer.proxy_buffer_attributes = True  # a buffer is read where it lives (shared), not copied as a constant
        try:
            graph = tracer.trace(m)
        except Exception as error:  # torch.fx's own errors name the construct it cannot trace
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            self.problems.append(f"{_where(path)}: the forward of {type(m).__name__} cannot be traced by torch.fx "
                                 f"({reason})")
            return nn.Identity()
        out = Traced(type(m).__name__)
        index: dict[object, int] = {}
        for node in graph.nodes:
            where = f"{_where(path)} ({type(m).__name__}, at {node.name})"
            fn = None
            if node.op == "call_module":
                sub = m.get_submodule(node.target)
                if not _is_layer(sub):
                    self.problems.append(f"unsupported layer {_join(path, node.target)}: {type(sub).__name__}")
                else:
                    _place(out, node.target, self.module(sub, _join(path, node.target)))
            elif node.op == "get_attr":
                _place_attribute(out, m, node.target)
            elif node.op == "call_function":
                fn = _function(node.target)
                if fn is None:
                    self.problems.append(f"{where}: {_name(node.target)} has no ember equivalent")
            elif node.op == "call_method" and not hasattr(Tensor, node.target):
                self.problems.append(f"{where}: Tensor.{node.target} has no ember equivalent")
            index[node] = len(out._steps)
            kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_")}  # torch's own (_stacklevel)
            out._steps.append(_Step(node.op, node.name, node.target, fn, _arguments(node.args, index),
                                    _arguments(kwargs, index)))
        _order_like(out, m)
        return out


def _is_layer(m) -> bool:
    return type(m).__name__ in _LAYERS and type(m).__module__.startswith("torch.nn")


def _place(root: Module, path: str, module: Module) -> None:
    """Register `module` at the dotted `path` under `root`, making the parts above it as needed."""
    *parents, name = path.split(".")
    holder = _part(root, parents)
    if name not in holder._modules:
        holder.add_module(name, module)


def _part(root: Module, names: list[str]) -> Module:
    holder = root
    for name in names:
        if name not in holder._modules:
            holder.add_module(name, Part())
        holder = holder._modules[name]
    return holder


def _order_like(out: Module, m) -> None:
    """Order the parameters, buffers and submodules registered while tracing (in the order the forward reads
    them) as the torch module declares them, at every level the tracing made."""
    for mine, theirs in ((out._parameters, m._parameters), (out._buffers, m._buffers), (out._modules, m._modules)):
        for name in theirs:
            if name in mine:
                mine.move_to_end(name)
    for name, part in out._modules.items():
        if isinstance(part, Part) and name in m._modules:
            _order_like(part, m._modules[name])


def _place_attribute(root: Module, m, path: str) -> None:
    """A parameter, buffer or constant tensor the traced forward reads, shared and registered at its path."""
    import torch

    *parents, name = path.split(".")
    owner = m.get_submodule(".".join(parents)) if parents else m
    holder = _part(root, parents)
    value = getattr(owner, name)
    if name in holder._parameters or name in holder._buffers:
        return
    if isinstance(value, torch.nn.Parameter):
        holder.register_parameter(name, _shared(value))
    elif isinstance(value, torch.Tensor):
        persistent = name in owner._buffers and name not in owner._non_persistent_buffers_set
        holder.register_buffer(name, from_dlpack(value.detach()), persistent=persistent)
    else:
        object.__setattr__(holder, name, value)


@dataclass(frozen=True)
class _Ref:
    """A traced step's argument that is an earlier step's value."""

    step: int


def _arguments(value, index: dict):
    """A traced node's arguments with earlier nodes as references and torch's dtypes, devices and sizes as
    ember's."""
    import torch
    import torch.fx

    if isinstance(value, torch.fx.Node):
        return _Ref(index[value])
    if isinstance(value, torch.dtype):
        return dtypes.as_dtype(value)
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (tuple, list)):  # torch.Size too
        items = [_arguments(v, index) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _arguments(v, index) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_arguments(v, index) for v in (value.start, value.stop, value.step)))
    if isinstance(value, torch.Tensor):
        return from_dlpack(value.detach())
    return value


def _resolve(value, values: list):
    if isinstance(value, _Ref):
        return values[value.step]
    if isinstance(value, (tuple, list)):
        items = [_resolve(v, values) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _resolve(v, values) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, values), _resolve(value.stop, values), _resolve(value.step, values))
    return value


def _name(fn) -> str:
    module = getattr(fn, "__module__", None) or ""
    return f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}".lstrip(".")


def _function(fn):
    """The ember function that does what the torch (or Python) function `fn` does, or None."""
    import torch
    import torch.nn.functional as torch_f

    if getattr(fn, "__module__", None) in ("_operator", "operator") or fn in (getattr, len):
        return fn  # ember Tensors implement Python's operators
    name = getattr(fn, "__name__", None)
    if name is None:
        return None
    if getattr(torch_f, name, None) is fn:
        return getattr(F, name, None)
    if getattr(torch, name, None) is fn:
        return getattr(ember, name, None)
    return None


# the argument of a traced call that torch.fx fixed at the training mode of the tracing (F.dropout(x, p,
# self.training)): the imported module passes its own mode instead
_TRAINING_ARGUMENT = {F.dropout: 2}


@dataclass
class _Step:
    op: str  # torch.fx's: placeholder, get_attr, call_module, call_function, call_method, output
    name: str
    target: object
    fn: object
    args: object
    kwargs: dict


class Traced(Module):
    """A torch module imported through torch.fx: its forward replays the traced steps on ember Tensors, calling
    its layers (registered at their torch paths) and ember's functions."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._steps: list[_Step] = []
        self._traced_from = name

    def forward(self, *args, **kwargs):
        values: list = []
        given = list(args)
        for step in self._steps:
            a, k = _resolve(step.args, values), _resolve(step.kwargs, values)
            try:
                if step.op == "placeholder":
                    if given:
                        value = given.pop(0)
                    elif step.name in kwargs or step.target in kwargs:
                        value = kwargs.get(step.target, kwargs.get(step.name))
                    elif a:
                        value = a[0]  # its default
                    else:
                        raise TypeError(f"{self._traced_from}.forward: missing argument {step.target!r}")
                elif step.op == "get_attr":
                    value = self._attribute(step.target)
                elif step.op == "call_module":
                    value = self.get_submodule(step.target)(*a, **k)
                elif step.op == "call_function":
                    position = _TRAINING_ARGUMENT.get(step.fn)
                    if position is not None:
                        a, k = _with_training(a, k, position, self.training)
                    value = step.fn(*a, **k)
                elif step.op == "call_method":
                    value = getattr(a[0], step.target)(*a[1:], **k)
                else:  # output
                    return a[0]
            except Exception as error:
                error.add_note(f"in the forward of {self._traced_from} imported from torch, at {step.name}")
                raise
            values.append(value)
        raise AssertionError("a traced graph ends with its output")

    def _attribute(self, path: str):
        *parents, name = path.split(".")
        return getattr(self.get_submodule(".".join(parents)) if parents else self, name)

    def extra_repr(self) -> str:
        return f"traced from {self._traced_from}, {len(self._steps)} steps"


def _with_training(args: tuple, kwargs: dict, position: int, training: bool) -> tuple[tuple, dict]:
    if "training" in kwargs:
        return args, {**kwargs, "training": training}
    if len(args) > position:
        return (*args[:position], training, *args[position + 1:]), kwargs
    return args, {**kwargs, "training": training}


class Part(Module):
    """A submodule of a traced torch model: it holds the layers, parameters and buffers at its path; its
    computation is part of the traced forward of the module above it."""

    def forward(self, *args, **kwargs):
        raise TypeError("this part of a model imported from torch runs inside the traced forward of the module "
                        "above it, not on its own")


# -- layers ------------------------------------------------------------------------------------------

def _shared(p) -> Parameter:
    return Parameter(from_dlpack(p.detach()), requires_grad=p.requires_grad)


def _share_parameters(out: Module, m) -> Module:
    """Replace `out`'s parameters and buffers by the torch layer's, shared."""
    for name, p in m.named_parameters(recurse=False):
        setattr(out, name, _shared(p))
    for name in list(out._parameters):
        if getattr(m, name, None) is None:
            out.register_parameter(name, None)
    for name, b in m.named_buffers(recurse=False):
        out.register_buffer(name, from_dlpack(b.detach()), persistent=name not in m._non_persistent_buffers_set)
    for name in list(out._buffers):
        if getattr(m, name, None) is None:
            out.register_buffer(name, None)
    return out


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


def _conv2d(m) -> Module:
    return _share_parameters(nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                                       m.dilation, m.groups, m.bias is not None, m.padding_mode), m)


def _conv_transpose2d(m) -> Module:
    return _share_parameters(nn.ConvTranspose2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                                                m.output_padding, m.groups, m.bias is not None, m.dilation,
                                                m.padding_mode), m)


def _batch_norm(cls):
    def convert(m) -> Module:
        return _share_parameters(cls(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats), m)
    return convert


def _layer_norm(m) -> Module:
    return _share_parameters(nn.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None), m)


def _embedding(m) -> Module:
    if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
        raise NotImplementedError("max_norm, scale_grad_by_freq and sparse are not supported")
    return nn.Embedding(m.num_embeddings, m.embedding_dim, m.padding_idx, _weight=from_dlpack(m.weight.detach()),
                        _freeze=not m.weight.requires_grad)


_LAYERS = {
    "Linear": _linear,
    "Conv2d": _conv2d,
    "ConvTranspose2d": _conv_transpose2d,
    "BatchNorm1d": _batch_norm(nn.BatchNorm1d),
    "BatchNorm2d": _batch_norm(nn.BatchNorm2d),
    "LayerNorm": _layer_norm,
    "Embedding": _embedding,
    "MaxPool2d": lambda m: nn.MaxPool2d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices,
                                        m.ceil_mode),
    "AvgPool2d": lambda m: nn.AvgPool2d(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                                        m.divisor_override),
    "AdaptiveAvgPool2d": lambda m: nn.AdaptiveAvgPool2d(m.output_size),
    "ReLU": lambda m: nn.ReLU(),
    "LeakyReLU": lambda m: nn.LeakyReLU(m.negative_slope),
    "Sigmoid": lambda m: nn.Sigmoid(),
    "Tanh": lambda m: nn.Tanh(),
    "GELU": lambda m: nn.GELU(m.approximate),
    "SiLU": lambda m: nn.SiLU(),
    "Softplus": lambda m: nn.Softplus(m.beta, m.threshold),
    "Softmax": lambda m: nn.Softmax(m.dim),
    "LogSoftmax": lambda m: nn.LogSoftmax(m.dim),
    "Identity": lambda m: nn.Identity(),
    "Dropout": lambda m: nn.Dropout(m.p),
    "Flatten": lambda m: nn.Flatten(m.start_dim, m.end_dim),
}
