"""The IR: primitive ops with their shape and dtype rules, and the Node graph."""

from ember.ir.node import Node, toposort
from ember.ir.ops import Kind, Op

__all__ = ["Kind", "Node", "Op", "toposort"]
