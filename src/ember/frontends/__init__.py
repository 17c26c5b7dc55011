"""Models from other frameworks as ember modules."""

from ember.frontends.torch import from_torch

__all__ = ["from_torch"]
