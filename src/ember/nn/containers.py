"""Containers: Sequential, ModuleList and ModuleDict register the modules they hold; ParameterList and
ParameterDict the parameters."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from ember.nn.module import Module, Parameter, structure_changed
from ember.tensor import Tensor


def _index(i: int, n: int, container: str) -> int:
    if not -n <= i < n:
        raise IndexError(f"{container}: index {i} is out of range for {n} modules")
    return i % n


class Sequential(Module):
    """Modules applied one after the other: `Sequential(a, b, c)(x) == c(b(a(x)))`."""

    def __init__(self, *args) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)

    def forward(self, input):
        for module in self._modules.values():
            input = module(input)
        return input

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Sequential(OrderedDict(list(self._modules.items())[index]))
        return list(self._modules.values())[_index(index, len(self), "Sequential")]

    def __setitem__(self, index: int, module: Module) -> None:
        key = list(self._modules)[_index(index, len(self), "Sequential")]
        self.add_module(key, module)

    def __delitem__(self, index) -> None:
        keys = list(self._modules)
        for key in (keys[index] if isinstance(index, slice) else [keys[_index(index, len(keys), "Sequential")]]):
            del self._modules[key]
        structure_changed()

    def append(self, module: Module) -> Sequential:
        self.add_module(str(len(self)), module)
        return self


class ModuleList(Module):
    """A list of modules whose parameters the parent module sees; it has no forward of its own."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def _renumber(self, modules: list[Module]) -> None:
        self._modules.clear()
        structure_changed()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __getitem__(self, index):
        modules = list(self._modules.values())
        if isinstance(index, slice):
            return ModuleList(modules[index])
        return modules[_index(index, len(modules), "ModuleList")]

    def __setitem__(self, index: int, module: Module) -> None:
        self.add_module(str(_index(index, len(self), "ModuleList")), module)

    def __delitem__(self, index) -> None:
        modules = list(self._modules.values())
        del modules[index if isinstance(index, slice) else _index(index, len(modules), "ModuleList")]
        self._renumber(modules)

    def append(self, module: Module) -> ModuleList:
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: Module) -> None:
        modules = list(self._modules.values())
        modules.insert(index, module)
        self._renumber(modules)


class ModuleDict(Module):
    """A dict of modules, by name, whose parameters the parent module sees."""

    def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]
        structure_changed()

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        for key, module in (modules.items() if isinstance(modules, Mapping) else modules):
            self.add_module(key, module)


def _as_parameter(value):
    """What a parameter container stores: a Tensor as a Parameter (sharing its data), anything else as it is."""
    return Parameter(value) if isinstance(value, Tensor) and not isinstance(value, Parameter) else value


class ParameterList(Module):
    """A list of parameters, registered under "0", "1", ... so that the parent module's `parameters()` and
    `state_dict()` see them. Tensors are made Parameters; other values are kept but not registered."""

    def __init__(self, values: Iterable | None = None) -> None:
        super().__init__()
        self._size = 0
        if values is not None:
            self.extend(values)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator:
        return (getattr(self, str(i)) for i in range(self._size))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ParameterList(list(self)[index])
        return getattr(self, str(_index(index, self._size, "ParameterList")))

    def __setitem__(self, index: int, value) -> None:
        setattr(self, str(_index(index, self._size, "ParameterList")), _as_parameter(value))

    def append(self, value) -> ParameterList:
        self._size += 1
        self[self._size - 1] = value
        return self

    def extend(self, values: Iterable) -> ParameterList:
        for value in values:
            self.append(value)
        return self

    def extra_repr(self) -> str:
        return "\n".join(f"({i}): {_describe(v)}" for i, v in enumerate(self))


class ParameterDict(Module):
    """A dict of parameters whose keys are their names in `parameters()` and `state_dict()`. As torch's, a plain
    dict given to the constructor or `update` is added in sorted key order; ordered mappings keep theirs."""

    def __init__(self, parameters: Mapping | Iterable[tuple[str, object]] | None = None) -> None:
        super().__init__()
        self._keys: dict[str, None] = {}
        if parameters is not None:
            self.update(parameters)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __getitem__(self, key: str):
        if key not in self._keys:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        self._keys[key] = None
        setattr(self, key, _as_parameter(value))

    def __delitem__(self, key: str) -> None:
        del self._keys[key]
        delattr(self, key)

    def keys(self):
        return self._keys.keys()

    def values(self):
        return [self[key] for key in self._keys]

    def items(self):
        return [(key, self[key]) for key in self._keys]

    def get(self, key: str, default=None):
        return self[key] if key in self._keys else default

    def pop(self, key: str):
        value = self[key]
        del self[key]
        return value

    def update(self, parameters: Mapping | Iterable[tuple[str, object]]) -> None:
        if isinstance(parameters, (OrderedDict, ParameterDict)):
            pairs = list(parameters.items())
        elif isinstance(parameters, Mapping):
            pairs = sorted(parameters.items())
        else:
            pairs = list(parameters)
        for key, value in pairs:
            self[key] = value

    def extra_repr(self) -> str:
        return "\n".join(f"({k}): {_describe(v)}" for k, v in self.items())


def _describe(value) -> str:
    if isinstance(value, Tensor):
        kind = "Parameter containing" if isinstance(value, Parameter) else "Tensor"
        return f"{kind}: [{value.dtype.name} of size {tuple(value.shape)}]"
    return repr(value)
