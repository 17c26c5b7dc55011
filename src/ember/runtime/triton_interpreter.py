"""How ember's Triton kernels are made runnable: compiled for the GPU, or run by Triton's CPU interpreter.

With `EMBER_INTERPRET=1` the cuda backend runs generated kernels through the interpreter, which is
how they are tested without a GPU. That choice is ember's and is made per kernel object here
(`runnable`), never through Triton's process-wide `TRITON_INTERPRET`: a Triton kernel elsewhere in
the process (torch.compile's, a test's) neither changes ember's kernels nor is changed by them.
Interpreted kernels get a private copy of the helper library (the interpreter writes its own names
into the globals of what it runs, and runs no libdevice).

The rest of the module fixes bugs of the interpreter that a GPU does not have, so a test failure
points at the generated code, not at the interpreter; they are applied with the first interpreted
module and change nothing a compiled kernel does. One of them: the interpreter runs a grid by patching
`triton.language` and a builder that are process-wide, so grids from several threads run one at a time
(and kernels are parsed one at a time: CPython 3.11's `ast.parse` can fail in two threads at once).
Two more make it quicker without changing a result: integer arithmetic wraps as a compiled kernel's does
(without Triton's debug mode; the interpreter otherwise checks every integer addition and multiplication for
overflow), and a device function called inside a grid finds `triton.language` patched for the grid already
(the interpreter patches it again on every such call, a walk over all its modules' members). In kernels that
call library functions often, the two are half the interpreter's time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import threading
from types import ModuleType

import ml_dtypes
import numpy as np
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

from ember.compiler import TRITON_LIBRARY
from ember.errors import CompileError

# The patched internals; a Triton that renamed them is left as it is (its tests then show why).
_Builder = getattr(interpreter, "InterpreterBuilder", None)
_binary_op = getattr(_Builder, "binary_op", None)
_cast_impl = getattr(_Builder, "cast_impl", None)
_create_dot = getattr(_Builder, "create_dot", None)
_Executor = getattr(interpreter, "GridExecutor", None)
_builder = getattr(interpreter, "interpreter_builder", None)
_run = _Executor.__dict__.get("__call__") if _Executor is not None else None
_device_call = interpreter.InterpretedFunction.__dict__.get("__call__")
_rewrite = interpreter.InterpretedFunction.__dict__.get("rewrite")
_patch_lang = getattr(interpreter, "_patch_lang", None)
_Error = getattr(interpreter, "InterpreterError", RuntimeError)
_patched_for_grid: set[int] = set()  # the language modules the running grid has patched (one grid at a time)
_jit_call = JITFunction.__dict__.get("__call__")
_running = threading.local()  # how many interpreted grids this thread is inside
_one_grid_at_a_time = threading.RLock()


def _binary_op_typing_comparisons_as_bool(self, lhs, rhs, op):
    """The interpreter types a comparison's result like its operands, so a scalar comparison that is
    broadcast later (`tile & (scalar > 0)`) turns into floats."""
    out = _binary_op(self, lhs, rhs, op)
    return interpreter.TensorHandle(out.data, tl.int1) if out.data.dtype == np.bool_ else out


def _cast_rounding_bfloat16(self, src, dst_type):
    """The interpreter truncates float32 to bfloat16 and converts nothing else to or from bfloat16;
    a GPU rounds to nearest even, as ml_dtypes does."""
    source, target = src.dtype.scalar, dst_type.scalar
    if tl.bfloat16 not in (source, target):
        return _cast_impl(self, src, dst_type)
    data = src.data.view(ml_dtypes.bfloat16) if source == tl.bfloat16 else src.data
    if target == tl.bfloat16:
        return interpreter.TensorHandle(data.astype(ml_dtypes.bfloat16).view(np.uint16), target)
    return interpreter.TensorHandle(data.astype(interpreter._get_np_dtype(target)), target)


def _dot_reading_bfloat16(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter keeps bfloat16 tiles as their raw 16 bits and multiplies those as integers."""
    if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
        a, b = (interpreter.TensorHandle(x.data.view(ml_dtypes.bfloat16).astype(np.float32), tl.float32)
                if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
    return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def _run_quietly(self, *args, **kwargs):
    """A GPU computes inf and NaN silently; NumPy, which computes for the interpreter, warns each time.
    A grid patches `triton.language` while it runs and unpatches it at the end: one grid at a time."""
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        with _one_grid_at_a_time, np.errstate(all="ignore"):
            outer = set(_patched_for_grid)
            _patched_for_grid.update(_languages(self.fn))
            try:
                return _run(self, *args, **kwargs)
            finally:
                _patched_for_grid.intersection_update(outer)
    finally:
        _running.depth -= 1


def _rewrite_one_at_a_time(self):
    """The interpreter parses a kernel's source with `ast.parse` on its first run, in the caller's thread; in
    CPython 3.11 two threads making AST objects at once can fail ("AST constructor recursion depth mismatch"),
    so kernels are parsed one at a time, under the lock grids run under."""
    with _one_grid_at_a_time:
        return _rewrite(self)


def _languages(fn) -> frozenset[int]:
    """The ids of the `triton.language` modules a function's globals hold (those the interpreter patches)."""
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _call_device_function(self, *args, **kwargs):
    """A device function called from an interpreted kernel: `triton.language` is patched once per grid, not
    again on each call."""
    languages = self.__dict__.get("_ember_languages")
    if languages is None:
        languages = self.__dict__["_ember_languages"] = _languages(self.fn)
    if not languages <= _patched_for_grid:
        _patch_lang(self.fn)
        _patched_for_grid.update(languages)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        raise _Error(repr(error)) from error


def _call_interpreted_inside_a_grid(self, *args, **kwargs):
    """Triton's own library (tl.zeros, tl.sum, tl.randint...) is made of compiled functions unless
    TRITON_INTERPRET was set before triton was imported; called from an interpreted kernel, they run
    interpreted too. Outside an interpreted grid a compiled function behaves as Triton made it."""
    if not getattr(_running, "depth", 0):
        return _jit_call(self, *args, **kwargs)
    twin = self.__dict__.get("_ember_interpreted")  # (hashing a JITFunction would walk its source)
    if twin is None:
        twin = self.__dict__["_ember_interpreted"] = interpreter.InterpretedFunction(self.fn)
    return twin(*args, **kwargs)


def _apply_fixes() -> None:
    options = getattr(_builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        _builder.options = dataclasses.replace(options, sanitize_overflow=False)
    if _binary_op is not None:
        _Builder.binary_op = _binary_op_typing_comparisons_as_bool
    if _cast_impl is not None:
        _Builder.cast_impl = _cast_rounding_bfloat16
    if _create_dot is not None:
        _Builder.create_dot = _dot_reading_bfloat16
    if _run is not None and _jit_call is not None:
        _Executor.__call__ = _run_quietly
        JITFunction.__call__ = _call_interpreted_inside_a_grid
        if _device_call is not None and _patch_lang is not None:
            interpreter.InterpretedFunction.__call__ = _call_device_function
    if _rewrite is not None:
        interpreter.InterpretedFunction.rewrite = _rewrite_one_at_a_time


def runnable(module: ModuleType, interpret: bool) -> ModuleType:
    """Bind a loaded generated-kernel module's kernels and helper library to one way of running."""
    if not interpret and isinstance(tl.zeros, interpreter.InterpretedFunction):
        raise CompileError("Triton was imported with TRITON_INTERPRET=1, so its own library cannot be compiled "
                           "for the GPU; unset TRITON_INTERPRET (EMBER_INTERPRET=1 runs ember's kernels through "
                           "the interpreter)")
    for name, value in list(vars(module).items()):
        if isinstance(value, (JITFunction, interpreter.InterpretedFunction)):
            setattr(module, name, _kernel(value.fn, interpret))
    module.lib = library(interpret)
    return module


def interpreted(fn) -> interpreter.InterpretedFunction:
    """A Triton kernel (a plain function, or one made by @triton.jit) run by the interpreter on torch CPU
    tensors, with the fixes above; nothing else in the process is interpreted."""
    _fixes_applied()
    return interpreter.InterpretedFunction(getattr(fn, "fn", fn))


def _kernel(fn, interpret: bool):
    return interpreted(fn) if interpret else JITFunction(fn)


@functools.cache
def library(interpret: bool) -> ModuleType:
    """A copy of the helper library whose functions run one way; interpreted, a function with a second
    body named `<name>_interpreted` (one the interpreter can run) has that body."""
    spec = importlib.util.spec_from_file_location(f"ember_triton_lib_{'interpreted' if interpret else 'compiled'}",
                                                  TRITON_LIBRARY)
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    runnable_functions = {name: _kernel(value.fn, interpret) for name, value in vars(lib).items()
                          if isinstance(value, (JITFunction, interpreter.InterpretedFunction))}
    vars(lib).update(runnable_functions)
    if interpret:
        vars(lib).update({name.removesuffix("_interpreted"): value for name, value in runnable_functions.items()
                          if name.endswith("_interpreted")})
    return lib


@functools.cache
def _fixes_applied() -> bool:
    _apply_fixes()
    return True
