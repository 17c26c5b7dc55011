"""ember as an ONNX backend (`onnx.backend.base.Backend`): what ONNX's conformance runner
(`onnx.backend.test.BackendTest`) and other backend users call. Public as `ember.onnx`.

`prepare` imports the model (`from_onnx`) on the ember device of ONNX's device name ("CPU" is ember's reference
backend, "CUDA" its GPU backend); the prepared model's `run` takes and returns NumPy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

import ember
from ember.device import as_device
from ember.frontends.onnx.model import OnnxModule, load_model
from ember.frontends.onnx.values import to_array, to_tensor

_DEVICES = {DeviceType.CPU: "cpu", DeviceType.CUDA: "cuda"}


def _ember_device(device: str) -> ember.Device:
    return as_device(_DEVICES[Device(device).type])


class EmberRep(BackendRep):
    """A model imported for one device: `run(inputs)` computes its outputs as NumPy arrays."""

    def __init__(self, module: OnnxModule, device: ember.Device) -> None:
        self.module, self.device = module, device

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            inputs = [inputs[name] for name in self.module.input_names]
        elif not isinstance(inputs, (list, tuple)):
            inputs = [inputs]
        values = [_to_value(x, self.device) for x in inputs]
        with ember.no_grad():
            outputs = self.module(*values)
        outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
        ember.realize(*[o for o in outputs if isinstance(o, ember.Tensor)],
                      *[t for o in outputs if isinstance(o, list) for t in o])
        arrays = [_to_output(o, declared) for o, declared in zip(outputs, self.module.declared_output_types)]
        return namedtupledict("Outputs", self.module.output_names)(*arrays)


def _to_value(x, device):
    if x is None:
        return None
    if isinstance(x, list):
        return [_to_value(v, device) for v in x]
    return to_tensor(x, device)


def _to_output(value, declared):
    if isinstance(value, list):
        return [_to_output(v, None) for v in value]
    if value is None:
        return None
    return to_array(value, declared)


class EmberBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto | str | bytes, device: str = "CPU", **kwargs: Any) -> EmberRep:
        where = _ember_device(device)
        return EmberRep(OnnxModule(load_model(model), where), where)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple[Any, ...]:
        """Runs one node on NumPy inputs, as a model of that node alone (at the newest opset unless `opset_version`
        is given)."""
        arrays = [np.asarray(x) for x in (inputs.values() if isinstance(inputs, dict) else inputs)]
        names = [name for name in node.input if name]
        graph = helper.make_graph(
            [node], "run_node",
            [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
             for name, a in zip(names, arrays)],
            [helper.make_empty_tensor_value_info(name) for name in node.output if name])
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(node.domain, opset)])
        return cls.run_model(model, arrays, device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        kind = Device(device).type
        return kind == DeviceType.CPU or (kind == DeviceType.CUDA and _cuda_available())


def _cuda_available() -> bool:
    """Whether ember has a cuda device here (a GPU, or Triton's interpreter): only asked about CUDA, as the cpu
    path never loads torch."""
    try:
        from ember.runtime import cuda  # noqa: PLC0415 - loads torch
    except ModuleNotFoundError:
        return False
    return cuda.is_available()


prepare = EmberBackend.prepare
run_model = EmberBackend.run_model
run_node = EmberBackend.run_node
supports_device = EmberBackend.supports_device
is_compatible = EmberBackend.is_compatible
