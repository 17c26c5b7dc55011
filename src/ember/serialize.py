"""`ember.save` / `ember.load`: state dicts as safetensors files.

Tensors are stored under their dotted paths in the dict (`layer.0.weight`,
`state.3.exp_avg`), so the file of a model's state dict is an ordinary safetensors
checkpoint that other tools read. Everything that is not a tensor (an optimizer's
hyper-parameters, step counts, integer keys, tuples) is kept as JSON in the file's
metadata under "ember.structure", from which `load` rebuilds the original nesting.
Both take a path or a binary file object (an open file, io.BytesIO), as torch.save and
torch.load do; a file that is not safetensors (one torch.save wrote, say) is refused
with what it looks like and how to convert it.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from typing import BinaryIO

import numpy as np
import safetensors
import safetensors.numpy

from ember import dtypes
from ember.errors import describe, type_name
from ember.ops.creation import tensor
from ember.tensor import Tensor

_STRUCTURE_KEY = "ember.structure"
# safetensors' dtype codes; safetensors.numpy does not read BF16, so files are decoded here
_DTYPES = {"F64": dtypes.float64, "F32": dtypes.float32, "F16": dtypes.float16, "BF16": dtypes.bfloat16,
           "I64": dtypes.int64, "I32": dtypes.int32, "I16": dtypes.int16, "I8": dtypes.int8, "U8": dtypes.uint8,
           "BOOL": dtypes.bool_}


def save(obj: dict, f: str | os.PathLike | BinaryIO) -> None:
    """Write a (possibly nested) dict of Tensors and plain values as safetensors, to the file at path `f` or
    into the binary file object `f` (an open file, io.BytesIO), at its position."""
    if not isinstance(obj, dict):
        hint = "; save its state_dict() instead" if hasattr(obj, "state_dict") else ""
        raise TypeError(f"save: expected a dict (a state dict), got {type(obj).__name__}{hint}")
    arrays: dict[str, np.ndarray] = {}
    structure = _encode(obj, "", arrays)
    metadata = {_STRUCTURE_KEY: json.dumps(structure)}
    if isinstance(f, (str, os.PathLike)):
        safetensors.numpy.save_file(arrays, os.fspath(f), metadata=metadata)
    elif hasattr(f, "write") and not isinstance(f, io.TextIOBase):
        f.write(safetensors.numpy.save(arrays, metadata=metadata))
    else:
        raise TypeError(f"save: expected a path or a file object opened in binary mode ('wb'), got {describe(f)}")


def load(f: str | os.PathLike | BinaryIO, map_location=None) -> dict:
    """Read safetensors written by `save` (or any safetensors file, as a flat dict of Tensors) onto
    `map_location`, from the file at path `f` or from the binary file object `f` (read from its position)."""
    data, name = _read(f)
    try:
        entries = safetensors.deserialize(data)
    except safetensors.SafetensorError as e:
        raise ValueError(f"load: {name} is not a safetensors file: {_what_it_is(data, e)}") from None
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
    tensors = {}
    for key, entry in entries:
        if entry["dtype"] not in _DTYPES:
            raise TypeError(f"load: tensor {key!r} of {name} has dtype {entry['dtype']}, which ember does not "
                            "support")
        dtype = _DTYPES[entry["dtype"]]
        array = np.frombuffer(entry["data"], dtype=dtype.np).reshape(entry["shape"])
        tensors[key] = tensor(array, dtype=dtype, device=map_location)
    if _STRUCTURE_KEY not in metadata:
        return tensors
    try:
        return _decode(json.loads(metadata[_STRUCTURE_KEY]), tensors)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"load: {name} holds a corrupt {_STRUCTURE_KEY!r} entry in its metadata ({type(e).__name__}: "
                         f"{e}); its tensors are readable by safetensors itself, as a flat dict") from None


def _read(f) -> tuple[bytes, str]:
    """The bytes of the file at path `f`, or what is left to read of the file object `f`, and how messages
    name it."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as file:
            return file.read(), repr(os.fspath(f))
    if not hasattr(f, "read"):
        raise TypeError(f"load: expected a path or a file object opened in binary mode ('rb'), got {describe(f)}")
    data = f.read()
    name = repr(f.name) if isinstance(getattr(f, "name", None), str) else f"the {type_name(f)} object"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"load: {name} gave {type(data).__name__}, not bytes; open the file in binary mode ('rb')")
    return bytes(data), name


_FROM_TORCH = ("ember reads safetensors files only: load it with torch.load and convert each tensor with "
               "ember.tensor (`ember.save({k: ember.tensor(v) for k, v in torch.load(path).items()}, "
               "'model.safetensors')` once), or build the model in torch and import it with ember.from_torch")


def _what_it_is(data: bytes, error: Exception) -> str:
    """What a file that safetensors refused looks like, and what to do about it."""
    if not data:
        return "it is empty"
    if data.startswith(b"PK\x03\x04"):
        try:
            names = zipfile.ZipFile(io.BytesIO(data)).namelist()
        except zipfile.BadZipFile:
            names = []
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return f"it is a zip archive written by torch.save; {_FROM_TORCH}"
        return "it is a zip archive (NumPy's savez writes those)"
    if data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return f"it is a pickle (torch.save's legacy format, or pickle.dump); {_FROM_TORCH}"
    if data.startswith(b"\x93NUMPY"):
        return "it is a NumPy .npy file; read it with numpy.load and convert it with ember.tensor"
    header_len = int.from_bytes(data[:8], "little")
    if len(data) > 8 and data[8:9] == b"{" and header_len < 100_000_000:
        return f"it starts as one but is cut short or corrupt ({len(data)} bytes; safetensors says: {error})"
    return ("it does not start with a safetensors header (an 8-byte little-endian length, then that many bytes "
            f"of JSON); its first bytes are {data[:16]!r}")


def _join(prefix: str, key) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _encode(value, path: str, arrays: dict[str, np.ndarray]):
    """The JSON form of `value`; its tensors are moved into `arrays` under their dotted paths."""
    if isinstance(value, Tensor):
        if path in arrays:
            raise ValueError(f"save: two tensors would be stored under the name {path!r}")
        arrays[path] = np.require(value.numpy(), requirements="C")  # (np.ascontiguousarray makes 0-d 1-d)
        return {"tensor": path}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"save: dict keys must be str or int, got {key!r} at {path or 'the top level'}")
        return {"dict": [[key, _encode(v, _join(path, key), arrays)] for key, v in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, _join(path, i), arrays) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return {"value": value.item()}
    raise TypeError(f"save: cannot store a value of type {type(value).__name__} at {path or 'the top level'}")


def _decode(node: dict, tensors: dict[str, Tensor]):
    ((kind, body),) = node.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {key: _decode(v, tensors) for key, v in body}
    if kind == "list":
        return [_decode(v, tensors) for v in body]
    if kind == "tuple":
        return tuple(_decode(v, tensors) for v in body)
    return body
