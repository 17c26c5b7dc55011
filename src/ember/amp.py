"""`ember.amp`: automatic mixed precision, as `torch.amp`: `autocast` and `GradScaler`.

Inside `with ember.autocast("cuda", dtype=ember.bfloat16):` the ops on PyTorch's lower-precision list for that
device type (matrix products and convolutions) cast their floating operands on that device type to `dtype`,
and the ops on its float32 list cast theirs to float32. The lists differ by device type, as PyTorch's do
(aten/src/ATen/autocast_mode.cpp): on cuda softmax, log-softmax, layer norm, logsumexp and the losses run in
float32; on the cpu only the losses do. `LOWER_PRECISION` and `FLOAT32` below are those lists, restricted to
the ops ember has, and the one place that decides: an op takes part by its name, with the decorator
`autocast_op`, on its one implementation, so every spelling of it (`ember.softmax`, `Tensor.softmax`,
`F.softmax`, `nn.Softmax`) is cast alike. float64 operands are left alone, as PyTorch leaves them. The casts are
ordinary graph ops, so they fuse into their neighbours and their gradients flow back to the parameters' own
dtype. The setting is per thread, and nests.

PyTorch's cuda float32 list also holds pointwise functions and reductions (exp, log, pow, rsqrt, sum, cumsum,
prod, norm...) that ember's other ops are built of (mean of sum, sigmoid of exp): ember leaves those in their
input's precision, since casting them would change the dtype of every op composed of them.

GradScaler keeps float16 gradients from underflowing: the loss is multiplied by a scale before
`backward()`, the gradients are divided by it before the optimizer uses them, and a step whose gradients
hold an inf or a NaN is skipped and the scale backed off; after `growth_interval` good steps in a row the
scale grows. The division and the inf/NaN check of every gradient are one lazy graph, realized together;
the host then reads one flag to skip or take the step, as PyTorch's scaler does.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

from ember import dtypes, nested
from ember.dtypes import DType
from ember.tensor import Tensor, realize

__all__ = ["GradScaler", "autocast"]

_local = threading.local()
DEFAULT_DTYPE = {"cuda": dtypes.float16, "cpu": dtypes.bfloat16}  # PyTorch's defaults per device type


def _mode() -> tuple[str, DType] | None:
    return getattr(_local, "mode", None)


@contextlib.contextmanager
def autocast(device_type: str = "cuda", dtype: DType | None = None, enabled: bool = True):
    """Run the lower-precision ops on `device_type` ("cuda" or "cpu") in `dtype` (float16 or bfloat16;
    PyTorch's default for the device type when None) and the float32 ops in float32. Also a decorator."""
    if device_type not in DEFAULT_DTYPE:
        raise ValueError(f"autocast: device_type must be 'cuda' or 'cpu', not {device_type!r}")
    dtype = dtypes.as_dtype(dtype) if dtype is not None else DEFAULT_DTYPE[device_type]
    if dtype not in (dtypes.float16, dtypes.bfloat16):
        raise ValueError(f"autocast: dtype must be float16 or bfloat16, not {dtype.name}")
    outer = _mode()
    _local.mode = (device_type, dtype) if enabled else None
    try:
        yield
    finally:
        _local.mode = outer


# PyTorch's autocast lists, for the ops ember has: by device type, the ops run in the autocast dtype and those
# run in float32 (binary_cross_entropy is on cpu's float32 list; on cuda PyTorch refuses it under autocast,
# ember leaves it alone). An op on neither list runs in its inputs' dtypes.
LOWER_PRECISION = {device_type: frozenset({"matmul", "mm", "bmm", "linear", "conv2d", "conv3d", "conv_transpose2d",
                                              "conv_transpose3d"})
                   for device_type in ("cuda", "cpu")}
_LOSSES = frozenset({"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                     "binary_cross_entropy_with_logits"})
FLOAT32 = {"cuda": _LOSSES | {"softmax", "log_softmax", "layer_norm", "logsumexp"},
           "cpu": _LOSSES | {"binary_cross_entropy"}}


def autocast_op(name: str) -> Callable:
    """Declare the decorated function ember's op `name`: while autocast is on, its floating Tensor arguments on
    the autocast device type are cast as that device type's lists say (to the autocast dtype, to float32, or
    not at all)."""
    def decorate(op: Callable) -> Callable:
        @functools.wraps(op)
        def run(*args, **kwargs):
            mode = _mode()
            if mode is None:
                return op(*args, **kwargs)
            device_type, low = mode
            if name in LOWER_PRECISION[device_type]:
                target = low
            elif name in FLOAT32[device_type]:
                target = dtypes.float32
            else:
                return op(*args, **kwargs)

            def cast(value):
                if (getattr(value, "_node", None) is not None and value.dtype.is_floating_point
                        and value.dtype is not dtypes.float64 and value.dtype is not target
                        and value.device.type == device_type):
                    return value.to(target)
                return value

            return op(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
        return run
    return decorate


class GradScaler:
    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if growth_factor <= 1.0:
            raise ValueError(f"GradScaler: growth_factor must be above 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be between 0 and 1, got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"GradScaler: growth_interval must be a positive int, got {growth_interval}")
        self.device = device
        self._enabled = enabled
        self._scale = float(init_scale)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._found_inf: dict[int, bool] = {}  # id(optimizer) -> whether its gradients held an inf or a NaN
        self._stepped: set[int] = set()

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, outputs):
        """The outputs (a Tensor, or nested lists, tuples and dicts of them) multiplied by the scale."""
        if not self._enabled:
            return outputs
        return nested.map_leaves(lambda t: t * self._scale if isinstance(t, Tensor) else t, outputs)

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and note whether any is inf or NaN."""
        if not self._enabled:
            return
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("unscale_() is being called after step()")
        if key in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        inverse = float(1.0 / self._scale)
        grads, bad = [], None
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype is dtypes.float16:
                    raise ValueError("GradScaler: attempting to unscale float16 gradients; keep the parameters "
                                     "in float32 (autocast casts them for the ops that run in float16)")
                p.grad = p.grad * inverse
                grads.append(p.grad)
                found = p.grad.isfinite().logical_not().any()
                bad = found if bad is None else bad | found
        if bad is None:
            self._found_inf[key] = False
            return
        realize(*grads, bad)
        self._found_inf[key] = bool(bad.item())

    def step(self, optimizer, *args, **kwargs):
        """The optimizer's step on unscaled gradients, or nothing (None) when any of them is inf or NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("GradScaler.step() does not support a closure")
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        if key not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(key)
        return None if self._found_inf[key] else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Back the scale off after a step with an inf or NaN; grow it after `growth_interval` good steps."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale.item() if isinstance(new_scale, Tensor) else new_scale)
        else:
            if not self._found_inf:
                raise RuntimeError("update(): no inf checks were recorded before it (call step() or unscale_())")
            if any(self._found_inf.values()):
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        if not self._enabled:
            return
        self._scale = float(state["scale"])
        self._growth_factor, self._backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self._growth_interval, self._growth_tracker = int(state["growth_interval"]), int(state["_growth_tracker"])
