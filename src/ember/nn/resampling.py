"""F.interpolate: resampling (N, C, L), (N, C, H, W) or (N, C, D, H, W) input (nearest, nearest-exact, linear,
bilinear, bicubic, trilinear, area), each output position a weighted sum of gathered source positions whose weights
are computed on the host."""

from __future__ import annotations

import math

import numpy as np

from ember import dtypes
from ember.errors import ShapeError
from ember.nn.checks import check_float, opmath
from ember.ops import adaptive_avg_pool2d, adaptive_avg_pool3d
from ember.ops.creation import tensor
from ember.ops.index import select_in_range
from ember.ops.pointwise import cast
from ember.tensor import Tensor, expect_tensors

# -- resampling ----------------------------------------------------------------------------
# interpolate is separable: along each spatial axis every output position reads a few source positions (taps)
# with weights that depend on the sizes alone, so both are computed on the host (in the precision torch computes
# them in) and the resampling is gathers and weighted sums, differentiated as any other graph.

# the interpolating modes, each with the rank of the input it resamples (as torch: linear 3-d, trilinear 5-d)
_INTERPOLATING = {"linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5}
_LINEAR = ("linear", "bilinear", "trilinear")  # two taps per axis, the source position clamped at 0
_CUBIC_A = -0.75  # the Keys cubic convolution coefficient torch uses


def _resampled_sizes(input: Tensor, size, scale_factor, recompute_scale_factor: bool | None) -> tuple[list, list]:
    """The output's spatial sizes, and the scale factor each axis's source positions are computed with (None
    where the sizes' ratio is used)."""
    spatial = input.shape[2:]
    if size is not None and scale_factor is not None:
        raise ValueError("interpolate: only one of size or scale_factor should be defined")
    if size is None and scale_factor is None:
        raise ValueError("interpolate: either size or scale_factor should be defined")
    if size is not None:
        sizes = [size] * len(spatial) if isinstance(size, int) else list(size)
        if len(sizes) != len(spatial):
            raise ValueError(f"interpolate: size {size} must give one size per spatial dim of input {input.shape}")
        scales = [None] * len(spatial)
    else:
        factors = [scale_factor] * len(spatial) if isinstance(scale_factor, (int, float)) else list(scale_factor)
        if len(factors) != len(spatial):
            raise ValueError(f"interpolate: scale_factor {scale_factor} must give one factor per spatial dim of "
                             f"input {input.shape}")
        sizes = [math.floor(n * float(f)) for n, f in zip(spatial, factors)]
        scales = [None] * len(spatial) if recompute_scale_factor else [float(f) for f in factors]
    if any(m <= 0 for m in sizes) or any(n <= 0 for n in spatial):
        raise ShapeError(f"interpolate: input {input.shape} and output sizes {tuple(sizes)} should be greater "
                         f"than 0")
    return sizes, scales


def _source_scale(n: int, m: int, scale: float | None, align_corners: bool, real=np.float32):
    """How far the source position moves per output position, in the `real` type."""
    if align_corners:
        return real(n - 1) / real(m - 1) if m > 1 else real(0)
    return real(1.0 / scale) if scale is not None and scale > 0 else real(n) / real(m)


def _taps(n: int, m: int, scale: float | None, mode: str, align_corners: bool,
          real=np.float32) -> list[tuple[np.ndarray, np.ndarray]]:
    """For one axis of n source and m output positions: (source index, weight) arrays of length m, one pair per
    tap (the weights None for nearest modes). The interpolating modes compute positions and weights in `real`
    (torch's: double for float64 input, else float); the nearest modes always in float32."""
    if mode.startswith("nearest"):
        step, d = _source_scale(n, m, scale, align_corners), np.arange(m, dtype=np.float32)
        if mode == "nearest":  # torch's legacy rounding: the position is floor(d * step)
            return [(np.minimum(np.floor(d * step).astype(np.int64), n - 1), None)]
        # nearest-exact: the source pixel whose centre is nearest, floor((d + 0.5) * step)
        return [(np.minimum(np.floor((d + np.float32(0.5)) * step).astype(np.int64), n - 1), None)]
    step, d = _source_scale(n, m, scale, align_corners, real), np.arange(m, dtype=real)
    half = real(0.5)
    source = d * step if align_corners else step * (d + half) - half
    if mode in _LINEAR:
        source = np.maximum(source, real(0))
    first = np.minimum(np.floor(source).astype(np.int64), n - 1)
    t = np.clip(source - first.astype(real), real(0), real(1))
    if mode in _LINEAR:
        return [(first, 1 - t), (np.minimum(first + 1, n - 1), t)]
    a = real(_CUBIC_A)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
    return [(np.clip(first + k - 1, 0, n - 1), w) for k, w in enumerate(weights)]


def _taken(x: Tensor, axis: int, index: np.ndarray) -> Tensor:
    """x at the source positions `index` along `axis`: a broadcast where each position repeats a whole number of
    times in order (nearest upsampling by an integer factor), else a gather."""
    n, m = x.shape[axis], len(index)
    if m % n == 0 and np.array_equal(index, np.arange(m) // (m // n)):
        repeats = m // n
        if repeats == 1:
            return x
        spread = x.unsqueeze(axis + 1).expand(x.shape[:axis + 1] + (repeats,) + x.shape[axis + 1:])
        return spread.reshape(x.shape[:axis] + (m,) + x.shape[axis + 1:])
    return select_in_range(x, axis, tensor(index.astype(np.int32), device=x.device))


def _resampled_axis(x: Tensor, axis: int, taps: list[tuple[np.ndarray, np.ndarray]]) -> Tensor:
    """The weighted sum of the taps along `axis` (the one tap of a nearest mode taken as is)."""
    if taps[0][1] is None:
        return _taken(x, axis, taps[0][0])
    along = (-1,) + (1,) * (x.ndim - 1 - axis)
    out = None
    for index, weight in taps:
        term = _taken(x, axis, index) * tensor(weight.astype(x.dtype.np), device=x.device).reshape(along)
        out = term if out is None else out + term
    return out


def interpolate(input: Tensor, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False) -> Tensor:
    """Resample (N, C, L), (N, C, H, W) or (N, C, D, H, W) input to `size` or by `scale_factor`, as
    torch.nn.functional.interpolate.

    Modes: 'nearest' (torch's legacy floor(d * in / out) rounding), 'nearest-exact', 'linear' (3-d input),
    'bilinear', 'bicubic' (4-d; Keys' cubic with A = -0.75, taps clamped at the border), 'trilinear' (5-d) and
    'area' (adaptive average pooling). `align_corners` maps the corner pixels' centres onto each other (the
    interpolating modes only). The interpolating modes compute float16 and bfloat16 input in float32 and round
    once."""
    expect_tensors("interpolate", input=input)
    if mode in ("nearest", "nearest-exact", "area"):
        if align_corners is not None:
            raise ValueError("interpolate: align_corners option can only be set with the interpolating modes: "
                             "linear | bilinear | bicubic | trilinear")
    elif mode not in _INTERPOLATING:
        raise NotImplementedError(f"interpolate: mode {mode!r} is not one of nearest, nearest-exact, area, "
                                  f"linear, bilinear, bicubic or trilinear")
    if input.ndim not in (3, 4, 5) or _INTERPOLATING.get(mode, input.ndim) != input.ndim:
        raise NotImplementedError(f"interpolate: got {input.ndim}-d input, but mode {mode!r} resamples "
                                  f"{_INTERPOLATING.get(mode, '3-, 4- or 5')}-d input")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported")
    sizes, scales = _resampled_sizes(input, size, scale_factor, recompute_scale_factor)
    if mode == "area":
        return _area(input, tuple(sizes))
    if mode in _INTERPOLATING:
        check_float("interpolate", input)
    x = input if mode.startswith("nearest") else opmath(input)
    real = np.float64 if input.dtype is dtypes.float64 else np.float32
    for axis, n, m, scale in zip(range(2, input.ndim), input.shape[2:], sizes, scales):
        x = _resampled_axis(x, axis, _taps(n, m, scale, mode, bool(align_corners), real))
    return cast(x, input.dtype)


def _area(input: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """Area resampling: adaptive average pooling to `sizes` (a row as a plane of height 1)."""
    if len(sizes) == 3:
        return adaptive_avg_pool3d(input, sizes)
    if len(sizes) == 1:
        return adaptive_avg_pool2d(input.unsqueeze(-2), (1,) + sizes).squeeze(-2)
    return adaptive_avg_pool2d(input, sizes)
