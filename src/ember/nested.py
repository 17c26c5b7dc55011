"""Values nested in lists, tuples (named ones too) and dicts: the one walk that `on_device` and
`ember.jit` use to find the Tensors in arguments and results, and to put values back in place."""

from __future__ import annotations

from collections.abc import Callable, Iterator


def leaves(value) -> list:
    """Every value that is not a list, tuple or dict, in order (a dict's in the order of its keys)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in leaves(item)]
    return [value]


def map_leaves(fn: Callable, value):
    """`value` with `fn` applied to every leaf, its containers rebuilt with their own types."""
    return rebuild(structure(value), iter([fn(leaf) for leaf in leaves(value)]))


def structure(value):
    """A hashable description of how `value` nests its leaves (None for a leaf)."""
    if isinstance(value, dict):
        return type(value), tuple((k, structure(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value), tuple(structure(v) for v in value)
    return None


def rebuild(description, values: Iterator):
    """The nesting `description` (from `structure`) filled with the next values of `values`."""
    if description is None:
        return next(values)
    kind, items = description
    if issubclass(kind, dict):
        pairs = [(k, rebuild(v, values)) for k, v in items]
        try:
            return kind(pairs)
        except TypeError:  # a mapping whose constructor takes something else first (a defaultdict)
            return dict(pairs)
    parts = [rebuild(v, values) for v in items]
    return kind(*parts) if hasattr(kind, "_fields") else kind(parts)
