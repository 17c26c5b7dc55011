"""ONNX's spectral operators (DFT, STFT) as ember ops: transforms as matmuls with the cosine and sine matrices,
in float64; the last dimension of a signal holds its real and imaginary parts (or the real part alone)."""

from __future__ import annotations

import numpy as np

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext
from ember.frontends.onnx.tensors import axis_index, slice_axis


def _dft(n: NodeContext, x, length=None, axis=None):
    """DFT as matmuls with cosine and sine matrices, in float64 (the last dimension holds real and imaginary parts).
    An inverse of a one-sided spectrum is a real signal (irfft)."""
    axis = n.attr("axis", 1) if n.opset < 20 else (-2 if axis is None else n.ints(axis)[0])
    axis = axis_index(axis, x.ndim)
    wide = x.to(dtypes.float64)
    real = _last(wide[..., 0], axis)
    imag = _last(wide[..., 1], axis) if x.shape[-1] == 2 else None
    size = real.shape[-1]
    inverse, onesided = bool(n.attr("inverse", 0)), bool(n.attr("onesided", 0))
    dft_length = n.ints(length)[0] if length is not None else 2 * (size - 1) if inverse and onesided else size
    if inverse and onesided:
        bins = dft_length // 2 + 1
        real, imag = (None if t is None else _fit(t, t.ndim - 1, bins) for t in (real, imag))
        weight = np.where((np.arange(bins) == 0) | (2 * np.arange(bins) == dft_length), 1.0, 2.0)[:, None]
        angle = 2 * np.pi * np.outer(np.arange(bins), np.arange(dft_length)) / dft_length
        out = real @ n.const(weight * np.cos(angle) / dft_length, real)
        if imag is not None:
            out = out - imag @ n.const(weight * np.sin(angle) / dft_length, imag)
        parts = [out]
    else:
        if dft_length != size:
            real, imag = (None if t is None else _fit(t, t.ndim - 1, dft_length) for t in (real, imag))
        parts = _transformed(n, real, imag, dft_length, onesided, inverse)
    out = ember.stack(parts, -1).to(x.dtype)
    order = list(range(out.ndim - 2))
    order.insert(axis, out.ndim - 2)
    return out.permute(*order, out.ndim - 1)


def _transformed(n: NodeContext, real, imag, length: int, onesided: bool, inverse: bool = False) -> list:
    """The discrete Fourier transform of real (+ i imag, where given) over its last dimension: [real, imaginary]."""
    kept = length // 2 + 1 if onesided else length
    angle = 2 * np.pi * np.outer(np.arange(length), np.arange(kept)) / length * (1 if inverse else -1)
    scale = 1 / length if inverse else 1
    cos, sin = (n.const(m * scale, real) for m in (np.cos(angle), np.sin(angle)))
    return [real @ cos - imag @ sin if imag is not None else real @ cos,
            real @ sin + imag @ cos if imag is not None else real @ sin]


def _stft(n: NodeContext, x, step, window=None, length=None):
    """STFT: the signal's frames, windowed, each transformed (DFT), as [batch, frames, bins, 2]."""
    step = n.ints(step)[0]
    size = n.ints(length)[0] if length is not None else window.shape[0] if window is not None else x.shape[-2]
    wide = x.to(dtypes.float64)
    frames = [slice_axis(wide, 1, k * step, k * step + size, 1) for k in range(1 + (x.shape[1] - size) // step)]
    framed = ember.stack(frames, 1)  # [batch, frames, size, 1 or 2]
    weights = 1 if window is None else window.to(dtypes.float64)
    real = framed[..., 0] * weights
    imag = framed[..., 1] * weights if x.shape[-1] == 2 else None
    parts = _transformed(n, real, imag, size, bool(n.attr("onesided", 1)))
    return ember.stack(parts, -1).to(x.dtype)


def _last(t, axis: int):
    order = [d for d in range(t.ndim) if d != axis] + [axis]
    return t.permute(*order)


def _fit(t, axis: int, size: int):
    """t cut or zero-padded to `size` along `axis`."""
    if t.shape[axis] >= size:
        return slice_axis(t, axis, 0, size, 1)
    pads = [0, 0] * (t.ndim - 1 - axis) + [0, size - t.shape[axis]]
    return ember.pad(t, pads)


OPS = {"DFT": _dft, "STFT": _stft}
