"""`ember.vision`: image preprocessing as lazy ember ops, so it fuses with whatever reads its results.

Conventions (OpenCV's and torchvision's where they meet):
- images are channels-last, `[H, W, C]` or a batch `[N, H, W, C]` (uint8 or float);
- sizes are `(height, width)`; boxes are OpenCV `Rect`s, `(x, y, width, height)` in pixels;
- resampling and colour conversion compute in float32 and return float32 on the 0-255 scale, unrounded, so
  what follows loses nothing; `to_uint8` rounds half to even and saturates, as OpenCV's uint8 results.

Every function builds ordinary graph ops: sampling is index arithmetic and gathers of the source, so a crop,
resize, colour conversion and normalisation realized together are planned as one kernel over the output that
loads only the source samples it needs. `crop_resize` takes the boxes as a tensor (runtime data): new boxes
of the same count reuse the compiled plan.
"""

from __future__ import annotations

import numpy as np

import ember
from ember.errors import ShapeError
from ember.ops.index import checked, gather_in_range
from ember.tensor import Tensor

__all__ = ["crop", "crop_resize", "cvt_color", "normalize", "resize", "to_packed", "to_planar", "to_uint8"]

INTERPOLATIONS = ("bilinear", "nearest")
KEEP_ASPECT = (None, "center", "left")
# YUV -> RGB: (luma scale, luma offset, V->R, U->G, V->G, U->B) by (standard, range). Limited-range BT.601 is
# OpenCV's (its fixed-point coefficients / 2^20); the others are the standards' matrices.
_YUV = {
    ("bt601", "limited"): (1220542 / 2**20, 16.0, 1673527 / 2**20, -409993 / 2**20, -852492 / 2**20,
                           2116026 / 2**20),
    ("bt709", "limited"): (255 / 219, 16.0, 1.7927, -0.2132, -0.5329, 2.1124),
    ("bt601", "full"): (1.0, 0.0, 1.402, -0.344136, -0.714136, 1.772),
    ("bt709", "full"): (1.0, 0.0, 1.5748, -0.187324, -0.468124, 1.8556),
}
_GRAY = (0.299, 0.587, 0.114)  # R, G, B weights of OpenCV's RGB2GRAY


def _check_image(x: Tensor, op: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"ember.vision.{op}: expected an ember Tensor, got {type(x).__name__}")
    if x.ndim not in (3, 4):
        raise ShapeError(f"ember.vision.{op}: expected a channels-last image [H, W, C] or batch [N, H, W, C], "
                         f"got shape {list(x.shape)} ({x.dtype}, {x.device})")


def _size(size, op: str) -> tuple[int, int]:
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if h <= 0 or w <= 0:
        raise ValueError(f"ember.vision.{op}: size must be positive (height, width), got {size}")
    return int(h), int(w)


def _float(x: Tensor) -> Tensor:
    return x if x.dtype is ember.float32 else x.to(ember.float32)


# -- sampling --------------------------------------------------------------------------------------

def _sample(images: Tensor, which: Tensor, boxes: Tensor, size: tuple[int, int], interpolation: str,
            keep_aspect: str | None, background, thin: bool | None = None, checked_boxes: bool = False) -> Tensor:
    """[B, h, w, C] float32: box b (whole pixels, int) of image which[b] resized to `size`. `thin`: whether every
    box has a side of one pixel (None: it depends on the box, at runtime). `checked_boxes`: boxes that are runtime
    data, whose sample rows and columns are checked to lie inside the frame (an IndexError from crop_resize)."""
    n, height, width, channels = images.shape
    h, w = size
    device = images.device
    flat = images.reshape(-1)
    # index arithmetic in int32 where every intermediate fits: the gather offsets, and the doubled sample
    # positions (2 out + 1) * extent of _axis, for boxes inside the frame
    small = flat.numel() < 2**31 and (2 * max(h, w) + 1) * max(height, width, 1) < 2**31
    ints = ember.int32 if small else ember.int64
    x0, y0, bw, bh = (boxes[:, i].to(ints) for i in range(4))
    ys = ember.arange(h, device=device, dtype=ints)[None, :]
    xs = ember.arange(w, device=device, dtype=ints)[None, :]
    inside = None
    ch, cw = h, w  # the content's size: the whole output, or the box scaled to fit inside it
    if keep_aspect is not None:
        # the box scaled by min(h / bh, w / bw), each side rounded (half to even) to whole pixels, exactly: the
        # limiting side fills the output, the other is round(side * out / limiting side), at least 1
        # (the limiting side's ratio rounds to at least its output size, so a clamp picks it)
        ch = _round_ratio(bh * w, bw).clamp(min=1, max=h)
        cw = _round_ratio(bw * h, bh).clamp(min=1, max=w)
        if keep_aspect == "center":
            ys, xs = ys - ((h - ch) // 2)[:, None], xs - ((w - cw) // 2)[:, None]  # positions inside the content
        inside = ((ys >= 0) & (ys < ch[:, None]))[:, :, None] & ((xs >= 0) & (xs < cw[:, None]))[:, None, :]
        ys, xs = ys.clamp(min=0), xs.clamp(min=0)
    # OpenCV resizes a source one pixel wide or high without IPP, at positions rounded to float32 first (which
    # matters along its other side): per box, at runtime, or for all when the source is one image
    ya, yb, wy = _axis(ys, y0, bh, ch, interpolation, (bw < 2)[:, None] if thin is None else thin,
                       (2 * h + 1) * height)
    xa, xb, wx = _axis(xs, x0, bw, cw, interpolation, (bh < 2)[:, None] if thin is None else thin,
                       (2 * w + 1) * width)
    if checked_boxes:
        ya, yb = (checked("crop_resize", y, height, 1) for y in (ya, yb))
        xa, xb = (checked("crop_resize", x, width, 2) for x in (xa, xb))
    base = (which.to(ints) * (height * width))[:, None, None]
    lanes = ember.arange(channels, device=device, dtype=ints)

    def at(yy, xx):  # [B, h, w, C]: rows yy [B, h], columns xx [B, w]; a gather reads only these samples
        # in range: the rows and columns lie in their boxes, the boxes in the frame and the images in the batch
        index = ((base + yy[:, :, None] * width + xx[:, None, :]) * channels)[..., None] + lanes
        return _float(gather_in_range(flat, 0, index.reshape(-1))).reshape(index.shape)

    top = at(ya, xa)
    if interpolation == "bilinear":  # as OpenCV weighs them: along the row, then between the rows
        wx4, wy4 = wx[:, None, :, None], wy[:, :, None, None]
        top = top * (1 - wx4) + at(ya, xb) * wx4
        bottom = at(yb, xa) * (1 - wx4) + at(yb, xb) * wx4
        top = top * (1 - wy4) + bottom * wy4
    if inside is None:
        return top
    fill = ember.tensor(np.broadcast_to(np.asarray(background, dtype=np.float32), (channels,)).copy(),
                        device=device)
    return ember.where(inside[:, :, :, None], top, fill)


def _round_ratio(p: Tensor, q: Tensor) -> Tensor:
    """p / q rounded half to even, for p >= 0 and q > 0 (ints), exactly."""
    quotient = p // q
    twice = 2 * (p - quotient * q)
    return quotient + ((twice > q) | ((twice == q) & (quotient % 2 == 1))).to(quotient.dtype)


def _axis(d: Tensor, start: Tensor, extent: Tensor, out, interpolation: str, rounded: Tensor | bool = False,
          bound: int = 0):
    """The two source positions and the weight of the second, along one axis: output positions d ([B, out] or
    [1, out], int) of a box `start` + [0, extent) resized to `out` samples (an int, or per box [B]).

    Exact, in integers: output d samples the source at ((2 d + 1) extent - out) / (2 out), whose floor is the
    first position and whose fraction the weight, correctly rounded to float32, as OpenCV's IPP-accelerated
    float path computes them (torch's interpolate rounds the position to float32 first, which moves a weight by
    up to an ulp of the position: a few hundredths of a level at a 4K frame's far edge). Where `rounded` holds
    (per box, [B, 1], or for all), the position is rounded to float32 first, as OpenCV's own path does where it
    does not use IPP. `bound`: at least (2 out + 1) extent, for the rounded position's precision."""
    last = (extent - 1)[:, None]
    per_box = isinstance(out, Tensor)
    o = out[:, None] if per_box else out
    if interpolation == "nearest":  # OpenCV's INTER_NEAREST, float64 rounding included: floor(d * (1 / (out / extent)))
        f64 = ember.float64
        numerator = o.to(f64) if per_box else ember.full((1, 1), float(o), dtype=f64, device=d.device)
        scale = (numerator / extent[:, None].to(f64)).reciprocal()  # a tensor's quotient: number / tensor is not one
        first = ember.minimum((d.to(f64) * scale).floor().to(d.dtype), last)
        return start[:, None] + first, start[:, None] + first, None
    twice = 2 * o
    n = ((2 * d + 1) * extent[:, None] - o).clamp(min=0)
    first = n // twice
    fraction = (n - first * twice).to(ember.float32)
    weight = fraction / twice.to(ember.float32) if per_box else fraction * np.float32(1 / twice)
    if rounded is not False:
        # the position n / (2 out) correctly rounded to float32 (through float64 where n may pass 2^24)
        wide = ember.float32 if bound <= 2**24 else ember.float64
        position = (n.to(wide) / (twice.to(wide) if per_box else float(twice))).to(ember.float32)
        floor = position.floor()
        if rounded is True:
            first, weight = floor.to(first.dtype), position - floor
        else:
            first = ember.where(rounded, floor.to(first.dtype), first)
            weight = ember.where(rounded, position - floor, weight)
    return start[:, None] + ember.minimum(first, last), start[:, None] + ember.minimum(first + 1, last), weight


def _boxes(boxes, device) -> Tensor:
    """Boxes as a tensor [N, 4] on `device`. A tensor's values are runtime data (a float one is cut to whole
    pixels); boxes given on the host are checked against the frame by the caller."""
    b = boxes if isinstance(boxes, Tensor) else ember.tensor(np.asarray(boxes, dtype=np.int64).reshape(-1, 4),
                                                             device=device)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ShapeError(f"ember.vision: boxes must be (x, y, width, height) rows, shape [N, 4]; got "
                         f"{list(b.shape)}")
    return b.to(device) if b.device != device else b


def resize(x: Tensor, size, interpolation: str = "bilinear", keep_aspect: str | None = None,
           background=0.0) -> Tensor:
    """x ([..., H, W, C]) resized to `size` (height, width), float32 on the source's scale. `keep_aspect`:
    None stretches; "center" or "left" fits the image inside `size` and fills the rest with `background`."""
    _check_image(x, "resize")
    if interpolation not in INTERPOLATIONS or keep_aspect not in KEEP_ASPECT:
        raise ValueError(f"ember.vision.resize: interpolation must be one of {INTERPOLATIONS} and keep_aspect one "
                         f"of {KEEP_ASPECT}; got {interpolation!r}, {keep_aspect!r}")
    batch = x if x.ndim == 4 else x[None]
    n, height, width, _ = batch.shape
    boxes = ember.tensor(np.tile(np.int64([0, 0, width, height]), (n, 1)), device=x.device)
    which = ember.arange(n, device=x.device)
    out = _sample(batch, which, boxes, _size(size, "resize"), interpolation, keep_aspect, background,
                  thin=height < 2 or width < 2)
    return out if x.ndim == 4 else out[0]


def crop(images: Tensor, boxes) -> list[Tensor]:
    """The boxes (x, y, width, height) of an image [H, W, C], as views (a ragged batch: a list)."""
    _check_image(images, "crop")
    if images.ndim != 3:
        raise ShapeError(f"ember.vision.crop: expected one image [H, W, C], got {list(images.shape)}; "
                         "crop_resize takes a batch")
    return [images[y:y + h, x:x + w] for x, y, w, h in _host_boxes(boxes, images.shape, "crop").tolist()]


def _host_boxes(boxes, shape, op: str) -> np.ndarray:
    """Boxes given on the host as whole-pixel rows [N, 4], each checked to lie inside the frame."""
    height, width = shape[-3:-1]
    b = np.asarray(boxes)
    if b.size % 4 or (b.ndim == 2 and b.shape[1] != 4) or b.ndim > 2:
        raise ShapeError(f"ember.vision.{op}: boxes must be (x, y, width, height) rows, got shape {list(b.shape)}")
    rows = b.reshape(-1, 4)
    if rows.size and not np.array_equal(rows, np.round(rows)):
        raise ValueError(f"ember.vision.{op}: boxes are whole pixels, got {rows[(rows != np.round(rows)).any(1)][0]}")
    rows = rows.astype(np.int64)
    for x, y, w, h in rows.tolist():
        if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > width or y + h > height:
            raise ValueError(f"ember.vision.{op}: box (x={x}, y={y}, width={w}, height={h}) is not inside the "
                             f"{width}x{height} image")
    return rows


def crop_resize(images: Tensor, boxes, size, interpolation: str = "bilinear", keep_aspect: str | None = None,
                background=0.0, indices=None) -> Tensor:
    """Each box of `boxes` ([N, 4] (x, y, width, height), a list or a Tensor: runtime data) cropped and resized
    to `size`: one [N, h, w, C] float32 batch. `images`: one image [H, W, C] all boxes come from, or a batch
    [M, H, W, C] with `indices` (one per box; default box i from image i)."""
    _check_image(images, "crop_resize")
    if interpolation not in INTERPOLATIONS or keep_aspect not in KEEP_ASPECT:
        raise ValueError(f"ember.vision.crop_resize: interpolation must be one of {INTERPOLATIONS} and keep_aspect "
                         f"one of {KEEP_ASPECT}; got {interpolation!r}, {keep_aspect!r}")
    batch = images if images.ndim == 4 else images[None]
    b = _boxes(boxes if isinstance(boxes, Tensor) else _host_boxes(boxes, images.shape, "crop_resize"),
               images.device)
    if indices is None:
        which = ember.zeros(b.shape[0], dtype=ember.int64, device=images.device) if images.ndim == 3 else \
            ember.arange(b.shape[0], device=images.device)
        if images.ndim == 4 and b.shape[0] != batch.shape[0]:
            raise ShapeError(f"ember.vision.crop_resize: {b.shape[0]} boxes for {batch.shape[0]} images; pass "
                             "indices= to say which image each box is from")
    else:
        which = indices if isinstance(indices, Tensor) else ember.tensor(np.asarray(indices, np.int64),
                                                                         device=images.device)
        which = checked("crop_resize", which, batch.shape[0], 0)
    return _sample(batch, which, b, _size(size, "crop_resize"), interpolation, keep_aspect, background,
                   checked_boxes=isinstance(boxes, Tensor))


# -- colour ----------------------------------------------------------------------------------------

def cvt_color(x, code: str, standard: str = "bt601", range: str = "limited") -> Tensor:  # noqa: A002
    """OpenCV's colour conversions by name: "RGB2BGR", "BGR2RGB", "RGBA2RGB", "BGRA2BGR", "RGBA2BGR",
    "BGRA2RGB", "RGB2RGBA", "BGR2BGRA", "RGB2GRAY", "BGR2GRAY", "GRAY2RGB", "YUV2RGB_NV12", "YUV2BGR_NV12",
    "YUV2RGB_NV21", "YUV2BGR_NV21". YUV input: an [H*3/2, W] buffer, or a (Y [H, W], UV [H/2, W/2, 2]) pair;
    `standard` "bt601" or "bt709", `range` "limited" (OpenCV's) or "full". Returns float32, 0-255 scale."""
    code = code.upper()
    if code.startswith("YUV2"):
        return _from_nv(x, code, standard, range)
    _check_image(x, "cvt_color")
    c = x.shape[-1]
    wanted = {"RGB2BGR": 3, "BGR2RGB": 3, "RGBA2RGB": 4, "BGRA2BGR": 4, "RGBA2BGR": 4, "BGRA2RGB": 4,
              "RGB2RGBA": 3, "BGR2BGRA": 3, "RGB2GRAY": 3, "BGR2GRAY": 3, "GRAY2RGB": 1, "GRAY2BGR": 1}
    if code not in wanted:
        raise ValueError(f"ember.vision.cvt_color: unknown code {code!r}; expected one of "
                         f"{', '.join(sorted(wanted))}, or YUV2RGB_NV12 / YUV2BGR_NV12 / YUV2RGB_NV21 / YUV2BGR_NV21")
    if c != wanted[code]:
        raise ShapeError(f"ember.vision.cvt_color({code}): expected {wanted[code]} channels, got shape "
                         f"{list(x.shape)}")
    f = _float(x)
    if code in ("RGB2BGR", "BGR2RGB"):
        return f.flip(-1)
    if code in ("RGBA2RGB", "BGRA2BGR"):
        return f[..., :3]
    if code in ("RGBA2BGR", "BGRA2RGB"):
        return f[..., :3].flip(-1)
    if code in ("RGB2RGBA", "BGR2BGRA"):
        return ember.cat([f, ember.full_like(f[..., :1], 255.0)], dim=-1)
    if code in ("GRAY2RGB", "GRAY2BGR"):
        return f.expand(*f.shape[:-1], 3)
    r, g, b = (f[..., i:i + 1] for i in ((0, 1, 2) if code == "RGB2GRAY" else (2, 1, 0)))
    return r * _GRAY[0] + g * _GRAY[1] + b * _GRAY[2]


def _from_nv(x, code: str, standard: str, rng: str) -> Tensor:
    key = (standard, rng)
    if key not in _YUV:
        raise ValueError(f"ember.vision.cvt_color({code}): standard must be 'bt601' or 'bt709' and range "
                         f"'limited' or 'full'; got {standard!r}, {rng!r}")
    kind = code.split("_")[-1]
    if code not in ("YUV2RGB_NV12", "YUV2BGR_NV12", "YUV2RGB_NV21", "YUV2BGR_NV21"):
        raise ValueError(f"ember.vision.cvt_color: unknown code {code!r}")
    if isinstance(x, (tuple, list)):
        y, uv = x
        if y.ndim != 2 or uv.ndim != 3 or uv.shape[-1] != 2 or tuple(uv.shape[:2]) != (y.shape[0] // 2,
                                                                                       y.shape[1] // 2):
            raise ShapeError(f"ember.vision.cvt_color({code}): expected Y [H, W] and UV [H/2, W/2, 2], got "
                             f"{list(y.shape)} and {list(uv.shape)}")
    else:
        if x.ndim != 2 or x.shape[0] % 3 or x.shape[0] * 2 % 3 or (x.shape[0] * 2 // 3) % 2 or x.shape[1] % 2:
            raise ShapeError(f"ember.vision.cvt_color({code}): expected an NV12/NV21 buffer [H*3/2, W] with H and "
                             f"W even, got {list(x.shape)}")
        height = x.shape[0] * 2 // 3
        y, uv = x[:height], x[height:].reshape(height // 2, x.shape[1] // 2, 2)
    height, width = y.shape
    # each chroma sample covers 2x2 luma samples
    uv_full = _float(uv)[:, None, :, None, :].expand(height // 2, 2, width // 2, 2, 2).reshape(height, width, 2)
    u, v = (uv_full[..., 0], uv_full[..., 1]) if kind == "NV12" else (uv_full[..., 1], uv_full[..., 0])
    cy, offset, vr, ug, vg, ub = _YUV[key]
    luma = (_float(y) - offset).clamp(min=0.0) * cy if offset else _float(y) * cy
    u, v = u - 128.0, v - 128.0
    r, g, b = luma + vr * v, luma + ug * u + vg * v, luma + ub * u
    channels = (r, g, b) if "RGB" in code.split("_")[0] else (b, g, r)
    return ember.stack(channels, dim=-1)


# -- values and layout -----------------------------------------------------------------------------

def normalize(x: Tensor, mean, std) -> Tensor:
    """(x - mean) / std in float32. Numbers or sequences are per channel (the last axis): x - mean times 1 / std,
    the reciprocal computed in float64 once (within an ulp of dividing, without a division per element).
    Tensors are runtime data broadcast against x (per sample: [N, 1, 1, C]), divided as written."""
    f = _float(x)

    def per_channel(v, dtype=np.float32) -> np.ndarray:
        return np.broadcast_to(np.asarray(v, dtype), (f.shape[-1],))

    m = mean.to(ember.float32) if isinstance(mean, Tensor) else ember.tensor(per_channel(mean).copy(),
                                                                              device=f.device)
    if isinstance(std, Tensor) or isinstance(mean, Tensor):
        s = std.to(ember.float32) if isinstance(std, Tensor) else ember.tensor(per_channel(std).copy(),
                                                                               device=f.device)
        try:
            return (f - m) / s
        except ShapeError as error:
            raise ShapeError(f"ember.vision.normalize: mean {list(m.shape)} and std {list(s.shape)} must broadcast "
                             f"against the image {list(f.shape)}") from error
    scale = (1.0 / per_channel(std, np.float64)).astype(np.float32)
    return (f - m) * ember.tensor(scale, device=f.device)


def to_uint8(x: Tensor) -> Tensor:
    """Rounded half to even and saturated to 0-255, as OpenCV's uint8 results."""
    return x.round().clamp(0, 255).to(ember.uint8)


def to_planar(x: Tensor) -> Tensor:
    """[..., H, W, C] -> [..., C, H, W] (a view)."""
    _check_image(x, "to_planar")
    order = list(range(x.ndim - 3)) + [x.ndim - 1, x.ndim - 3, x.ndim - 2]
    return x.permute(*order)


def to_packed(x: Tensor) -> Tensor:
    """[..., C, H, W] -> [..., H, W, C] (a view)."""
    _check_image(x, "to_packed")
    order = list(range(x.ndim - 3)) + [x.ndim - 2, x.ndim - 1, x.ndim - 3]
    return x.permute(*order)

