"""Containers: Sequential, ModuleList and ModuleDict register the modules they hold."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from ember.nn.module import Module, structure_changed


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
