"""ember's disk cache (`~/.cache/ember`, or `EMBER_CACHE_DIR`): its folders, atomic writes, and the
generated kernel modules, which Triton needs as real files to import."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import CompileError
from ember.runtime import triton_interpreter
from ember.runtime.cuda import INTERPRET

if TYPE_CHECKING:
    from ember.compiler import KernelSource


def cache_dir(kind: str = "kernels") -> Path:
    root = Path(os.environ.get("EMBER_CACHE_DIR", Path.home() / ".cache" / "ember"))
    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write through a temporary file and a rename: a reader sees the old file or the whole new one."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


_modules: dict[str, object] = {}


def source_path(source: KernelSource) -> Path:
    return cache_dir() / f"{source.name}.py"


def load_source(source: KernelSource):
    """Write the source to the cache directory and import it, once per process."""
    if source.name in _modules:
        return _modules[source.name]
    path = source_path(source)
    if not path.exists() or path.read_text() != source.text:
        write_atomically(path, source.text)
    if "kernels" in os.environ.get("EMBER_DEBUG", ""):
        print(f"ember: kernel {source.name} -> {path}", file=sys.stderr)
    spec = importlib.util.spec_from_file_location(source.name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a generated kernel that does not import is a compiler bug
        raise CompileError(f"generated kernel {source.name} failed to load: {error} (source: {path})") from error
    _modules[source.name] = triton_interpreter.runnable(module, INTERPRET)
    return module
