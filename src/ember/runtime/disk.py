"""ember's disk cache (`~/.cache/ember`, or `EMBER_CACHE_DIR`): its folders, atomic writes, and the
generated kernel modules, which Triton needs as real files to import.

Threads of one process and several processes share the cache: a file is written under a name of its own
in the same folder and renamed over its entry, so a reader sees the old file or the whole new one and two
writers of the same entry never touch each other's temporary file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import CompileError
from ember.runtime import triton_interpreter

if TYPE_CHECKING:
    from ember.compiler import KernelSource


def cache_dir(kind: str = "kernels") -> Path:
    root = Path(os.environ.get("EMBER_CACHE_DIR", Path.home() / ".cache" / "ember"))
    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write through a temporary file of a unique name beside `path` and a rename: a reader sees the old
    file or the whole new one, whoever else writes the same entry at the same time."""
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, _FILE_MODE)  # mkstemp's 0600 would hide the entry from other users of a shared cache
        with os.fdopen(handle, "wb") as file:
            file.write(data if isinstance(data, bytes) else data.encode())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


_modules: dict[tuple[str, bool], object] = {}  # (kernel name, interpreted) -> its module
_loading = threading.Lock()  # a kernel is imported once, whichever thread asks first


def source_path(source: KernelSource) -> Path:
    return cache_dir() / f"{source.name}.py"


def load_source(source: KernelSource, interpret: bool):
    """Write the source to the cache directory and import it, once per process and way of running (compiled for
    the GPU, or `interpret`ed: see RuntimeTarget.interpret)."""
    module = _modules.get((source.name, interpret))
    if module is not None:
        return module
    with _loading:
        if (source.name, interpret) in _modules:
            return _modules[source.name, interpret]
        return _import(source, interpret)


def _import(source: KernelSource, interpret: bool):
    path = source_path(source)
    if not path.exists() or path.read_bytes() != source.text.encode():  # absent, or not this source
        write_atomically(path, source.text)
    if "kernels" in os.environ.get("EMBER_DEBUG", ""):
        print(f"ember: kernel {source.name} -> {path}", file=sys.stderr)
    spec = importlib.util.spec_from_file_location(source.name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a generated kernel that does not import is a compiler bug
        raise CompileError(f"generated kernel {source.name} failed to load: {error} (source: {path})") from error
    _modules[source.name, interpret] = triton_interpreter.runnable(module, interpret)
    return module
