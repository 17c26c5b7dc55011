"""torchvision, timm and transformers for the import tests: their model definitions, random weights, nothing
downloaded. The torchvision wheel PyPI has for the CPU build of torch is a CUDA build whose compiled operators do
not load; its Python (the models) works once the two operator schemas its import registers fake kernels for
exist, which `library` defines first where they are missing."""

from __future__ import annotations

import importlib

import pytest
import torch

_STAND_INS = None  # the torch.library holding the stand-in schemas (kept alive for the process)


def library(name: str):
    """Import torchvision, timm or transformers, or skip the test where it is not installed."""
    global _STAND_INS
    if _STAND_INS is None:  # (timm and transformers import torchvision too)
        try:
            torch.ops.torchvision.nms  # noqa: B018  (present where torchvision's compiled operators load)
        except (AttributeError, RuntimeError):
            _STAND_INS = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                _STAND_INS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    try:
        return importlib.import_module(name)
    except ImportError as error:
        pytest.skip(f"{name} is not installed ({error})")
