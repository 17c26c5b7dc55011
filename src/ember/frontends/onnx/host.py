"""The values of an ONNX graph known on the host while it runs: constants, shapes, integer initializers, and what
the graph computes from them alone (the Shape -> Gather -> Concat -> Reshape arithmetic of exported models).

A node that only does such arithmetic on known values is folded: evaluated by onnx's reference implementation on
the host, its outputs known too. So an op that needs a shape or an axis as a number reads it here, with no device
round trip (`NodeContext.static`), and the lazy ember graph holds only the data path.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from ember.device import Device
from ember.frontends.onnx.values import to_tensor
from ember.tensor import Tensor

# The operators folded when all their inputs are known: shape and index arithmetic.
FOLDABLE = frozenset("""
Shape Size Gather Concat Unsqueeze Squeeze Slice Cast Add Sub Mul Div Mod Neg Abs Floor Ceil Equal Less Greater
LessOrEqual GreaterOrEqual Not And Or Where Max Min ConstantOfShape Range ReduceProd ReduceSum ReduceMax ReduceMin
Reshape Expand Identity Transpose Flatten Tile Sqrt
""".split())
FOLD_LIMIT = 4096  # elements: more is data, not a shape


class HostValues:
    """Known host values of one forward, by tensor, and the evaluators that fold nodes (kept across forwards)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Tensor, np.ndarray]] = {}
        self._lasting: dict[int, tuple[Tensor, np.ndarray]] = {}
        self._evaluators: dict[tuple[bytes, int], ReferenceEvaluator] = {}  # by node (serialized: function bodies'
        # nodes are made anew at each call) and opset

    def keep(self, t: Tensor, array: np.ndarray) -> None:
        """Records a value known for the module's life (an integer initializer's)."""
        self._lasting[id(t)] = (t, array)

    def start(self) -> None:
        """A new forward: forget the last one's values."""
        self._known = dict(self._lasting)

    def record(self, t: Tensor, array: np.ndarray) -> Tensor:
        self._known[id(t)] = (t, array)
        return t

    def get(self, t) -> np.ndarray | None:
        entry = self._known.get(id(t)) if isinstance(t, Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    def constant(self, array: np.ndarray, device: Device) -> Tensor:
        """A tensor of `array` on `device`, its value known here if it is small enough to be a shape."""
        array = np.asarray(array)
        t = to_tensor(array, device)
        return self.record(t, array.astype(t.dtype.np, copy=False)) if array.size <= FOLD_LIMIT else t

    def foldable(self, node: onnx.NodeProto, inputs: list) -> list[np.ndarray] | None:
        """The inputs' host values when the node can be folded, else None."""
        if node.op_type not in FOLDABLE or node.domain not in ("", "ai.onnx") or not inputs:
            return None
        arrays = [None if v is None else self.get(v) for v in inputs]
        present = [a for a in arrays if a is not None]
        if len(present) != sum(v is not None for v in inputs) or sum(a.size for a in present) > FOLD_LIMIT:
            return None
        return arrays

    def fold(self, node: onnx.NodeProto, opset: int, arrays: list, device: Device) -> tuple[Tensor, ...]:
        key = (node.SerializeToString(), opset)
        evaluator = self._evaluators.get(key)
        if evaluator is None:
            graph = helper.make_graph([node], "fold", [helper.make_empty_tensor_value_info(i) for i in node.input
                                                       if i], [helper.make_empty_tensor_value_info(o) for o in
                                                               node.output if o])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
            evaluator = self._evaluators[key] = ReferenceEvaluator(model)
        feeds = {name: a for name, a in zip(node.input, arrays) if name}
        return tuple(self.constant(out, device) for out in evaluator.run(None, feeds))
