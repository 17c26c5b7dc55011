"""The one table of ONNX operators ember implements: op type ("Conv"; "domain.OpType" outside the default domain)
to its ember function, gathered from the family modules. An op missing here runs as the function body onnx defines
for it, if any."""

from __future__ import annotations

from collections.abc import Callable

from ember.frontends.onnx import (
    control,
    elementwise,
    layers,
    ml,
    recurrent,
    reductions,
    resize,
    spectral,
    tensors,
    training,
)

OPS: dict[str, Callable] = {
    **elementwise.OPS, **reductions.OPS, **tensors.OPS, **layers.OPS, **recurrent.OPS, **resize.OPS, **control.OPS,
    **spectral.OPS, **training.OPS, **ml.OPS,
}
