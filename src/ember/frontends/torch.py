"""`from_torch`: a PyTorch model as an ember module sharing its parameters.

The parameters and buffers are shared without copies (DLPack): an ember Parameter's buffer is the torch
tensor's memory, on the GPU or the CPU, so the imported model computes with the weights the torch model holds
at import time and ember's planner fuses it like any ember model (a chain of narrow Linear layers becomes one
MLP kernel). ember updates are functional: training the imported model gives its Parameters new values,
which torch's tensors do not see (`module.load_state_dict` takes them back).

A torch `nn.Sequential` (nested too) becomes an ember `nn.Sequential` of the same layers; a subclass with a
forward of its own (a residual `x + super().forward(x)`) does not. Any other module is traced with torch.fx: its
forward becomes a list of layer calls, torch functions, Tensor methods and Python operators, which the imported
module (`Traced`) replays on ember Tensors (ember's functions and methods carry torch's names), binding its
arguments as torch does. A `torch.fx.GraphModule` is replayed from its own graph, not traced again. Everything
the torch module holds keeps its torch name and path, used by the forward or not, so `state_dict()` keys and the
order of `parameters()` are the torch model's; a tensor held twice (a tied weight) is one ember Parameter. Each
module keeps its own training mode.

Layers: Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, BatchNorm1d/2d/3d, LayerNorm, Embedding, EmbeddingBag,
MaxPool2d/3d (return_indices too), MaxUnpool2d, AvgPool2d/3d, AdaptiveAvgPool2d/3d, AdaptiveMaxPool2d, Unfold, Fold,
ReLU, LeakyReLU, Sigmoid, Tanh, GELU, SiLU, Softplus, Softmax, LogSoftmax, Identity, Dropout, Flatten, the recurrent
layers (RNN, LSTM, GRU) and their cells, among others (the `_LAYERS` table); torch.nn.utils.rnn's packing of
variable-length sequences for them is recorded whole by the trace and runs as ember.nn.utils.rnn's. So is
torchvision's stochastic depth (EfficientNet's, ConvNeXt's, MaxViT's), as ember's `F.stochastic_depth`; a named
tuple of outputs (GoogLeNet's and Inception's auxiliary logits in training) holds ember Tensors. Anything else is
an error at import that names it and where it sits, once: another layer the forward calls, a function or Tensor
method ember does not have (named with the module whose forward calls it), or a forward torch.fx cannot trace (one
that branches on its inputs' values). Where that import fails, `from_torch` runs the program torch.export captures
(`via`).
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


def from_torch(module, example_inputs=None, via: str = "auto") -> Module:
    """The ember module computing what the torch `module` computes, on the same (shared) parameters.

    `via`: "fx" imports layer by layer (ember's layers, the rest traced with torch.fx), "export" runs the core
    ATen program torch.export captures (ember.frontends.exported), "auto" the first, or the second where the first
    cannot take the model. The export happens at the first call, or at once on `example_inputs` (a tuple of
    arguments), which then also checks that the model imports."""
    import torch  # only a caller with a torch model gets here

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    if via not in ("auto", "fx", "export"):
        raise ValueError(f"from_torch: via must be 'auto', 'fx' or 'export', got {via!r}")
    importer = _Importer()
    if via != "export":
        converted = importer.module(module, "")
        if not importer.problems:
            return converted
        if via == "fx":
            raise TypeError(f"from_torch: cannot import {type(module).__name__}: {'; '.join(importer.problems)}. "
                            f"Supported layers are Sequential, {', '.join(_LAYERS)}; other modules are traced with "
                            "torch.fx")
    from ember.frontends.exported import Exported

    exported = Exported(module, _Importer(), list(importer.problems))
    if example_inputs is not None:
        exported(*(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)))
    return exported


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _where(path: str) -> str:
    return path or "(the model)"


class _Importer:
    """Converts a torch module tree, collecting every problem before one error names them all, each once (a
    layer inside a Sequential that a traced forward calls is seen by both). A torch tensor seen twice (a weight
    tied to two layers) is one ember Parameter or buffer, as a layer used twice is one ember layer."""

    def __init__(self) -> None:
        self.problems: dict[str, None] = {}  # in the order found, each once
        self.done: dict[int, Module] = {}
        self.tensors: dict[int, Tensor] = {}

    def problem(self, text: str) -> None:
        self.problems[text] = None

    def shared(self, t) -> Tensor:
        """The ember Parameter (or buffer) on the torch tensor `t`'s memory."""
        import torch

        if id(t) not in self.tensors:
            value = from_dlpack(t.detach())
            self.tensors[id(t)] = Parameter(value, t.requires_grad) if isinstance(t, torch.nn.Parameter) else value
        return self.tensors[id(t)]

    def module(self, m, path: str) -> Module:
        import torch

        if id(m) in self.done:
            return self.done[id(m)]
        if _is_sequential(m):
            out: Module = nn.Sequential(OrderedDict((name, self.module(child, _join(path, name)))
                                                    for name, child in m.named_children()))
        elif _is_layer(m):
            out = self.layer(m, path)
        elif type(m).__module__.startswith("torch.") and not isinstance(m, torch.fx.GraphModule):
            self.problem(f"unsupported layer {_where(path)}: {type(m).__name__}")  # a torch layer ember lacks
            out = nn.Identity()
        else:
            out = Traced(m)
            self.mirror(out, m, path, _called(m))
        object.__setattr__(out, "training", m.training)  # its own mode (a frozen batch norm in a training model)
        if isinstance(out, Traced):
            out.graph(self, path)  # traced in the modes the torch modules have now
        self.done[id(m)] = out
        return out

    def layer(self, m, path: str) -> Module:
        try:
            return _LAYERS[type(m).__name__](m, self)
        except (NotImplementedError, ValueError, TypeError) as error:
            self.problem(f"{_where(path)}: {type(m).__name__}: {error}")
            return nn.Identity()

    def mirror(self, out: Module, m, path: str, called: frozenset[str] = frozenset()) -> None:
        """Register under `out` what the torch module `m` holds, at the same names and in the same order: its
        parameters and buffers (shared), its layers, the modules a graph of `m` calls (`called`, paths below
        `m`), and its other submodules as `Part`s holding theirs (a traced forward runs their code itself)."""
        try:
            _sharing(out, m, self)
            for name, child in m._modules.items():
                where = _join(path, name)
                if child is None or name in called or _imports_alone(child):
                    out.add_module(name, None if child is None else self.module(child, where))
                elif id(child) in self.done:
                    out.add_module(name, self.done[id(child)])
                elif type(child).__module__.startswith("torch.") and not _is_container(child):
                    # a torch layer ember does not have: an error only if the forward calls it
                    continue
                else:
                    part = self.done[id(child)] = Part(type(child).__name__)
                    object.__setattr__(part, "training", child.training)
                    self.mirror(part, child, where, frozenset(target.removeprefix(f"{name}.") for target in called
                                                              if target.startswith(f"{name}.")))
                    out.add_module(name, part)
        except KeyError as error:  # a torch name an ember module cannot take
            self.problem(f"{_where(path)}: {error.args[0]}")


def _is_layer(m) -> bool:
    return type(m).__name__ in _LAYERS and type(m).__module__.startswith("torch.nn")


def _is_sequential(m) -> bool:
    """A torch Sequential that only chains its layers: a subclass with a forward of its own is traced."""
    import torch

    return isinstance(m, torch.nn.Sequential) and type(m).forward is torch.nn.Sequential.forward


def _imports_alone(m) -> bool:
    """Whether a torch module becomes an ember module that runs on its own even inside a traced module (whose
    forward runs the code of its other submodules itself): a layer, a Sequential, a GraphModule."""
    import torch

    return _is_layer(m) or isinstance(m, (torch.nn.Sequential, torch.fx.GraphModule))


def _unsupported(m) -> bool:
    """Whether a module a graph calls is a torch layer ember does not have (any other module is imported)."""
    return type(m).__module__.startswith("torch.") and not _imports_alone(m)


def _is_container(m) -> bool:
    """A torch module that only holds others: a ModuleList, a ModuleDict, or a bare `nn.Module` (a GraphModule
    holds the modules its graph calls at their paths through those)."""
    import torch

    return isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) or type(m) is torch.nn.Module


def _called(m) -> frozenset[str]:
    """The paths of the modules a GraphModule's graph calls: they run as modules of their own, whatever they
    are (a tracer may keep any module whole)."""
    import torch

    if not isinstance(m, torch.fx.GraphModule):
        return frozenset()
    return frozenset(node.target for node in m.graph.nodes if node.op == "call_module")


def _origin(node, m, path: str) -> str:
    """The module whose forward holds a traced node, as a problem names it: the innermost module torch.fx
    recorded the node in, so a module traced on its own and inside another's forward name it the same."""
    name, cls = "", type(m)
    stack = node.meta.get("nn_module_stack")
    if stack:
        qualname, entry = next(reversed(stack.items()))
        inner, kind = entry if isinstance(entry, tuple) else (qualname, entry)
        try:
            m.get_submodule(inner)
            name, cls = inner, kind
        except AttributeError:  # a stack written by another tracer, under names this module does not have
            pass
    return f"{_where(_join(path, name) if name else path)} ({getattr(cls, '__name__', cls)})"


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
    if fn is torch._assert:
        return _assert
    if isinstance(fn, type) and issubclass(fn, tuple) and hasattr(fn, "_fields"):
        return fn  # a named tuple of outputs (GoogLeNet's logits and auxiliary logits) holds ember's as torch's
    if name in _SEQUENCE_FUNCTIONS and getattr(torch.nn.utils.rnn, name) is fn:
        return getattr(nn.utils.rnn, name)
    if getattr(torch_f, name, None) is fn:
        return getattr(F, name, None)
    if getattr(torch, name, None) is fn:
        return getattr(ember, name, None)
    return _TORCHVISION_FUNCTIONS.get(_name(fn))


# torchvision's operators that its models' traces keep whole (torch.fx.wrap), by their qualified names: ember's
# functions of the same meaning
_TORCHVISION_FUNCTIONS = {"torchvision.ops.stochastic_depth.stochastic_depth": F.stochastic_depth}


# torch.nn.utils.rnn's functions that ember has, recorded whole by the trace (torch's own code reads the lengths on
# the host, which a trace cannot): packing and unpacking variable-length sequences for the recurrent layers
_SEQUENCE_FUNCTIONS = ("pack_padded_sequence", "pad_packed_sequence", "pack_sequence", "pad_sequence",
                       "unpack_sequence", "unpad_sequence")


def _tracer():
    """A torch.fx tracer that records the `_SEQUENCE_FUNCTIONS` as calls, whether the forward names them as
    globals or as attributes of torch.nn.utils.rnn (or torch.nn.utils)."""
    import torch.fx
    import torch.nn.utils.rnn

    tracer = torch.fx.Tracer(autowrap_functions=tuple(getattr(torch.nn.utils.rnn, name)
                                                      for name in _SEQUENCE_FUNCTIONS))
    tracer._autowrap_search += [torch.nn.utils.rnn, torch.nn.utils]
    return tracer


def _assert(condition, message: str) -> None:
    """torch._assert: a check a forward makes of its inputs (a shape), made again on ember's values."""
    if not bool(condition):
        raise AssertionError(message)


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
    its layers (registered at their torch paths) and ember's functions.

    torch.fx fixes what the forward reads of its modules' training modes (`F.dropout(x, p, self.training)`,
    `if self.training:`) at the trace, so there is one trace per combination of modes its modules have been
    called in: the import's, and another, traced then, after `train()` or `eval()`. A GraphModule's graph was
    fixed when it was made: it is the one graph, in any mode (its layers still follow their own)."""

    def __init__(self, m) -> None:
        import inspect

        super().__init__()
        self._ember_torch = m  # traced again for other training modes; its memory is the parameters' anyway
        self._ember_signature = inspect.signature(m.forward)
        self._ember_graphs: dict[tuple, list[_Step]] = {}

    def _modes(self) -> tuple[bool, ...]:
        return tuple(mod.training for _, mod in self.named_modules())

    def graph(self, importer: _Importer, path: str) -> list[_Step] | None:
        """The steps of the forward under the modules' present training modes, traced now if they are new;
        problems go to `importer`."""
        import torch.fx

        modes = self._modes()
        if modes in self._ember_graphs:
            return self._ember_graphs[modes]
        m = self._ember_torch
        before = set(vars(m))
        graph = m.graph if isinstance(m, torch.fx.GraphModule) else self._trace(modes, importer, path)
        if graph is None:
            return None
        steps: list[_Step] = []
        index: dict[object, int] = {}
        for node in graph.nodes:
            fn = None
            if node.op == "call_module" and _unsupported(m.get_submodule(node.target)):
                importer.problem(f"unsupported layer {_join(path, node.target)}: "
                                 f"{type(m.get_submodule(node.target)).__name__}")
            elif node.op == "get_attr" and node.target in vars(m) and node.target not in before:
                # a constant torch.fx set on the torch module while tracing: held here, the module left as it was
                self.register_buffer(node.target, importer.shared(getattr(m, node.target)), persistent=False)
                delattr(m, node.target)
            elif node.op == "call_function":
                fn = _function(node.target)
                if fn is None:
                    importer.problem(f"{_origin(node, m, path)}: {_name(node.target)} has no ember equivalent")
            elif node.op == "call_method" and not hasattr(Tensor, node.target):
                importer.problem(f"{_origin(node, m, path)}: Tensor.{node.target} has no ember equivalent")
            if any(arg not in index for arg in node.all_input_nodes):
                # a value another trace made, kept by the forward between calls (a cache on the module): the
                # trace does not compute it, so it is not this forward's
                importer.problem(f"{_origin(node, m, path)}: the trace reads a value an earlier trace left on the "
                                 "module (a cache)")
                return None
            index[node] = len(steps)
            # torch's own (_stacklevel), and an `out=None` a torch function passes on when it records itself
            kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_") and (k, v) != ("out", None)}
            steps.append(_Step(node.op, node.name, node.target, fn, _arguments(node.args, index),
                               _arguments(kwargs, index)))
        self._ember_graphs[modes] = steps
        return steps

    def _trace(self, modes: tuple[bool, ...], importer: _Importer, path: str):
        """The torch module's forward traced by torch.fx with its modules in the training `modes`, or None."""
        m = self._ember_torch
        kept = [(sub, sub.training) for sub in m.modules()]
        tracer = _tracer()
        tracer.proxy_buffer_attributes = True  # a buffer is read where it lives (shared), not copied as a constant
        try:
            for (name, _), flag in zip(self.named_modules(), modes):
                m.get_submodule(name).training = flag
            return tracer.trace(m)
        except Exception as error:  # torch.fx's own errors name the construct it cannot trace
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            importer.problem(f"{_where(path)}: the forward of {type(m).__name__} cannot be traced by torch.fx "
                             f"({reason})")
            return None
        finally:
            for sub, flag in kept:
                sub.training = flag

    def forward(self, *args, **kwargs):
        steps = self._ember_graphs.get(self._modes())
        if steps is None:
            importer = _Importer()
            steps = self.graph(importer, "")
            if importer.problems:
                raise TypeError(f"{type(self._ember_torch).__name__} imported from torch, in the training modes "
                                f"it has now: {'; '.join(importer.problems)}")
        bound = self._ember_signature.bind(*args, **kwargs)  # torch's errors for missing or unknown arguments
        bound.apply_defaults()
        values: list = []
        for step in steps:
            a, k = _resolve(step.args, values), _resolve(step.kwargs, values)
            try:
                if step.op == "placeholder":
                    value = bound.arguments[step.target.lstrip("*")]
                elif step.op == "get_attr":
                    *parents, name = step.target.split(".")
                    value = getattr(self.get_submodule(".".join(parents)), name)
                elif step.op == "call_module":
                    value = self.get_submodule(step.target)(*a, **k)
                elif step.op == "call_function":
                    value = step.fn(*a, **k)
                elif step.op == "call_method":
                    value = getattr(a[0], step.target)(*a[1:], **k)
                else:  # output
                    return a[0]
            except Exception as error:
                error.add_note(f"in the forward of {type(self._ember_torch).__name__} imported from torch, at "
                               f"{step.name}")
                raise
            values.append(value)
        raise AssertionError("a traced graph ends with its output")

    def extra_repr(self) -> str:
        return f"traced from {type(self._ember_torch).__name__}"


class Part(Module):
    """A submodule of a traced torch model: it holds the layers, parameters and buffers at its path; its
    computation is part of the traced forward of the module above it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._ember_name = name

    def forward(self, *args, **kwargs):
        raise TypeError(f"{self._ember_name}, a part of a model imported from torch, runs inside the traced forward "
                        "of the module above it, not on its own")

    def extra_repr(self) -> str:
        return self._ember_name


# -- layers ------------------------------------------------------------------------------------------
# each: (torch layer, importer) -> the ember layer, on the torch layer's parameters and buffers (shared)

def _sharing(out: Module, m, importer: _Importer) -> Module:
    """`out` with its parameters and buffers replaced by the torch layer's, shared."""
    for name, p in m._parameters.items():
        out.register_parameter(name, None if p is None else importer.shared(p))
    for name, b in m._buffers.items():
        out.register_buffer(name, None if b is None else importer.shared(b),
                            persistent=name not in m._non_persistent_buffers_set)
    return out


def _linear(m, importer: _Importer) -> Module:
    out = nn.Linear.__new__(nn.Linear)  # no initialisation: the weights are torch's
    Module.__init__(out)
    out.in_features, out.out_features = m.in_features, m.out_features
    return _sharing(out, m, importer)


def _conv(cls):
    """Conv1d, Conv2d or Conv3d: the ember `cls` with the torch layer's geometry, on its parameters."""
    def convert(m, importer: _Importer) -> Module:
        return _sharing(cls(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.groups,
                            m.bias is not None, m.padding_mode), m, importer)
    return convert


def _conv_transpose(cls):
    """ConvTranspose1d, 2d or 3d: the ember `cls` with the torch layer's geometry, on its parameters."""
    def convert(m, importer: _Importer) -> Module:
        return _sharing(cls(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.output_padding,
                            m.groups, m.bias is not None, m.dilation, m.padding_mode), m, importer)
    return convert


def _batch_norm(cls):
    def convert(m, importer: _Importer) -> Module:
        return _sharing(cls(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats), m, importer)
    return convert


def _layer_norm(m, importer: _Importer) -> Module:
    return _sharing(nn.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None), m, importer)


def _embedding(m, importer: _Importer) -> Module:
    if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
        raise NotImplementedError("max_norm, scale_grad_by_freq and sparse are not supported")
    out = nn.Embedding(m.num_embeddings, m.embedding_dim, m.padding_idx, _weight=importer.shared(m.weight).detach())
    return _sharing(out, m, importer)


def _embedding_bag(m, importer: _Importer) -> Module:
    out = nn.EmbeddingBag(m.num_embeddings, m.embedding_dim, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.mode,
                          m.sparse, importer.shared(m.weight).detach(), m.include_last_offset, m.padding_idx)
    return _sharing(out, m, importer)


def _recurrent(cls, *attributes: str):
    """A recurrent layer or cell: the ember `cls` built with the torch layer's `attributes`, on its parameters."""
    def convert(m, importer: _Importer) -> Module:
        return _sharing(cls(**{name: getattr(m, name) for name in attributes}), m, importer)
    return convert


_CELL = ("input_size", "hidden_size", "bias")
_RECURRENT = (*_CELL, "num_layers", "batch_first", "dropout", "bidirectional")


def _stateless(make):
    return lambda m, importer: make(m)


def _composite(cls, *attributes: str):
    """A torch layer made of layers ember has too (attention, the transformer layers and stacks): an ember `cls`
    holding the torch layer's `attributes`, its parameters shared and its children imported at their names (a
    ModuleList as one of imported layers); an activation function given as a function is ember's of the same
    name."""
    def make(m, importer: _Importer) -> Module:
        import torch

        if getattr(m, "bias_k", None) is not None or getattr(m, "add_zero_attn", False):
            raise NotImplementedError("add_bias_kv and add_zero_attn are not supported")
        out = cls.__new__(cls)
        Module.__init__(out)
        for name in attributes:  # a layer among them (a stack's final norm) is imported below with the children
            if not isinstance(getattr(m, name), torch.nn.Module):
                setattr(out, name, getattr(m, name))
        activation = m.__dict__.get("activation")
        if activation is not None and not isinstance(activation, torch.nn.Module):
            mapped = _function(activation)
            if mapped is None:
                raise NotImplementedError(f"the activation {_name(activation)} has no ember equivalent")
            out.activation = mapped
        _sharing(out, m, importer)
        for name, child in m._modules.items():
            if child is None:  # torch's None layer (no final norm): None here too
                out.add_module(name, None)
            elif isinstance(child, torch.nn.ModuleList):
                out.add_module(name, nn.ModuleList(importer.module(c, f"{name}.{k}") for k, c in enumerate(child)))
            elif type(child).__name__ == "NonDynamicallyQuantizableLinear":
                out.add_module(name, _linear(child, importer))
            else:
                out.add_module(name, importer.module(child, name))
        return out
    return make


_LAYERS = {
    "Linear": _linear,
    "Conv1d": _conv(nn.Conv1d),
    "Conv2d": _conv(nn.Conv2d),
    "Conv3d": _conv(nn.Conv3d),
    "ConvTranspose1d": _conv_transpose(nn.ConvTranspose1d),
    "ConvTranspose2d": _conv_transpose(nn.ConvTranspose2d),
    "ConvTranspose3d": _conv_transpose(nn.ConvTranspose3d),
    "BatchNorm1d": _batch_norm(nn.BatchNorm1d),
    "BatchNorm2d": _batch_norm(nn.BatchNorm2d),
    "BatchNorm3d": _batch_norm(nn.BatchNorm3d),
    "LayerNorm": _layer_norm,
    "Embedding": _embedding,
    "EmbeddingBag": _embedding_bag,
    "MaxPool2d": _stateless(lambda m: nn.MaxPool2d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices,
                                                   m.ceil_mode)),
    "AvgPool2d": _stateless(lambda m: nn.AvgPool2d(m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                                   m.count_include_pad, m.divisor_override)),
    "AdaptiveAvgPool2d": _stateless(lambda m: nn.AdaptiveAvgPool2d(m.output_size)),
    "MaxPool3d": _stateless(lambda m: nn.MaxPool3d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices,
                                                   m.ceil_mode)),
    "AvgPool3d": _stateless(lambda m: nn.AvgPool3d(m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                                   m.count_include_pad, m.divisor_override)),
    "AdaptiveAvgPool3d": _stateless(lambda m: nn.AdaptiveAvgPool3d(m.output_size)),
    "AdaptiveMaxPool3d": _stateless(lambda m: nn.AdaptiveMaxPool3d(m.output_size, m.return_indices)),
    "ReLU": _stateless(lambda m: nn.ReLU()),
    "LeakyReLU": _stateless(lambda m: nn.LeakyReLU(m.negative_slope)),
    "Sigmoid": _stateless(lambda m: nn.Sigmoid()),
    "Tanh": _stateless(lambda m: nn.Tanh()),
    "GELU": _stateless(lambda m: nn.GELU(m.approximate)),
    "SiLU": _stateless(lambda m: nn.SiLU()),
    "Softplus": _stateless(lambda m: nn.Softplus(m.beta, m.threshold)),
    "Softmax": _stateless(lambda m: nn.Softmax(m.dim)),
    "LogSoftmax": _stateless(lambda m: nn.LogSoftmax(m.dim)),
    "Identity": _stateless(lambda m: nn.Identity()),
    "Dropout": _stateless(lambda m: nn.Dropout(m.p)),
    "Flatten": _stateless(lambda m: nn.Flatten(m.start_dim, m.end_dim)),
    "GroupNorm": lambda m, importer: _sharing(nn.GroupNorm(m.num_groups, m.num_channels, m.eps, m.affine), m,
                                              importer),
    "InstanceNorm1d": _batch_norm(nn.InstanceNorm1d),
    "InstanceNorm2d": _batch_norm(nn.InstanceNorm2d),
    "InstanceNorm3d": _batch_norm(nn.InstanceNorm3d),
    "MaxPool1d": _stateless(lambda m: nn.MaxPool1d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices,
                                                   m.ceil_mode)),
    "AvgPool1d": _stateless(lambda m: nn.AvgPool1d(m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                                   m.count_include_pad)),
    "AdaptiveAvgPool1d": _stateless(lambda m: nn.AdaptiveAvgPool1d(m.output_size)),
    "AdaptiveMaxPool1d": _stateless(lambda m: nn.AdaptiveMaxPool1d(m.output_size, m.return_indices)),
    "AdaptiveMaxPool2d": _stateless(lambda m: nn.AdaptiveMaxPool2d(m.output_size, m.return_indices)),
    "Upsample": _stateless(lambda m: nn.Upsample(m.size, m.scale_factor, m.mode, m.align_corners,
                                                 m.recompute_scale_factor)),
    "ReLU6": _stateless(lambda m: nn.ReLU6()),
    "Hardtanh": _stateless(lambda m: nn.Hardtanh(m.min_val, m.max_val)),
    "Hardswish": _stateless(lambda m: nn.Hardswish()),
    "Hardsigmoid": _stateless(lambda m: nn.Hardsigmoid()),
    "Mish": _stateless(lambda m: nn.Mish()),
    "ELU": _stateless(lambda m: nn.ELU(m.alpha)),
    "GLU": _stateless(lambda m: nn.GLU(m.dim)),
    "PReLU": lambda m, importer: _sharing(nn.PReLU(m.num_parameters), m, importer),
    "Dropout2d": _stateless(lambda m: nn.Dropout2d(m.p)),
    "ZeroPad2d": _stateless(lambda m: nn.ZeroPad2d(m.padding)),
    "Unflatten": _stateless(lambda m: nn.Unflatten(m.dim, m.unflattened_size)),
    "PixelShuffle": _stateless(lambda m: nn.PixelShuffle(m.upscale_factor)),
    "PixelUnshuffle": _stateless(lambda m: nn.PixelUnshuffle(m.downscale_factor)),
    "Unfold": _stateless(lambda m: nn.Unfold(m.kernel_size, m.dilation, m.padding, m.stride)),
    "Fold": _stateless(lambda m: nn.Fold(m.output_size, m.kernel_size, m.dilation, m.padding, m.stride)),
    "MaxUnpool1d": _stateless(lambda m: nn.MaxUnpool1d(m.kernel_size, m.stride, m.padding)),
    "MaxUnpool2d": _stateless(lambda m: nn.MaxUnpool2d(m.kernel_size, m.stride, m.padding)),
    "MultiheadAttention": _composite(nn.MultiheadAttention, "embed_dim", "num_heads", "dropout", "batch_first",
                                     "kdim", "vdim", "head_dim", "_qkv_same_embed_dim"),
    "TransformerEncoderLayer": _composite(nn.TransformerEncoderLayer, "norm_first"),
    "TransformerDecoderLayer": _composite(nn.TransformerDecoderLayer, "norm_first"),
    "TransformerEncoder": _composite(nn.TransformerEncoder, "num_layers", "norm", "enable_nested_tensor",
                                     "mask_check"),
    "TransformerDecoder": _composite(nn.TransformerDecoder, "num_layers", "norm"),
    "Transformer": _composite(nn.Transformer, "d_model", "nhead", "batch_first"),
    "RNN": _recurrent(nn.RNN, *_RECURRENT, "nonlinearity"),
    "LSTM": _recurrent(nn.LSTM, *_RECURRENT, "proj_size"),
    "GRU": _recurrent(nn.GRU, *_RECURRENT),
    "RNNCell": _recurrent(nn.RNNCell, *_CELL, "nonlinearity"),
    "LSTMCell": _recurrent(nn.LSTMCell, *_CELL),
    "GRUCell": _recurrent(nn.GRUCell, *_CELL),
}
