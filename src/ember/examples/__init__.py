"""Runnable examples: `python -m ember.examples.<name>`."""

from __future__ import annotations

import importlib.util
import os


def default_device() -> str:
    """"cuda" on a machine with a CUDA GPU and ember's GPU dependencies (torch, triton), else "cpu".

    torch and triton are optional: the cpu path needs neither, so they are looked for before torch
    is imported to ask for a GPU."""
    if os.environ.get("EMBER_INTERPRET", "0") not in ("", "0"):
        return "cpu"  # the interpreter runs the cuda device, but far too slowly to be a default
    try:
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
            return "cpu"
        import torch  # optional, and imported only once it is known to be installed
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
