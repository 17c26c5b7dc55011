"""ember as an ONNX backend: `onnx.backend.base.Backend`'s functions (prepare, run_model, run_node,
supports_device), so `onnx.backend.test.BackendTest(ember.onnx, __name__)` runs ONNX's conformance suite on ember.
Needs the onnx package (`pip install 'ember[onnx]'`); `ember.from_onnx` imports a model as a Module."""

from ember.frontends.onnx.backend import (
    EmberBackend,
    EmberRep,
    is_compatible,
    prepare,
    run_model,
    run_node,
    supports_device,
)

__all__ = ["EmberBackend", "EmberRep", "is_compatible", "prepare", "run_model", "run_node", "supports_device"]
