"""ONNX models as ember modules (`from_onnx`), and ember as an ONNX backend (`backend`, public as `ember.onnx`).

onnx is an optional dependency (`pip install ember[onnx]`): importing ember does not need it, `from_onnx` does.
"""

from __future__ import annotations

import os

from ember.device import Device


def from_onnx(model: str | os.PathLike | bytes, device: Device | str | None = None):
    """An ember Module computing an ONNX model: `model` is a path, serialized bytes or an `onnx.ModelProto`.

    The module's forward takes the graph's inputs in order (`module.input_names`) and returns its outputs in order
    (`module.output_names`), one tensor or a tuple. Floating-point initializers are its parameters (trainable),
    integer ones its buffers, all on `device`. Running it builds ember's lazy graph like native code does, so the
    imported model fuses. An operator ember cannot run fails here, each named with its node, op type and opset.
    """
    try:
        from ember.frontends.onnx.model import OnnxModule, load_model  # noqa: PLC0415 - onnx is optional
    except ModuleNotFoundError as e:
        if e.name != "onnx":
            raise
        raise ModuleNotFoundError("ember.from_onnx needs the onnx package: pip install 'ember[onnx]'") from None
    return OnnxModule(load_model(model), device)


__all__ = ["from_onnx"]
