"""Device names. A device is a value ("cpu", "cuda:0"); the runtime maps it to a backend."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass

from ember.errors import DeviceError


@dataclass(frozen=True)
class Device:
    type: str  # "cpu" or "cuda"
    index: int = 0

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device('{self}')"


CPU = Device("cpu")
_KNOWN_TYPES = ("cpu", "cuda")
_state = threading.local()
_current_cuda = [0]  # the GPU that "cuda" without an index names in this process (set_device)


def as_device(d: str | Device | None) -> Device:
    """Parse "cpu", "cuda", "cuda:1" (or a torch.device); None means the current default."""
    if d is None:
        return default_device()
    if isinstance(d, Device):
        return d
    text = str(d)
    kind, _, index = text.partition(":")
    if kind not in _KNOWN_TYPES or (index and not index.isdigit()):
        raise DeviceError(f"unknown device {text!r}; expected 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cpu":
        return CPU
    return _interned(kind, int(index) if index else _current_cuda[0])


def set_device(d: str | Device | int) -> None:
    """Make GPU `d` ("cuda:N", or N) the one "cuda" without an index names in this process, as
    torch.cuda.set_device does for torch: each process of a multi-GPU job takes its own
    (ember.distributed.init_process_group takes the LOCAL_RANK's that torchrun sets)."""
    index = d if isinstance(d, int) else as_device(d).index if str(d).startswith("cuda") else None
    if index is None or index < 0:
        raise DeviceError(f"set_device: expected a GPU ('cuda:N' or its index N), got {d!r}")
    _current_cuda[0] = index


@functools.cache
def _interned(kind: str, index: int) -> Device:
    """One Device object per name, so the hot path compares devices by identity."""
    return Device(kind, index)


def default_device() -> Device:
    return getattr(_state, "default", CPU)


class device:
    """`with ember.device("cuda"):` makes new tensors and modules live on that device."""

    def __init__(self, d: str | Device):
        self.device = as_device(d)

    def __enter__(self) -> Device:
        self._previous = default_device()
        _state.default = self.device
        return self.device

    def __exit__(self, *exc) -> None:
        _state.default = self._previous


_MATMUL_PRECISIONS = ("highest", "high", "medium")
_matmul_precision = ["highest"]
_precision_listeners: list = []  # backends that apply the precision to vendor libraries (cuBLAS, cuDNN)


def set_matmul_precision(precision: str) -> None:
    """How float32 matmuls and convolutions run on cuda, as `torch.set_float32_matmul_precision`:
    "highest" in float32, "high" (or "medium") on TF32 tensor cores (a 10-bit mantissa, about 3e-4
    relative error, several times faster). The cpu reference backend always computes in full."""
    if precision not in _MATMUL_PRECISIONS:
        raise ValueError(f"set_matmul_precision: expected one of {', '.join(_MATMUL_PRECISIONS)}, got {precision!r}")
    _matmul_precision[0] = precision
    for listener in _precision_listeners:
        listener(precision)


def on_matmul_precision(listener) -> None:
    """Call `listener(precision)` on every change of the matmul precision (a backend registers itself
    when it is loaded, and applies the current one then)."""
    _precision_listeners.append(listener)


def get_matmul_precision() -> str:
    return _matmul_precision[0]


# torch.memory_format's names: ember's tensors are values whose layout the compiler chooses, so a memory
# format is a request about the layout of convolutions' activations (see set_conv_memory_format)
contiguous_format = "contiguous"
channels_last = "channels_last"
preserve_format = "preserve"
_CONV_MEMORY_FORMATS = (contiguous_format, channels_last)


def check_memory_format(fn: str, memory_format, allowed=(contiguous_format, channels_last, preserve_format)) -> str:
    """A memory format as ember names it (its own names, or torch's memory_format objects)."""
    name = memory_format if isinstance(memory_format, str) else str(memory_format).removeprefix("torch.")
    name = {"contiguous_format": contiguous_format, "preserve_format": preserve_format}.get(name, name)
    if name not in allowed:
        raise ValueError(f"{fn}: memory_format must be one of {', '.join(allowed)} (ember.channels_last, ...), "
                         f"got {memory_format!r}")
    return name
_conv_memory_format = [os.environ.get("EMBER_CONV_MEMORY_FORMAT", channels_last)]


def set_conv_memory_format(memory_format: str) -> None:
    """Where cuda keeps the activations of float16 and bfloat16 convolutions, named as torch.memory_format:
    "channels_last" ((N, H, W, C), the default: the convolutions run on cuDNN's channels-last kernels, and
    batch norms, activations, poolings and residual adds between them run on the same memory, with no
    transposition between them; the model's inputs and results keep the layout the user gave them) or
    "contiguous" ((N, C, H, W) memory, where cuDNN transposes around each half-precision convolution). Values
    are the same either way; float32 convolutions stay on (N, C, H, W). A convolution keeps the format set when
    it is called (its plan is made later, when a value is read); conv2d's memory_format, and a module's
    (`Module.to(memory_format=...)`), override it. The environment variable EMBER_CONV_MEMORY_FORMAT sets the
    default."""
    _conv_memory_format[0] = check_memory_format("set_conv_memory_format", memory_format, _CONV_MEMORY_FORMATS)


def get_conv_memory_format() -> str:
    return _conv_memory_format[0]


@contextlib.contextmanager
def conv_memory_format(memory_format: str):
    """set_conv_memory_format(memory_format) inside a `with` block, the format before it restored after."""
    before = _conv_memory_format[0]
    set_conv_memory_format(memory_format)
    try:
        yield
    finally:
        _conv_memory_format[0] = before
