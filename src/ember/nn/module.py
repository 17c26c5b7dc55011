"""Module and Parameter: the containers that hold a model's state, with PyTorch's API.

A Module registers the Parameters, buffers and submodules assigned to its attributes,
so `parameters()`, `state_dict()` and `to()` can find them. Parameters are updated in
place (`assign`) by optimizers and `load_state_dict`, so a model keeps the same
Parameter objects for its whole life; only the graph node behind each one changes.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator

import numpy as np

from ember import dtypes
from ember.autograd import no_grad
from ember.device import check_memory_format, preserve_format
from ember.errors import DTypeError
from ember.ops.creation import tensor as _tensor
from ember.ops.creation import zeros
from ember.runtime import executor
from ember.tensor import Tensor, realize, to_arguments


class Parameter(Tensor):
    """A leaf Tensor that a Module registers as a learnable parameter."""

    __slots__ = ()

    def __init__(self, data: Tensor | None = None, requires_grad: bool = True):
        if data is None:
            data = zeros(0)
        if not isinstance(data, Tensor):
            raise TypeError(f"Parameter: data must be a Tensor, got {type(data).__name__}")
        if requires_grad and not data.dtype.is_floating_point:
            raise DTypeError(f"Parameter: only floating-point tensors can require gradients, not {data.dtype.name}")
        super().__init__(data._node, requires_grad)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    __str__ = __repr__


_IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

# counts changes to what any module registers (which parameters, buffers and submodules; not a buffer's new
# value): a replayed step (ember.jit) compares the parameters and submodules it recorded one by one only after one
generation = 0


def structure_changed() -> None:
    """Note that some module's parameters, buffers or submodules changed (every edit of those registries
    calls this)."""
    global generation
    generation += 1


class Module:
    """Base class of every layer and model: subclass it, assign layers in `__init__`, write `forward`."""

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward(); define one in the subclass")

    def __call__(self, *args, **kwargs):
        recorder = executor.this_thread.recorder
        if recorder is not None:  # a recorded step depends on train/eval mode and on which parameters train
            recorder.note_module(self)
        return self.forward(*args, **kwargs)

    # -- registration -------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"cannot assign {name!r} before Module.__init__() is called "
                                 f"(call super().__init__() first in {type(self).__name__}.__init__)")
        if isinstance(value, Parameter):
            self._forget(name, keep=self._parameters)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._forget(name, keep=self._modules)
            self._modules[name] = value
        elif name in self._parameters:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as parameter {name!r} "
                                "(ember.nn.Parameter or None expected)")
            self._forget(name, keep=self._parameters)
            self._parameters[name] = None
        elif name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as child module {name!r} "
                                "(ember.nn.Module or None expected)")
            self._forget(name, keep=self._modules)
            self._modules[name] = None
        elif name in self._buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign {type(value).__name__} as buffer {name!r} (Tensor or None expected)")
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name: str, keep: dict | None = None) -> None:
        """Unregister `name` everywhere but `keep`, the registry about to take it again (where it keeps its
        place, as a dict's assignment does: a Sequential's replaced layer stays where it was)."""
        structure_changed()
        self.__dict__.pop(name, None)
        for registry in (self._parameters, self._buffers, self._modules):
            if registry is not keep:
                registry.pop(name, None)
        self._non_persistent.discard(name)

    def __getattr__(self, name: str):
        # only called when normal lookup fails: the registered state lives in the three dicts
        d = self.__dict__
        for registry in ("_parameters", "_buffers", "_modules"):
            if registry in d and name in d[registry]:
                return d[registry][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if any(name in r for r in (self._parameters, self._buffers, self._modules)):
            self._forget(name)
        else:
            object.__delattr__(self, name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules))

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter: {name!r} must be a Parameter or None, got {type(param).__name__}")
        self._check_name(name)
        self._forget(name, keep=self._parameters)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """State that is not learned (running statistics): saved in `state_dict` unless not persistent."""
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"register_buffer: {name!r} must be a Tensor or None, got {type(tensor).__name__}")
        self._check_name(name)
        self._forget(name, keep=self._buffers)
        self._buffers[name] = tensor
        if not persistent:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module: {name!r} must be a Module or None, got {type(module).__name__}")
        self._check_name(name)
        self._forget(name, keep=self._modules)
        self._modules[name] = module

    register_module = add_module

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"invalid name {name!r}: a non-empty string without '.' is required")
        if hasattr(type(self), name):
            raise KeyError(f"attribute {name!r} already exists on {type(self).__name__}")

    # -- traversal ----------------------------------------------------------------------
    def named_modules(self, memo: set | None = None, prefix: str = "") -> Iterator[tuple[str, Module]]:
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is not None:
                yield from module.named_modules(memo, f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        seen = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, registry: str, prefix: str, recurse: bool) -> Iterator[tuple[str, Tensor]]:
        seen = set()
        modules = self.named_modules(prefix=prefix) if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for name, value in getattr(module, registry).items():
                if value is None or id(value) in seen:
                    continue
                seen.add(id(value))
                yield (f"{module_prefix}.{name}" if module_prefix else name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        """Every Parameter once (shared ones under their first name), with its dotted name."""
        return self._named_members("_parameters", prefix, recurse)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Tensor]]:
        return self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> Module:
        module = self
        for part in target.split(".") if target else []:
            if part not in module._modules or module._modules[part] is None:
                raise AttributeError(f"{type(module).__name__} has no submodule {part!r} (looking up {target!r})")
            module = module._modules[part]
        return module

    def apply(self, fn: Callable[[Module], None]) -> Module:
        """Call `fn` on every submodule (children first) and on self, e.g. for custom initialisation."""
        for module in self.children():
            module.apply(fn)
        fn(self)
        return self

    # -- modes and gradients ------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        if not isinstance(mode, bool):
            raise ValueError(f"train(): mode must be a bool, got {mode!r}")
        recorder = executor.this_thread.recorder
        if recorder is not None:  # a step that sets the mode itself: its replays set it as well
            recorder.refresh(functools.partial(self.train, mode))
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad = None if set_to_none else zeros(p.shape, dtype=p.grad.dtype, device=p.grad.device)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self, destination: dict | None = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Parameters and persistent buffers by dotted name (a module shared by two parents under both names).

        The values are detached snapshots: they keep showing this moment's values after
        later optimizer steps (pass keep_vars=True for the Parameter objects themselves).
        """
        out = OrderedDict() if destination is None else destination
        for name, p in self._parameters.items():
            if p is not None:
                out[prefix + name] = p if keep_vars else p.detach()
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent:
                out[prefix + name] = b if keep_vars else b.detach()
        for name, module in self._modules.items():
            if module is not None:
                module.state_dict(out, f"{prefix}{name}.", keep_vars)
        return out

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Copy values into this model's Parameters and buffers (in place; dtypes are cast).

        Shape mismatches always fail; missing or unexpected keys fail when `strict`.
        Nothing is copied unless everything fits.
        """
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        if strict:
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
            if missing:
                errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        values = {}
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not isinstance(value, Tensor):
                value = _tensor(np.asarray(value))
            if value.shape != target.shape:
                errors.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                              f"the shape in current model is {target.shape}.")
            values[key] = value
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors))
        with no_grad():
            for key, value in values.items():
                own[key].copy_(value)
        return _IncompatibleKeys(missing, unexpected)

    # -- placement and dtype ----------------------------------------------------------------
    def to(self, *args, **kwargs) -> Module:
        """Move (`to("cuda")`) and/or cast (`to(ember.bfloat16)`) parameters and buffers in place.

        Only floating-point tensors change dtype, as in PyTorch; gradients follow their parameter.
        `memory_format=ember.channels_last` (or torch's) makes the module's convolutions ask for channels-last
        activations, ember.contiguous_format for (N, C, H, W) ones, whatever ember's setting (see conv2d's
        memory_format).
        """
        if "memory_format" in kwargs:
            kwargs = dict(kwargs)
            layout = check_memory_format("Module.to", kwargs.pop("memory_format"))
            if layout != preserve_format:
                for m in self.modules():
                    if hasattr(m, "memory_format"):
                        m.memory_format = layout
        dtype, device = to_arguments(args, kwargs)
        dtype = dtypes.as_dtype(dtype) if dtype is not None else None
        return self._convert(lambda t: t.to(device=device, dtype=dtype if t.dtype.is_floating_point else None))

    def _convert(self, fn: Callable[[Tensor], Tensor]) -> Module:
        """Convert every parameter and buffer (and gradient). On a GPU the new values are computed now, in
        one go: left pending, they would be computed inside the first training step, whose graph would then
        differ from every later step's (a second plan to compile)."""
        tensors = []
        with no_grad():
            for t in [*self.parameters(), *self.buffers()]:
                t.data = fn(t)
                tensors.append(t)
                if t.grad is not None:
                    t.grad = fn(t.grad)
                    tensors.append(t.grad)
        on_gpu = [t for t in tensors if t.device.type != "cpu"]
        if on_gpu:
            realize(*on_gpu)
        return self

    def float(self) -> Module:
        return self.to(dtypes.float32)

    def double(self) -> Module:
        return self.to(dtypes.float64)

    def half(self) -> Module:
        return self.to(dtypes.float16)

    def bfloat16(self) -> Module:
        return self.to(dtypes.bfloat16)

    def cpu(self) -> Module:
        return self.to("cpu")

    def cuda(self, index: int | None = None) -> Module:
        return self.to("cuda" if index is None else f"cuda:{index}")

    # -- printing -------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """The constructor arguments shown between the parentheses of `repr`."""
        return ""

    def __repr__(self) -> str:
        lines = [line for line in self.extra_repr().split("\n") if line]
        for name, module in self._modules.items():
            body = repr(module).replace("\n", "\n  ")
            lines.append(f"({name}): {body}")
        if not self._modules:
            return f"{type(self).__name__}({', '.join(lines)})"
        return f"{type(self).__name__}(\n  " + "\n  ".join(lines) + "\n)"
