"""`ember.save` / `ember.load`: state dicts as safetensors files.

Tensors are stored under their dotted paths in the dict (`layer.0.weight`,
`state.3.exp_avg`), so the file of a model's state dict is an ordinary safetensors
checkpoint that other tools read. Everything that is not a tensor (an optimizer's
hyper-parameters, step counts, integer keys, tuples) is kept as JSON in the file's
metadata under "ember.structure", from which `load` rebuilds the original nesting.
"""

from __future__ import annotations

import json
import os

import numpy as np
import safetensors
import safetensors.numpy

from ember import dtypes
from ember.ops.creation import tensor
from ember.tensor import Tensor

_STRUCTURE_KEY = "ember.structure"
# safetensors' dtype codes; safetensors.numpy does not read BF16, so files are decoded here
_DTYPES = {"F64": dtypes.float64, "F32": dtypes.float32, "F16": dtypes.float16, "BF16": dtypes.bfloat16,
           "I64": dtypes.int64, "I32": dtypes.int32, "I16": dtypes.int16, "I8": dtypes.int8, "U8": dtypes.uint8,
           "BOOL": dtypes.bool_}


def save(obj: dict, path: str | os.PathLike) -> None:
    """Write a (possibly nested) dict of Tensors and plain values to a safetensors file."""
    if not isinstance(obj, dict):
        hint = "; save its state_dict() instead" if hasattr(obj, "state_dict") else ""
        raise TypeError(f"save: expected a dict (a state dict), got {type(obj).__name__}{hint}")
    arrays: dict[str, np.ndarray] = {}
    structure = _encode(obj, "", arrays)
    safetensors.numpy.save_file(arrays, os.fspath(path), metadata={_STRUCTURE_KEY: json.dumps(structure)})


def load(path: str | os.PathLike, map_location=None) -> dict:
    """Read a file written by `save` (or any safetensors file, as a flat dict of Tensors) onto `map_location`."""
    with open(path, "rb") as f:
        data = f.read()
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
    tensors = {}
    for name, entry in safetensors.deserialize(data):
        if entry["dtype"] not in _DTYPES:
            raise TypeError(f"load: tensor {name!r} has dtype {entry['dtype']}, which ember does not support")
        dtype = _DTYPES[entry["dtype"]]
        array = np.frombuffer(entry["data"], dtype=dtype.np).reshape(entry["shape"])
        tensors[name] = tensor(array, dtype=dtype, device=map_location)
    if _STRUCTURE_KEY not in metadata:
        return tensors
    return _decode(json.loads(metadata[_STRUCTURE_KEY]), tensors)


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
