"""One launch of a generated Triton kernel, prepared once per plan and launched without Triton's per-call
binding.

Triton's `JITFunction.run` binds every argument by name, specializes each, builds a cache-key string and
checks the kernel's globals on every call: some 20 µs for a small kernel, milliseconds for a multi-tensor
kernel with hundreds of pointers. A launch ember prepares has its grid, constexprs and options fixed; from
one call to the next only its buffers and runtime scalars change, and of those Triton's choice of compiled
kernel depends only on what it specializes on: whether a pointer is 16-byte aligned and an integer's class
(equal to 1, a multiple of 16, 32 or 64 bits). So a `Launch` keeps the compiled kernel Triton chose for each
such class (the first call of a class goes through `run`, which compiles or finds it) and later calls the
kernel's launcher itself, with the arguments `run` passes it (the same in Triton 3.6 and later).

Under the interpreter, or with a launch hook set (a profiler's), every call goes through `run`."""

from __future__ import annotations

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # the cpu path needs no Triton; a Launch is made only where it is installed
    _knobs = None


class Launch:
    """A kernel function, its grid and options, and a recipe for its arguments: per parameter,
    (0, key) a buffer of the run, (1, value) a fixed value, (2, index) one of the signature's scalars;
    `interpret`: the function runs in Triton's interpreter (the runtime target's `interpret`)."""

    __slots__ = ("fn", "grid", "recipe", "options", "_direct", "_kernels", "_tail", "_grid3", "_tensors",
                 "_scalars")

    def __init__(self, fn, grid: tuple, recipe: list, options: dict, interpret: bool):
        self.fn, self.grid, self.recipe, self.options = fn, grid, recipe, options
        self._direct = not interpret and _knobs is not None  # warm calls may skip Triton's `run`
        self._kernels: dict[tuple, object] = {}  # (device, specialization class) -> Triton's compiled kernel
        self._tail: list | None = None  # the constexpr parameters' values, after the positional arguments
        self._grid3 = (*grid, 1, 1)[:3]
        self._tensors = [i for i, (kind, _) in enumerate(recipe) if kind == 0]
        self._scalars = [i for i, (kind, _) in enumerate(recipe) if kind == 2]

    def arguments(self, buffers: dict[int, torch.Tensor], scalars: list) -> list:
        args = []
        for kind, value in self.recipe:
            args.append(buffers[value] if kind == 0 else value if kind == 1 else scalars[value])
        return args

    def __call__(self, args: list) -> None:
        if not self._direct or _hooked(_knobs.runtime.launch_enter_hook) or _hooked(_knobs.runtime.launch_exit_hook):
            self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
            return
        device = torch._C._cuda_getDevice()
        key = (device, tuple(args[i].data_ptr() & 15 == 0 for i in self._tensors),
               tuple(_int_class(args[i]) for i in self._scalars))
        kernel = self._kernels.get(key)
        if kernel is None:
            self._first(key, args)
            return
        kernel.run(*self._grid3, torch._C._cuda_getCurrentRawStream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *self._tail)

    def _first(self, key: tuple, args: list) -> None:
        """Launch through Triton's `run` (compiling if need be) and keep the kernel it chose for `key`."""
        kernel = self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
        if hasattr(kernel, "result"):  # a compile Triton ran asynchronously
            kernel = kernel.result()
        if self._tail is None:
            params = self.fn.params[len(args):]
            self._tail = [self.options[p.name] if p.name in self.options else p.default for p in params]
        if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            self._kernels[key] = kernel


def _hooked(hook) -> bool:
    """Whether a launch hook is in use: Triton's hooks are chains, empty unless a profiler adds to them."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _int_class(value) -> object:
    """What Triton's choice of kernel depends on in a runtime scalar: an integer's value class (floats and
    bools are not specialized on their values)."""
    if type(value) is not int:
        return type(value)
    return value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63
