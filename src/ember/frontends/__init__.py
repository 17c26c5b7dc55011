"""Models from other frameworks as ember modules."""

from ember.frontends.onnx import from_onnx
from ember.frontends.torch import from_torch

__all__ = ["from_onnx", "from_torch"]
