"""Device placement of a region of code: `on_device` runs a function on another device; and
`memory_stats`, what a cuda device holds.

It is the frontend's way to mark a GPU region inside CPU code (or the reverse): Tensor arguments
are moved in and Tensor results moved back with lazy COPY nodes (as `Tensor.to` makes), so the
copies happen at the region's edges only and everything inside fuses on the region's device.
The COPY primitive's rules are declared here, at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember import nested
from ember.device import Device, as_device, default_device
from ember.device import device as default_on
from ember.errors import DeviceError
from ember.ir import Op
from ember.ir.ops import define
from ember.tensor import Tensor


def check_device(device: str | Device | None) -> Device:
    """Parse `device` and make sure it exists here (a cuda index below the GPU count), so a
    placement fails where it is asked for rather than when the first value is computed."""
    device = as_device(device)
    if device.type == "cuda":
        from ember.runtime import cuda  # torch and triton are imported only when a GPU is asked for

        cuda.torch_device(device)  # raises DeviceError for a device that does not exist
    return device


def memory_stats(d: str | Device | None = None) -> dict:
    """Memory of a cuda device in bytes: "allocated" now, "peak" since the start, "cached" held by
    the allocator, and "arena": what recently run plans keep for their intermediates."""
    target = as_device(d if d is not None else "cuda")
    if target.type != "cuda":
        raise DeviceError(f"memory_stats: {target} has no device memory to report; ask for a cuda device")
    from ember.runtime import cuda  # torch and triton are imported only when a GPU is asked about

    return cuda.memory_stats(target)


def on_device(device: str | Device, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call `fn(*args, **kwargs)` with its Tensor arguments moved to `device` and move its Tensor
    results back to the device the arguments came from.

    Tensors are found in the arguments and the result directly and inside lists, tuples and dicts
    (nested to any depth); other values pass through unchanged. When the Tensor arguments come from
    several devices, or there are none, results go to the default device. Inside the region `device`
    is the default device, so tensors `fn` creates live there too. The moves are lazy COPY nodes,
    differentiable like `Tensor.to`. Parameters that `fn` holds itself (a Module's) are not moved:
    put the module on the device once with `module.to(device)`.

        logits = ember.on_device("cuda", model, images)   # images and logits stay on the CPU
    """
    target = check_device(device)
    sources = {t.device for t in nested.leaves((args, kwargs)) if isinstance(t, Tensor)}
    home = sources.pop() if len(sources) == 1 else default_device()
    with default_on(target):
        result = fn(*_moved(args, target), **_moved(kwargs, target))
    return _moved(result, home)


def _moved(value, device: Device):
    """`value` with every Tensor in it (through lists, tuples and dicts) moved to `device`."""
    return nested.map_leaves(lambda x: x.to(device) if isinstance(x, Tensor) else x, value)


# -- the COPY primitive: a value moved to another device (attribute `device`, the target) ------------------
define(Op.COPY, shape=lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
       vjp=lambda g, xs, out, a: (g.to(xs[0].device),), reference=lambda x, device: x)
