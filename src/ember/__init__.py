"""ember: a lazy deep-learning framework and kernel-fusion compiler.

Write tensor code with PyTorch's names; nothing runs until a value is needed, and
then the whole pending graph is computed at once.
"""

from ember import amp, data, dtypes, nn, optim
from ember.amp import autocast
from ember.autograd import enable_grad, grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from ember.device import (
    Device,
    channels_last,
    contiguous_format,
    conv_memory_format,
    default_device,
    device,
    get_conv_memory_format,
    get_matmul_precision,
    preserve_format,
    set_conv_memory_format,
    set_device,
    set_matmul_precision,
)
from ember.dtypes import (
    DType,
    bfloat16,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    promote_types,
    result_type,
    uint8,
)
from ember.dtypes import bool_ as bool  # noqa: A001 - the PyTorch name
from ember.errors import (
    CompileError,
    DeviceError,
    DTypeError,
    EmberError,
    OutOfMemoryError,
    ShapeError,
    UnsupportedOperatorError,
)
from ember.explain import explain
from ember.frontends import from_onnx, from_torch
from ember.jit import jit
from ember.ops import *  # noqa: F403 - the op functions are the public API
from ember.ops import __all__ as _ops_all
from ember.placement import memory_stats, on_device
from ember.serialize import load, save
from ember.tensor import Tensor, realize

half = float16
float = float32  # noqa: A001
double = float64
long = int64
int = int32  # noqa: A001
short = int16

from ember import distributed, vision  # noqa: E402, F401 - their functions use the ops above, at call time

__version__ = "0.1.0"

__all__ = [
    "DType", "Device", "Tensor", "CompileError", "DeviceError", "DTypeError", "EmberError", "OutOfMemoryError",
    "ShapeError", "bfloat16", "bool", "default_device", "device", "double", "dtypes", "enable_grad", "float",
    "float16", "float32", "float64", "grad", "half", "inference_mode", "int", "int8", "int16", "int32", "int64",
    "is_grad_enabled", "long", "no_grad", "on_device", "promote_types", "realize", "result_type", "set_grad_enabled",
    "short", "uint8", "data", "nn", "optim", "explain", "load", "save", "jit", "memory_stats", "amp", "autocast",
    "from_torch", "from_onnx", "UnsupportedOperatorError",
    "set_matmul_precision", "get_matmul_precision", "set_conv_memory_format", "get_conv_memory_format",
    "conv_memory_format", "channels_last", "contiguous_format", "preserve_format", "vision", "set_device", *_ops_all,
]
