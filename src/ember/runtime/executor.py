"""Realization: turn pending graph into values on the nodes' devices.

`realize(nodes)` evaluates everything the requested nodes need in one go. Besides
the requested nodes, every node of that graph that a live Tensor still shows to the
user is kept, so a value is computed once even when the user reads it later (the
loss of a step realized together with the optimizer update, for example).
"""

from __future__ import annotations

from collections.abc import Iterable

from ember.compiler.codegen import reference
from ember.errors import DeviceError
from ember.ir import Node, toposort

_BACKENDS = {"cpu": reference.run}


def realize(nodes: Iterable[Node]) -> None:
    requested = [n for n in nodes if not n.realized]
    if not requested:
        return
    order = toposort(requested)
    keep = {id(n) for n in requested} | {id(n) for n in order if n.is_held()}
    by_device: dict = {}
    for n in order:
        by_device.setdefault(n.device.type, []).append(n)
    if len(by_device) > 1:
        raise DeviceError(f"one graph spans several devices: {', '.join(by_device)}")
    ((device_type, _),) = by_device.items()
    run = _BACKENDS.get(device_type)
    if run is None:
        raise DeviceError(f"no backend for device type {device_type!r}")
    values = run(order, keep)
    for n in order:
        if id(n) in values:
            n.set_buffer(values[id(n)])
