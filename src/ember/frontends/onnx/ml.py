"""Operators of ONNX's ai.onnx.ml domain that are numeric tensor ops (Binarizer, ArrayFeatureExtractor) as ember
ops; the rest of the domain (trees, label encoders over strings ...) is not built."""

from __future__ import annotations

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext


def _binarizer(n: NodeContext, x):
    return (x > n.const(n.attr("threshold", 0.0), x)).to(x.dtype)


def _array_feature_extractor(n: NodeContext, x, index):
    """The entries of x's last dimension that `index` names (a vector becomes one row)."""
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    return ember.index_select(rows, rows.ndim - 1, index.reshape(-1).to(dtypes.int64))


OPS = {"ai.onnx.ml.Binarizer": _binarizer, "ai.onnx.ml.ArrayFeatureExtractor": _array_feature_extractor}
