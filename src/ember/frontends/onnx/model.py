"""An ONNX model as an ember Module: initializers become its parameters (floating point, trainable) and buffers
(integers), and its forward runs the graph (`graph.GraphRunner`) on ember tensors, lazily."""

from __future__ import annotations

import os
import re
from collections import ChainMap

import numpy as np
import onnx

from ember.device import Device, as_device
from ember.errors import UnsupportedOperatorError
from ember.frontends.onnx.graph import GraphRunner, op_key, unsupported
from ember.frontends.onnx.host import FOLD_LIMIT
from ember.frontends.onnx.registry import OPS
from ember.frontends.onnx.values import UnsupportedType, numpy_type, proto_array, to_tensor
from ember.nn.module import Module, Parameter
from ember.tensor import Tensor

# The oldest opset ember reads directly; older models are converted by onnx's version converter.
OLDEST_OPSET = 7


def load_model(model) -> onnx.ModelProto:
    """A ModelProto from a path, serialized bytes or a ModelProto."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model))
    raise TypeError(f"from_onnx: expected a path, bytes or an onnx.ModelProto, got {type(model).__name__}")


class OnnxModule(Module):
    """The computation of an ONNX graph. `forward(*inputs)` takes the graph's inputs in order (`input_names`) and
    returns its outputs in order (`output_names`): one tensor, or a tuple of several."""

    def __init__(self, model: onnx.ModelProto, device: Device | str | None = None) -> None:
        super().__init__()
        opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
        if opsets.get("", OLDEST_OPSET) < OLDEST_OPSET:
            model = onnx.version_converter.convert_version(model, OLDEST_OPSET)
            opsets[""] = OLDEST_OPSET
        graph = model.graph
        device = as_device(device)
        functions = {(f.domain, f.name): f for f in model.functions}
        self._runner = GraphRunner(opsets, functions, device, OPS, _declared_types(graph))
        self._graph = graph
        self._initializers: dict[str, str] = {}  # ONNX name -> attribute name
        for proto in graph.initializer:
            self._add_initializer(proto.name, proto_array(proto), device)
        for proto in graph.sparse_initializer:
            self._add_initializer(proto.values.name, _dense(proto), device)
        self.input_names = [i.name for i in graph.input if i.name not in self._initializers]
        self.output_names = [o.name for o in graph.output]
        self._declared = [_declared_type(o) for o in graph.output]
        _check_supported(graph, opsets, set(functions), self._runner)

    def _add_initializer(self, name: str, array: np.ndarray, device: Device) -> None:
        attribute = _attribute_name(name, self._initializers.values())
        try:
            value = to_tensor(array, device)
        except UnsupportedType as e:
            raise UnsupportedOperatorError(f"ONNX initializer {name!r}: {e}") from None
        if value.dtype.is_floating_point:
            self.register_parameter(attribute, Parameter(value))
        else:
            self.register_buffer(attribute, value)
            if array.size <= FOLD_LIMIT:  # shapes and axes: read on the host, never from the device
                self._runner.host.keep(value, array.astype(value.dtype.np, copy=False))
        self._initializers[name] = attribute

    def forward(self, *inputs):
        if len(inputs) != len(self.input_names):
            raise TypeError(f"the ONNX graph takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                            f"got {len(inputs)}")
        self._runner.host.start()
        values = {name: getattr(self, attribute) for name, attribute in self._initializers.items()}
        # the graph runs where its inputs are (or its initializers, after a module.to): constants are made there
        placed = [v for v in (*inputs, *values.values()) if isinstance(v, Tensor)]
        if placed:
            self._runner.device = placed[0].device
        for name, value in zip(self.input_names, inputs):
            values[name] = value if isinstance(value, (Tensor, list)) or value is None else \
                to_tensor(value, self._runner.device)
        outputs = self._runner.run(self._graph, ChainMap(values))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @property
    def declared_output_types(self) -> list[np.dtype | None]:
        """The NumPy type each output is declared with (None where not a tensor or not declared)."""
        return self._declared

    def extra_repr(self) -> str:
        return f"inputs={self.input_names}, outputs={self.output_names}, nodes={len(self._graph.node)}"


def _attribute_name(name: str, taken) -> str:
    """A Module attribute name for an ONNX initializer name ("conv1.weight", "onnx::Conv_12")."""
    base = re.sub(r"\W", "_", name) or "initializer"
    base = base if not base[0].isdigit() else f"_{base}"
    attribute, n = base, 1
    while attribute in taken or hasattr(Module, attribute):
        attribute, n = f"{base}_{n}", n + 1
    return attribute


def _dense(proto: onnx.SparseTensorProto) -> np.ndarray:
    values, indices = proto_array(proto.values), proto_array(proto.indices)
    dense = np.zeros(tuple(proto.dims), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(indices.T, dense.shape)
    dense.reshape(-1)[flat] = values
    return dense


def _declared_type(value: onnx.ValueInfoProto) -> np.dtype | None:
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.elem_type:
        return None
    try:
        return numpy_type(value.type.tensor_type.elem_type)
    except (KeyError, ValueError, TypeError):
        return None


def _declared_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The element type the graph declares for each named tensor it types (inputs, outputs, value_info,
    initializers), in this graph and its subgraphs."""
    declared = {t.name: t.data_type for t in graph.initializer}
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            declared[value.name] = value.type.tensor_type.elem_type
    for node in graph.node:
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else list(a.graphs)):
                declared.update(_declared_types(sub))
    return declared


def _check_supported(graph: onnx.GraphProto, opsets: dict[str, int], functions: set, runner: GraphRunner) -> None:
    """Fails at import, naming every node whose operator ember can neither run nor expand."""
    problems = []
    for node in graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if op_key(domain, node.op_type) in runner.ops or (domain, node.op_type) in functions:
            continue
        opset = opsets.get(domain, 1)
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        except onnx.defs.SchemaError:
            schema = None
        if schema is None or not (schema.has_function or schema.has_context_dependent_function):
            problems.append(str(unsupported(node, opset, "ember has no implementation of this operator")))
    if problems:
        raise UnsupportedOperatorError("\n".join(problems))
