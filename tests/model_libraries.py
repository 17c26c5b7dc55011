"""torchvision, timm and transformers for the import tests: their model definitions, random weights, nothing
downloaded. The torchvision wheel PyPI has for the CPU build of torch is a CUDA build whose compiled operators do
not load; its Python (the models) works once the two operator schemas its import registers fake kernels for
exist, which `library` defines first where they are missing."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

_STAND_INS = None  # the torch.library holding the stand-in schemas (kept alive for the process)


def library(name: str):
    """Import torchvision, timm or transformers, or skip the test where it is not installed."""
    try:
        importlib.import_module("torchvision")  # (timm and transformers import it too)
    except ImportError:
        pass
    except RuntimeError as error:  # its compiled operators did not load: stand-in schemas, and import again
        if "torchvision::" not in str(error):
            raise
        _define_stand_ins()
        for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[module]
    try:
        return importlib.import_module(name)
    except ImportError as error:
        pytest.skip(f"{name} is not installed ({error})")


def _define_stand_ins() -> None:
    global _STAND_INS
    if _STAND_INS is None:
        _STAND_INS = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _STAND_INS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
