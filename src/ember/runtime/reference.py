"""The reference target's runner (see runtime/targets.py): the cpu device's graphs, evaluated op by op with NumPy
as the compiler's reference plan."""

from __future__ import annotations

import numpy as np

from ember.compiler import CompileContext, compile
from ember.ir import Node
from ember.runtime import collector


def run(order: list[Node], keep: set[int]) -> dict[int, np.ndarray]:
    """Evaluate `order`; return the values of the nodes whose ids are in `keep`."""
    values = compile(order, keep, "reference", CompileContext()).evaluate()
    collector.after_host_step()
    return values
