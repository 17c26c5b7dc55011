"""ONNX's resampling (Resize, Upsample, GridSample) as ember ops. Resize is separable interpolation, one axis at
a time; GridSample gathers each tap of its interpolation from the flattened image at coordinates the grid gives.

For each resized axis the source coordinates of the output positions (ONNX's coordinate transformation modes)
give, on the host, a few source indices and weights per output position (1 for nearest, 2 for linear, 4 for
cubic); the tensor is then a weighted sum of gathers along that axis, lazy and fusable like any ember expression.
Indices outside the input are clamped to its edge, as ONNX's reference pads with the edge values.
"""

from __future__ import annotations

import math

import numpy as np

import ember
from ember import dtypes
from ember.frontends.onnx.graph import NodeContext


def _source(n: NodeContext, mode: str, i: np.ndarray, in_size: int, out_size: int, scale: float, roi) -> np.ndarray:
    """The input coordinate each output position i samples (align_corners spans the unrounded output length,
    in_size * scale, where a scale was given)."""
    if mode == "half_pixel":
        return (i + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = out_size / (scale * in_size)
        return in_size / 2 * (1 - adjustment) + (i + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (i + 0.5) / scale - 0.5 if out_size > 1 else np.zeros_like(i, dtype=np.float64)
    if mode == "align_corners":
        span = in_size * scale - 1
        return i * (in_size - 1) / span if out_size > 1 else np.zeros_like(i, dtype=np.float64)
    if mode == "asymmetric":
        return i / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out_size > 1:
            return start * (in_size - 1) + i * (end - start) * (in_size - 1) / (out_size - 1)
        return np.full(i.shape, 0.5 * (start + end) * (in_size - 1))
    raise n.unsupported(f"coordinate_transformation_mode={mode!r}")


def _nearest(n: NodeContext, x: np.ndarray, rounding: str) -> np.ndarray:
    if rounding == "round_prefer_floor":
        return np.where(x - np.floor(x) == 0.5, np.floor(x), np.round(x))
    if rounding == "round_prefer_ceil":
        return np.where(x - np.floor(x) == 0.5, np.ceil(x), np.round(x))
    if rounding == "floor":
        return np.floor(x)
    if rounding == "ceil":
        return np.ceil(x)
    raise n.unsupported(f"nearest_mode={rounding!r}")


def _cubic(t: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel at distances t (Keys, with coefficient a)."""
    t = np.abs(t)
    return np.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                    np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))


def _taps(n: NodeContext, mode: str, coords: np.ndarray, in_size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each [out, taps]: the input positions each output reads and their weights. With
    antialias, a downscale widens the filter by 1/scale (and normalizes its weights)."""
    if mode == "nearest":
        rounding = n.attr("nearest_mode", "round_prefer_floor") if n.opset >= 11 else "floor"
        return _nearest(n, coords, rounding)[:, None].astype(np.int64), np.ones((len(coords), 1))
    if mode not in ("linear", "cubic"):
        raise n.unsupported(f"mode={mode!r}")
    base = np.floor(coords)
    stretch = min(scale, 1.0) if n.attr("antialias", 0) else 1.0
    reach = 1 if mode == "linear" else 2
    first = int(np.floor(-reach / stretch) + 1)
    offsets = np.arange(first, 2 - first if mode == "cubic" else first + 2 - 2 * first)
    distances = (coords[:, None] - (base[:, None] + offsets)) * stretch
    if mode == "linear":
        weights = np.clip(1 - np.abs(distances), 0, 1)
    else:
        weights = _cubic(distances, n.attr("cubic_coeff_a", -0.75))
    if stretch != 1:
        weights = weights / weights.sum(1, keepdims=True)
    indices = base[:, None].astype(np.int64) + offsets
    if n.attr("exclude_outside", 0):
        weights = np.where((indices < 0) | (indices >= in_size), 0.0, weights)
        weights = weights / weights.sum(1, keepdims=True)
    return indices, weights


def _resize_axis(n: NodeContext, x, axis: int, out_size: int, scale: float, roi, mode: str, transform: str):
    in_size = x.shape[axis]
    coords = _source(n, transform, np.arange(out_size, dtype=np.float64), in_size, out_size, scale, roi)
    indices, weights = _taps(n, mode, coords, in_size, scale)
    outside = (coords < 0) | (coords > in_size - 1)
    indices = np.clip(indices, 0, in_size - 1)
    shape = [1] * x.ndim
    shape[axis] = out_size
    out = None
    for t in range(indices.shape[1]):
        picked = x.index_select(axis, n.const(indices[:, t]))
        term = picked if mode == "nearest" else picked * n.const(weights[:, t].reshape(shape), x)
        out = term if out is None else out + term
    if transform == "tf_crop_and_resize" and outside.any():
        fill = n.const(n.attr("extrapolation_value", 0.0), x)
        out = ember.where(n.const(outside.reshape(shape)), fill, out)
    return out


def _resize(n: NodeContext, x, roi=None, scales=None, sizes=None):
    if n.opset < 11:  # Resize-10: (X, scales)
        scales, roi = roi, None
    axes = n.attr("axes") or list(range(x.ndim))
    axes = [a % x.ndim for a in axes]
    scale_values = None if scales is None or 0 in scales.shape else [float(s) for s in n.static(scales).reshape(-1)]
    size_values = None if sizes is None or 0 in sizes.shape else n.ints(sizes)
    if size_values is not None:
        ins = [x.shape[a] for a in axes]
        policy = n.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            ratio = pick(s / i for s, i in zip(size_values, ins))
            size_values = [int(math.floor(ratio * i + 0.5)) for i in ins]
            scale_values = [ratio] * len(axes)
        else:
            scale_values = [s / i for s, i in zip(size_values, ins)]
    else:
        size_values = [int(math.floor(x.shape[a] * s)) for a, s in zip(axes, scale_values)]
    roi_values = None if roi is None or 0 in roi.shape else np.asarray(n.static(roi), dtype=np.float64).reshape(-1)
    mode = n.attr("mode", "nearest")
    transform = n.attr("coordinate_transformation_mode", "half_pixel") if n.opset >= 11 else "asymmetric"
    for k, axis in enumerate(axes):
        roi_axis = None if roi_values is None else (roi_values[k], roi_values[k + len(axes)])
        if size_values[k] == x.shape[axis] and scale_values[k] == 1 and transform != "tf_crop_and_resize":
            continue
        x = _resize_axis(n, x, axis, size_values[k], scale_values[k], roi_axis, mode, transform)
    return x


def _upsample(n: NodeContext, x, scales=None):
    values = n.attr("scales") if scales is None else [float(s) for s in n.static(scales).reshape(-1)]
    mode = n.attr("mode", "nearest")
    for axis, scale in enumerate(values):
        if scale != 1:
            x = _resize_axis(n, x, axis, int(math.floor(x.shape[axis] * scale)), scale, None, mode, "asymmetric")
    return x


def _reflect(c, low: float, high: float):
    """Coordinates outside [low, high] reflected at the near border until inside."""
    span = high - low
    below, above = c < low, c > high
    distance = ember.where(below, low - c, c - high)
    folds = ember.trunc(distance / span) if span else ember.zeros_like(c)
    rest = distance - folds * span
    even = ember.remainder(folds, 2.0) == 0
    from_below = ember.where(even, low + rest, high - rest)
    from_above = ember.where(even, high - rest, low + rest)
    return ember.where(below, from_below, ember.where(above, from_above, c))


def _grid_sample(n: NodeContext, x, grid):
    """GridSample of any rank: each output position's input coordinates (from the grid, lazily), the taps of its
    interpolation around them, and a gather of each tap from the flattened image, weighed and summed."""
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(n.attr("mode", "linear"), n.attr("mode", "linear"))
    padding, aligned = n.attr("padding_mode", "zeros"), bool(n.attr("align_corners", 0))
    batch, channels, dims = x.shape[0], x.shape[1], x.shape[2:]
    rank, points = len(dims), math.prod(grid.shape[1:-1])
    flat_grid = grid.reshape(batch, points, rank)
    taps_per_dim = []
    for i, size in enumerate(dims):
        v = flat_grid[..., rank - 1 - i]  # the grid lists coordinates innermost dimension first
        c = (v + 1) / 2 * (size - 1) if aligned else ((v + 1) * size - 1) / 2
        if mode == "nearest":
            c = ember.round(c)
        low, high = (0.0, size - 1.0) if aligned else (-0.5, size - 0.5)
        outside = (c < low) | (c > high)
        if padding == "border":
            c = ember.where(outside, ember.clamp(c, 0.0, size - 1.0), c)
        elif padding == "reflection":
            c = ember.where(outside, _reflect(c, low, high), c)
        if mode == "nearest":
            taps = [(c, None)]
        else:
            base = ember.floor(c)
            t = c - base
            if mode == "linear":
                taps = [(base, 1 - t), (base + 1, t)]
            elif mode == "cubic":
                taps = [(base + k, _keys(t - k)) for k in (-1, 0, 1, 2)]
            else:
                raise n.unsupported(f"mode={mode!r}")
        taps_per_dim.append([(*_tap_index(index, size, padding, low, high), weight) for index, weight in taps])
    strides = [math.prod(dims[i + 1:]) for i in range(rank)]
    image = x.reshape(batch, channels, -1)
    out = None
    for combination in np.ndindex(*(len(t) for t in taps_per_dim)):
        position, weight, valid = None, None, None
        for i, k in enumerate(combination):
            index, inside, w = taps_per_dim[i][k]
            term = index * strides[i]
            position = term if position is None else position + term
            weight = w if weight is None else weight if w is None else weight * w
            valid = inside if valid is None else valid if inside is None else valid & inside
        picked = ember.gather(image, 2, position.reshape(batch, 1, points).expand(batch, channels, points))
        if weight is not None:
            picked = picked * weight.reshape(batch, 1, points).to(x.dtype)
        if valid is not None:
            picked = ember.where(valid.reshape(batch, 1, points), picked, ember.zeros_like(picked))
        out = picked if out is None else out + picked
    return out.reshape(batch, channels, *grid.shape[1:-1])


def _keys(t):
    """The cubic convolution kernel (a = -0.75) at distances t."""
    t = ember.abs(t)
    a = -0.75
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return ember.where(t <= 1, near, ember.where(t < 2, far, ember.zeros_like(t)))


def _tap_index(index, size: int, padding: str, low: float, high: float):
    """(int64 index in range, where the tap lies inside the image or None): zeros padding masks the taps outside,
    border clamps them, reflection reflects them."""
    if padding == "reflection":
        index = ember.trunc(_reflect(index, low, high))
    elif padding == "border":
        index = ember.clamp(index, 0.0, size - 1.0)
    inside = (index >= 0) & (index <= size - 1) if padding == "zeros" else None
    return ember.clamp(index, 0.0, size - 1.0).to(dtypes.int64), inside


def _roi_samples(n: NodeContext, rois: np.ndarray, height: int, width: int):
    """RoiAlign's sampling, on the host (the boxes decide how many samples a bin takes): for each box, output
    position and sample, the 4 flat positions its bilinear interpolation reads and their weights, and which samples
    exist ([R, out_h, out_w, S, 4] twice, [R, S])."""
    out_h, out_w = n.attr("output_height", 1), n.attr("output_width", 1)
    ratio, scale = n.attr("sampling_ratio", 0), n.attr("spatial_scale", 1.0)
    half_pixel = n.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    per_box = []
    for x1, y1, x2, y2 in rois * scale - (0.5 if half_pixel else 0.0):
        box_h, box_w = (y2 - y1, x2 - x1) if half_pixel else (max(y2 - y1, 1.0), max(x2 - x1, 1.0))
        grid_h = ratio if ratio > 0 else int(np.ceil(box_h / out_h))
        grid_w = ratio if ratio > 0 else int(np.ceil(box_w / out_w))
        ys = y1 + (np.arange(out_h)[:, None] + (np.arange(grid_h)[None, :] + 0.5) / grid_h) * box_h / out_h
        xs = x1 + (np.arange(out_w)[:, None] + (np.arange(grid_w)[None, :] + 0.5) / grid_w) * box_w / out_w
        y = np.broadcast_to(ys[:, None, :, None], (out_h, out_w, grid_h, grid_w)).reshape(out_h, out_w, -1)
        x = np.broadcast_to(xs[None, :, None, :], (out_h, out_w, grid_h, grid_w)).reshape(out_h, out_w, -1)
        per_box.append(_bilinear_taps(y, x, height, width))
    samples = max(p[0].shape[2] for p in per_box)
    positions = np.zeros((len(per_box), out_h, out_w, samples, 4), np.int64)
    weights = np.zeros(positions.shape)
    exists = np.zeros((len(per_box), samples), bool)
    for r, (pos, w) in enumerate(per_box):
        positions[r, :, :, :pos.shape[2]], weights[r, :, :, :pos.shape[2]] = pos, w
        exists[r, :pos.shape[2]] = True
    return positions, weights, exists


def _bilinear_taps(y: np.ndarray, x: np.ndarray, height: int, width: int):
    """RoiAlign's bilinear interpolation at (y, x): 4 flat positions and weights each, zero outside the map."""
    outside = (y < -1) | (y > height) | (x < -1) | (x > width)
    y, x = np.maximum(y, 0), np.maximum(x, 0)
    y_low, x_low = y.astype(np.int64), x.astype(np.int64)
    y_low, x_low = np.minimum(y_low, height - 1), np.minimum(x_low, width - 1)
    y = np.where(y_low >= height - 1, y_low, y)
    x = np.where(x_low >= width - 1, x_low, x)
    y_high, x_high = np.minimum(y_low + 1, height - 1), np.minimum(x_low + 1, width - 1)
    ly, lx = y - y_low, x - x_low
    weights = np.stack([(1 - ly) * (1 - lx), (1 - ly) * lx, ly * (1 - lx), ly * lx], -1)
    positions = np.stack([y_low * width + x_low, y_low * width + x_high, y_high * width + x_low,
                          y_high * width + x_high], -1)
    return np.where(outside[..., None], 0, positions), np.where(outside[..., None], 0.0, weights)


def _roi_align(n: NodeContext, x, rois, batch_indices):
    """RoiAlign: each box's bins averaged (or maxed) over bilinear samples, gathered from the channels-last map."""
    batch, channels, height, width = x.shape
    positions, weights, exists = _roi_samples(n, np.asarray(n.static(rois), np.float64), height, width)
    boxes = np.asarray(n.static(batch_indices)).reshape(-1, 1, 1, 1, 1) * height * width
    table = x.permute(0, 2, 3, 1).reshape(batch * height * width, channels)
    picked = table.index_select(0, n.const((positions + boxes).reshape(-1)))
    picked = picked.reshape(*positions.shape, channels) * n.const(weights[..., None], x)
    if n.attr("mode", "avg") == "avg":
        counts = np.maximum(exists.sum(1), 1).reshape(-1, 1, 1, 1)
        out = picked.sum((3, 4)) / n.const(counts, x)
    else:
        lowest = n.const(np.where(exists, 0.0, -np.inf).reshape(len(exists), 1, 1, -1, 1), x)
        out = (picked.amax(4) + lowest).amax(3)
    return out.permute(0, 3, 1, 2)


OPS = {"Resize": _resize, "Upsample": _upsample, "GridSample": _grid_sample, "RoiAlign": _roi_align}
