"""ember.vision against OpenCV (cv2's float path, and its uint8 results within 1) and torch's interpolate, on
random images and boxes, on the cpu reference and on the cuda device (Triton's interpreter in CI); and the
fused plan: a whole pipeline from the source frame is one kernel."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import ember
import ember.vision as V

cv2 = pytest.importorskip("cv2")

DEVICES = ["cpu", "cuda"]
FLOAT_TOL = 1e-4  # on the 0-255 scale


def opencv_tol(extent: int) -> float:
    """How far cv2's float resize may be from exact sampling: 1e-4 where it runs Intel IPP's resize (x86 wheels;
    exact positions), else an ulp of the largest source position times a level range (its plain path rounds
    the positions to float32 first, as torch does)."""
    return FLOAT_TOL if cv2.ipp.useIPP() else position_tol(extent)


def position_tol(extent: int) -> float:
    """torch's interpolate rounds each sample position to float32 before weighing: off by up to an ulp of the
    position, so by that times the 255 levels between neighbours."""
    return max(FLOAT_TOL, 2 * 255 * float(np.spacing(np.float32(extent))))


def content_size(h: int, w: int, size) -> tuple[int, int]:
    """A box's size scaled to fit `size` keeping its aspect: exact, each side rounded half to even, at least 1."""
    scale = min(Fraction(size[0], h), Fraction(size[1], w))
    return max(1, round(h * scale)), max(1, round(w * scale))


def exact_resize(img: np.ndarray, size) -> np.ndarray:
    """Bilinear resize with OpenCV's half-pixel mapping in float64 at exact positions: the oracle."""
    def axis(n_out, n_in):
        p = np.maximum((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0.0)
        first = np.floor(p).astype(np.int64)
        return np.minimum(first, n_in - 1), np.minimum(first + 1, n_in - 1), (p - first)
    ya, yb, wy = axis(size[0], img.shape[0])
    xa, xb, wx = axis(size[1], img.shape[1])
    f = img.astype(np.float64)
    wx, wy = wx[None, :, None], wy[:, None, None]
    top = f[ya][:, xa] * (1 - wx) + f[ya][:, xb] * wx
    bottom = f[yb][:, xa] * (1 - wx) + f[yb][:, xb] * wx
    return top * (1 - wy) + bottom * wy


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.fixture
def device(request):
    """A test's device parameter; "cuda" needs the cuda backend (a GPU, or EMBER_INTERPRET=1)."""
    if request.param == "cuda":
        request.getfixturevalue("cuda_backend")
    return request.param


def image(rng, h, w, c=3):
    return rng.integers(0, 256, (h, w, c), dtype=np.uint8)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("size", [(20, 31), (80, 90), (37, 53), (1, 1), (5, 200)])
def test_resize_matches_opencv_and_torch(device, size, rng):
    img = image(rng, 37, 53)
    x = ember.tensor(img, device=device)
    got = V.resize(x, size).numpy()
    np.testing.assert_allclose(got, exact_resize(img, size), atol=FLOAT_TOL)
    want = cv2.resize(img.astype(np.float32), (size[1], size[0]), interpolation=cv2.INTER_LINEAR).reshape(got.shape)
    np.testing.assert_allclose(got, want, atol=opencv_tol(53))
    theirs = torch.nn.functional.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None].float(), size=size,
                                             mode="bilinear", align_corners=False, antialias=False)
    np.testing.assert_allclose(got, theirs[0].permute(1, 2, 0).numpy(), atol=position_tol(53))
    nearest = V.resize(x, size, interpolation="nearest").numpy()
    np.testing.assert_array_equal(nearest, cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_NEAREST)
                                  .reshape(nearest.shape))
    as_uint8 = V.to_uint8(V.resize(x, size)).numpy()
    opencv_uint8 = cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_LINEAR).reshape(as_uint8.shape)
    assert np.abs(as_uint8.astype(int) - opencv_uint8.astype(int)).max() <= 1


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("size", [(224, 224), (97, 301)])
def test_a_4k_frame_resized_samples_at_exact_positions_even_at_the_far_edge(size, device, rng):
    """Sample positions thousands of pixels from the origin: ember's weights are the exact fractions (integer
    position arithmetic), as OpenCV's float path gives them; torch's positions are rounded to float32 first."""
    img = image(rng, 2160, 3840)
    got = V.resize(ember.tensor(img, device=device), size).numpy()
    np.testing.assert_allclose(got, exact_resize(img, size), atol=FLOAT_TOL)
    want = cv2.resize(img.astype(np.float32), (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_allclose(got, want, atol=opencv_tol(3840))
    theirs = torch.nn.functional.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None].float(), size=size,
                                             mode="bilinear", align_corners=False, antialias=False)
    np.testing.assert_allclose(got, theirs[0].permute(1, 2, 0).numpy(), atol=position_tol(3840))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_crop_resize_of_boxes_of_different_sizes_matches_opencv_crop_then_resize(device, rng):
    img = image(rng, 61, 83)
    boxes = [(3, 5, 20, 10), (0, 0, 83, 61), (10, 2, 7, 30), (82, 60, 1, 1), (40, 30, 43, 31)]
    got = V.crop_resize(ember.tensor(img, device=device), boxes, (16, 24)).numpy()
    assert got.shape == (5, 16, 24, 3) and got.dtype == np.float32
    for i, (bx, by, bw, bh) in enumerate(boxes):
        want = cv2.resize(img[by:by + bh, bx:bx + bw].astype(np.float32), (24, 16), interpolation=cv2.INTER_LINEAR)
        np.testing.assert_allclose(got[i], want.reshape(16, 24, 3), atol=opencv_tol(83), err_msg=f"box {i}")


@pytest.mark.parametrize("box", [(3, 4, 37, 23), (0, 0, 13, 50), (5, 1, 41, 41)])
def test_keep_aspect_resizes_a_box_to_its_rounded_content_size_as_opencv_would(box, rng):
    img = image(rng, 60, 50)
    x, y, w, h = box
    got = V.crop_resize(ember.tensor(img), [box], (30, 30), keep_aspect="center").numpy()[0]
    ch, cw = content_size(h, w, (30, 30))
    top, left = (30 - ch) // 2, (30 - cw) // 2
    want = cv2.resize(img[y:y + h, x:x + w].astype(np.float32), (cw, ch), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_allclose(got[top:top + ch, left:left + cw], want.reshape(ch, cw, 3), atol=opencv_tol(60))
    assert (got[:top] == 0).all() and (got[:, :left] == 0).all()


@pytest.mark.parametrize("keep", ["center", "left"])
def test_keep_aspect_fits_the_box_and_fills_the_rest_with_the_background(keep, rng):
    img = image(rng, 40, 100)
    got = V.crop_resize(ember.tensor(img), [(0, 0, 100, 40)], (60, 60), keep_aspect=keep, background=7.0).numpy()[0]
    content = cv2.resize(img.astype(np.float32), (60, 24), interpolation=cv2.INTER_LINEAR)
    top = 18 if keep == "center" else 0
    np.testing.assert_allclose(got[top:top + 24], content, atol=opencv_tol(100))
    assert (got[:top] == 7.0).all() and (got[top + 24:] == 7.0).all()


def test_a_batch_of_images_takes_one_box_each_or_the_boxes_indices(rng):
    imgs = np.stack([image(rng, 30, 40) for _ in range(3)])
    boxes = [(1, 2, 10, 20), (5, 5, 30, 20), (0, 0, 40, 30)]
    got = V.crop_resize(ember.tensor(imgs), boxes, (8, 8)).numpy()
    picked = V.crop_resize(ember.tensor(imgs), boxes, (8, 8), indices=[2, 2, 0]).numpy()
    for i, (bx, by, bw, bh) in enumerate(boxes):
        for out, src in ((got[i], imgs[i]), (picked[i], imgs[[2, 2, 0][i]])):
            want = cv2.resize(src[by:by + bh, bx:bx + bw].astype(np.float32), (8, 8), interpolation=cv2.INTER_LINEAR)
            np.testing.assert_allclose(out, want, atol=opencv_tol(40))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("code", ["YUV2RGB_NV12", "YUV2BGR_NV12", "YUV2RGB_NV21", "YUV2BGR_NV21"])
def test_nv12_and_nv21_frames_convert_as_opencv_converts_them(device, code, rng):
    frame = rng.integers(0, 256, (48 * 3 // 2, 64), dtype=np.uint8)
    got = V.to_uint8(V.cvt_color(ember.tensor(frame, device=device), code)).numpy()
    want = cv2.cvtColor(frame, getattr(cv2, f"COLOR_{code}"))
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    planes = (ember.tensor(frame[:48], device=device), ember.tensor(frame[48:].reshape(24, 32, 2), device=device))
    np.testing.assert_array_equal(V.to_uint8(V.cvt_color(planes, code)).numpy(), got)


@pytest.mark.parametrize("standard,rng_name", [("bt709", "limited"), ("bt601", "full"), ("bt709", "full")])
def test_other_yuv_standards_and_ranges_follow_their_matrices(standard, rng_name, rng):
    frame = rng.integers(0, 256, (6, 4), dtype=np.uint8)
    got = V.cvt_color(ember.tensor(frame), "YUV2RGB_NV12", standard=standard, range=rng_name).numpy()
    y, u, v = float(frame[0, 0]), float(frame[4, 0]) - 128, float(frame[4, 1]) - 128
    kr, kb = (0.2126, 0.0722) if standard == "bt709" else (0.299, 0.114)
    scale, chroma = (255 / 219, 255 / 224) if rng_name == "limited" else (1.0, 1.0)
    luma = (y - 16) * scale if rng_name == "limited" else y
    r = luma + chroma * 2 * (1 - kr) * v
    b = luma + chroma * 2 * (1 - kb) * u
    np.testing.assert_allclose(got[0, 0, [0, 2]], [r, b], atol=0.05)


@pytest.mark.parametrize("code", ["RGB2BGR", "BGR2RGB", "RGBA2RGB", "BGRA2BGR", "RGBA2BGR", "BGRA2RGB", "RGB2RGBA",
                                  "BGR2BGRA", "RGB2GRAY", "BGR2GRAY", "GRAY2RGB"])
def test_channel_conversions_match_opencv(code, rng):
    channels = 4 if code.startswith(("RGBA", "BGRA")) else 1 if code.startswith("GRAY") else 3
    img = image(rng, 9, 11, channels)
    got = V.cvt_color(ember.tensor(img), code).numpy()
    source = img.astype(np.float32) if channels > 1 else img.astype(np.float32)[..., 0]
    if code.endswith("A"):  # alpha: opaque on the 0-255 scale, as OpenCV gives it for uint8 (1.0 for float)
        source = img
    want = cv2.cvtColor(source, getattr(cv2, f"COLOR_{code}"))
    np.testing.assert_allclose(got, want.reshape(got.shape), atol=FLOAT_TOL)


def test_normalize_to_uint8_and_layouts(rng):
    img = image(rng, 5, 6)
    x = ember.tensor(img)
    got = V.normalize(x, (1.0, 2.0, 3.0), (0.5, 2.0, 4.0)).numpy()
    np.testing.assert_allclose(got, (img - np.float32([1, 2, 3])) / np.float32([0.5, 2, 4]), rtol=1e-6)
    halves = ember.tensor(np.float32([[[-3.5, 0.5, 1.5], [2.5, 254.5, 300.0]]]))
    np.testing.assert_array_equal(V.to_uint8(halves).numpy(), [[[0, 0, 2], [2, 254, 255]]])
    planar = V.to_planar(x)
    assert tuple(planar.shape) == (3, 5, 6)
    np.testing.assert_array_equal(V.to_packed(planar).numpy(), img)


def test_bad_input_names_the_op_and_the_shapes():
    with pytest.raises(ember.ShapeError, match=r"cvt_color\(RGB2GRAY\).*3 channels"):
        V.cvt_color(ember.zeros(4, 4, 4), "RGB2GRAY")
    with pytest.raises(ValueError, match="unknown code"):
        V.cvt_color(ember.zeros(4, 4, 3), "RGB2HSV")
    with pytest.raises(ember.ShapeError, match=r"crop_resize.*\[H, W, C\]"):
        V.crop_resize(ember.zeros(4, 4), [(0, 0, 2, 2)], (2, 2))
    with pytest.raises(ValueError, match="not inside"):
        V.crop(ember.zeros(4, 4, 3), [(3, 3, 2, 2)])
    with pytest.raises(ValueError, match=r"crop_resize: box \(x=0, y=1, width=5, height=2\) is not inside the 4x4"):
        V.crop_resize(ember.zeros(4, 4, 3), [(0, 0, 2, 2), (0, 1, 5, 2)], (2, 2))
    with pytest.raises(ValueError, match="crop_resize: boxes are whole pixels"):
        V.crop_resize(ember.zeros(4, 4, 3), [(0.5, 0, 2, 2)], (2, 2))
    with pytest.raises(ember.ShapeError, match=r"crop_resize: boxes must be \(x, y, width, height\) rows"):
        V.crop_resize(ember.zeros(4, 4, 3), [(0, 0, 2)], (2, 2))
    with pytest.raises(ember.ShapeError, match="NV12/NV21"):
        V.cvt_color(ember.zeros(5, 4, dtype=ember.uint8), "YUV2RGB_NV12")


def _fkl_pipeline(frame, boxes):
    """FKL's example: crops resized into a square keeping the aspect ratio, x1.4 - 0.5, RGB->BGR, /255."""
    crops = V.crop_resize(frame, ember.tensor(np.float32(boxes), device=frame.device), (12, 12),
                          keep_aspect="center")
    return V.normalize(V.cvt_color(crops, "RGB2BGR") * 1.4 - 0.5, 0.0, 255.0)


def test_a_pipeline_on_the_cuda_device_equals_the_reference_for_any_boxes(cuda_backend, rng):
    """The reference (cpu) path is checked against OpenCV above; the cuda device against it, for two sets of
    boxes of the same count (the second reusing the first's plan)."""
    from ember.runtime import cuda

    img = image(rng, 64, 96)
    frame = ember.tensor(img, device="cuda")
    compiled = []
    for boxes in ([(0, 0, 20, 30), (10, 5, 50, 20), (3, 3, 90, 60)],
                  [(5, 5, 30, 30), (0, 0, 96, 64), (50, 40, 10, 10)]):
        got = _fkl_pipeline(frame, boxes).numpy()
        compiled.append(cuda.stats["plans_compiled"])
        np.testing.assert_allclose(got, _fkl_pipeline(ember.tensor(img), boxes).numpy(), atol=1e-5)
    assert compiled[1] == compiled[0]  # the boxes are data: the second set ran the first set's plan


def test_a_pipeline_from_the_frame_to_the_batch_is_one_kernel_that_gathers_its_samples(cuda_backend, rng):
    """Crops of different sizes resized keeping the aspect ratio, x1.4 - 0.5, RGB->BGR and /255 (in either order)
    are one kernel over the output: four gathers of the source per element, nothing stored between."""
    frame = ember.tensor(image(rng, 64, 96), device="cuda")
    boxes = ember.tensor(np.float32([(0, 0, 20, 30), (10, 5, 50, 20), (3, 3, 90, 60)]), device="cuda")
    after = _fkl_pipeline(frame, [(0, 0, 20, 30), (10, 5, 50, 20), (3, 3, 90, 60)])
    before = V.normalize(V.crop_resize(V.cvt_color(frame, "RGB2BGR"), boxes, (12, 12), keep_aspect="center") * 1.4
                         - 0.5, 0.0, 255.0)
    for out in (after, before):
        p = ember.explain.plan(out)
        assert len(p.kernels) == 1, str(p)
        (kernel,) = p.kernels
        assert sum(1 for n in kernel.covers if n.op.label == "gather") == 4, str(p)
    np.testing.assert_allclose(after.numpy(), before.numpy(), atol=1e-6)


def test_an_nv12_frame_converted_resized_normalised_and_made_planar_is_one_kernel(cuda_backend, rng):
    """The conversion is computed at the samples the resize gathers (a converted frame nobody holds is never
    stored); the planar layout is the output's index order."""
    frame = rng.integers(0, 256, (96 * 3 // 2, 128), dtype=np.uint8)
    mean, std = (123.7, 116.3, 103.5), (58.4, 57.1, 57.4)

    def pipeline(device):
        nv = ember.tensor(frame, device=device)
        rgb = V.cvt_color(nv, "YUV2RGB_NV12").clamp(0, 255)  # out-of-gamut colours saturate, as OpenCV's uint8
        return V.to_planar(V.normalize(V.resize(rgb, (24, 40)), mean, std))

    out = pipeline("cuda")
    assert len(ember.explain.plan(out).kernels) == 1, str(ember.explain.plan(out))
    rgb = cv2.cvtColor(frame, cv2.COLOR_YUV2RGB_NV12).astype(np.float32)
    want = ((cv2.resize(rgb, (40, 24), interpolation=cv2.INTER_LINEAR) - np.float32(mean)) / np.float32(std))
    got = out.numpy()
    assert got.shape == (3, 24, 40)
    # OpenCV rounds the conversion to uint8 first: within one level of 255, divided by std
    np.testing.assert_allclose(got, want.transpose(2, 0, 1), atol=1.01 / 57.0)
    np.testing.assert_allclose(got, pipeline("cpu").numpy(), atol=1e-4)


def test_different_pipelines_realized_together_share_one_launch(cuda_backend, rng):
    """Crops of an RGB frame and a resized NV12 frame (different sources, different outputs) realized together
    are one launch, each output what it is alone."""
    img = image(rng, 64, 96)
    nv = rng.integers(0, 256, (48 * 3 // 2, 64), dtype=np.uint8)
    boxes = [(0, 0, 20, 30), (10, 5, 50, 20)]

    def pipelines(device):
        crops = _fkl_pipeline(ember.tensor(img, device=device), boxes)
        frame = V.cvt_color(ember.tensor(nv, device=device), "YUV2BGR_NV12")
        return crops, V.to_planar(V.normalize(V.resize(frame, (16, 24)), (100.0, 110.0, 120.0), (50.0, 60.0, 70.0)))

    crops, planar = pipelines("cuda")
    p = ember.explain.plan(crops, planar)
    assert p.launches == 1, str(p)
    for got, want in zip((crops, planar), pipelines("cpu")):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4)


HELD_BOXES = [(3, 5, 20, 11), (0, 0, 37, 29), (36, 28, 1, 1), (10, 2, 7, 27)]  # in a 29x37 frame
HELD_SIZE = (13, 11)
MEAN, STD = (100.0, 110.0, 120.0), (50.0, 60.0, 70.0)


def _held_steps(order: str, frame: np.ndarray, device: str) -> list:
    """A preprocessing pipeline written one step per line in the given order, every step held in a variable of
    its own (so each is a result too): the steps, the batch last."""
    x = ember.tensor(frame, device=device)
    if order == "resize, normalise, convert":
        crops = V.crop_resize(x, HELD_BOXES, HELD_SIZE, keep_aspect="center", background=0)
        scaled = (crops * 1.4 - 0.5) / 255.0
        return [crops, scaled, V.cvt_color(scaled, "RGB2BGR")]
    if order == "resize, convert, normalise, planar":
        crops = V.crop_resize(x, HELD_BOXES, HELD_SIZE)
        bgr = V.cvt_color(crops, "RGB2BGR")
        normalised = V.normalize(bgr, MEAN, STD)
        return [crops, bgr, normalised, V.to_planar(normalised)]
    if order == "convert, resize, normalise":
        bgr = V.cvt_color(x, "RGB2BGR")
        crops = V.crop_resize(bgr, HELD_BOXES, HELD_SIZE, keep_aspect="left", background=7.0)
        return [bgr, crops, V.normalize(crops * 1.4 - 0.5, 0.0, 255.0)]
    if order == "normalise, resize, convert":
        scaled = (x * 1.4 - 0.5) / 255.0
        crops = V.crop_resize(scaled, HELD_BOXES, HELD_SIZE, keep_aspect="center")
        return [scaled, crops, V.cvt_color(crops, "RGB2BGR")]
    if order == "crop, resize, convert, normalise":
        (box,) = V.crop(x, [(10, 2, 7, 27)])
        resized = V.resize(box, HELD_SIZE)
        bgr = V.cvt_color(resized, "RGB2BGR")
        return [box, resized, bgr, V.normalize(bgr, MEAN, STD)]
    raise ValueError(order)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("order", ["resize, normalise, convert", "resize, convert, normalise, planar",
                                   "convert, resize, normalise", "normalise, resize, convert",
                                   "crop, resize, convert, normalise"])
def test_a_pipeline_whose_steps_are_held_in_variables_is_one_launch_in_any_order(order, dtype, cuda_backend, rng):
    """Each step a value the user still holds (so it is written too): the steps after a resampling read its result
    at other positions (a channel flip, a transpose, a gather of a converted frame) and compute it again there
    instead of waiting for a launch that writes it; every step equals the reference."""
    frame = rng.uniform(0, 255, (29, 37, 3)).astype(dtype)
    steps = _held_steps(order, frame, "cuda")
    p = ember.explain.plan(*steps)
    assert p.launches == 1, str(p)
    same_space = all(math.prod(s.shape) == math.prod(steps[-1].shape) for s in steps)
    assert len(p.kernels) == 1 or not same_space, str(p)
    for got, want in zip(steps, _held_steps(order, frame, "cpu")):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_a_held_pipeline_matches_opencv_crop_resize_into_a_square_scale_and_swap_channels(dtype, cuda_backend, rng):
    frame = rng.uniform(0, 255, (29, 37, 3)).astype(dtype)
    crops, scaled, bgr = _held_steps("resize, normalise, convert", frame, "cuda")
    assert ember.explain.plan(crops, scaled, bgr).launches == 1
    got = bgr.numpy()
    for i, (bx, by, bw, bh) in enumerate(HELD_BOXES):
        ch, cw = content_size(bh, bw, HELD_SIZE)
        top, left = (HELD_SIZE[0] - ch) // 2, (HELD_SIZE[1] - cw) // 2
        canvas = np.zeros((*HELD_SIZE, 3), np.float32)
        content = cv2.resize(frame[by:by + bh, bx:bx + bw].astype(np.float32), (cw, ch), interpolation=cv2.INTER_LINEAR)
        canvas[top:top + ch, left:left + cw] = content.reshape(ch, cw, 3)
        want = ((canvas * 1.4 - 0.5) / 255.0)[..., ::-1]
        np.testing.assert_allclose(got[i], want, atol=position_tol(37) * 1.4 / 255.0, err_msg=f"box {i}")


def test_a_held_nv12_conversion_and_resize_made_planar_is_one_launch(cuda_backend, rng):
    frame = rng.integers(0, 256, (24 * 3 // 2, 32), dtype=np.uint8)

    def steps(device):
        rgb = V.cvt_color(ember.tensor(frame, device=device), "YUV2RGB_NV12")
        resized = V.resize(rgb, (7, 13))
        return [rgb, resized, V.to_planar(V.normalize(resized, MEAN, STD))]

    got = steps("cuda")
    assert ember.explain.plan(*got).launches == 1, str(ember.explain.plan(*got))
    for g, want in zip(got, steps("cpu")):
        np.testing.assert_allclose(g.numpy(), want.numpy(), atol=1e-4)


def test_a_held_resampling_read_several_times_per_element_is_loaded_and_explain_says_why(cuda_backend, rng):
    """Grey from held crops reads each resampled pixel three times (its channels): recomputing the resampling
    three times per element is more than the cost model allows, so the grey kernel waits for the crops."""
    frame = image(rng, 29, 37)
    crops = V.crop_resize(ember.tensor(frame, device="cuda"), HELD_BOXES, HELD_SIZE)
    grey = V.cvt_color(crops, "RGB2GRAY")
    p = ember.explain.plan(crops, grey)
    assert p.launches == 2 and "too many to recompute 3 times" in str(p), str(p)
    reference = V.crop_resize(ember.tensor(frame), HELD_BOXES, HELD_SIZE)
    np.testing.assert_allclose(grey.numpy(), V.cvt_color(reference, "RGB2GRAY").numpy(), atol=1e-4)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_gradients_flow_through_crop_resize_and_normalize_as_through_torchs_interpolate(device, rng):
    """A float image's gradient through crops resized and normalised: the gathers' transpose (a scatter-add of
    the interpolation weights), as torch's interpolate backward computes it."""
    img = rng.standard_normal((21, 26, 3)).astype(np.float32)
    boxes = [(0, 0, 26, 21), (3, 2, 11, 15), (10, 5, 5, 4)]
    mean, std = (0.1, 0.2, 0.3), (1.5, 2.0, 2.5)
    x = ember.tensor(img, device=device, requires_grad=True)
    out = V.normalize(V.crop_resize(x, boxes, (7, 9)), mean, std)
    g = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    (out * ember.tensor(g, device=device)).sum().backward()
    tx = torch.from_numpy(img).clone().requires_grad_()
    crops = [torch.nn.functional.interpolate(tx[y:y + h, x0:x0 + w].permute(2, 0, 1)[None], size=(7, 9),
                                             mode="bilinear", align_corners=False, antialias=False)[0]
             for x0, y, w, h in boxes]
    want = (torch.stack(crops).permute(0, 2, 3, 1) - torch.tensor(mean)) / torch.tensor(std)
    (want * torch.from_numpy(g)).sum().backward()
    np.testing.assert_allclose(out.numpy(), want.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_degenerate_sizes_no_boxes_and_one_pixel_sources(device, rng):
    img = image(rng, 10, 12)
    x = ember.tensor(img, device=device)
    assert V.crop_resize(x, np.zeros((0, 4), np.float32), (4, 4)).numpy().shape == (0, 4, 4, 3)
    one = V.resize(x[:1, :1], (3, 5)).numpy()
    np.testing.assert_array_equal(one, np.broadcast_to(img[:1, :1].astype(np.float32), (3, 5, 3)))
    np.testing.assert_array_equal(V.crop_resize(x, [(4, 7, 1, 1)], (2, 2)).numpy()[0],
                                  np.broadcast_to(img[7:8, 4:5].astype(np.float32), (2, 2, 3)))
    with pytest.raises(ValueError, match=r"resize: size must be positive"):
        V.resize(x, (0, 4))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_normalize_takes_per_sample_means_and_stds_as_runtime_tensors(device, rng):
    img = image(rng, 40, 50)
    boxes = [(0, 0, 50, 40), (5, 3, 20, 30), (30, 10, 7, 9)]
    mean = rng.uniform(50, 150, (3, 1, 1, 3)).astype(np.float32)
    std = rng.uniform(20, 70, (3, 1, 1, 3)).astype(np.float32)
    crops = V.crop_resize(ember.tensor(img, device=device), boxes, (8, 10))
    out = V.normalize(crops, ember.tensor(mean, device=device), ember.tensor(std, device=device))
    if device == "cuda":
        assert len(ember.explain.plan(out).kernels) == 1, str(ember.explain.plan(out))
    np.testing.assert_allclose(out.numpy(), (crops.numpy() - mean) / std, rtol=1e-6, atol=1e-6)
    with pytest.raises(ember.ShapeError, match=r"normalize: mean \[2, 1, 1, 3\]"):
        V.normalize(crops, ember.tensor(mean[:2], device=device), 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_boxes_with_a_side_of_one_pixel_match_opencv_which_resizes_them_at_float32_positions(device, rng):
    """OpenCV resizes a source one pixel wide or high without IPP, at sample positions rounded to float32 first;
    ember does too for such boxes (per box, at runtime, in the same one kernel), and samples the others exactly."""
    img = image(rng, 50, 90)
    boxes = [(3, 7, 81, 1), (40, 2, 1, 45), (0, 0, 90, 50), (5, 5, 1, 1), (10, 20, 77, 2)]
    out = V.crop_resize(ember.tensor(img, device=device), boxes, (37, 119))
    if device == "cuda":
        assert ember.explain.plan(out).launches == 1, str(ember.explain.plan(out))
    got = out.numpy()
    for i, (bx, by, bw, bh) in enumerate(boxes):
        crop = img[by:by + bh, bx:bx + bw]
        want = cv2.resize(crop.astype(np.float32), (119, 37), interpolation=cv2.INTER_LINEAR).reshape(got[i].shape)
        np.testing.assert_allclose(got[i], want, atol=FLOAT_TOL if cv2.ipp.useIPP() else position_tol(90),
                                   err_msg=f"box {i}")
        if min(bw, bh) > 1:
            np.testing.assert_allclose(got[i], exact_resize(crop, (37, 119)), atol=FLOAT_TOL)
    row = V.resize(ember.tensor(img[:1], device=device), (1, 119)).numpy()  # a whole image one pixel high
    want = cv2.resize(img[:1].astype(np.float32), (119, 1), interpolation=cv2.INTER_LINEAR).reshape(row.shape)
    np.testing.assert_allclose(row, want, atol=FLOAT_TOL if cv2.ipp.useIPP() else position_tol(90))


@pytest.mark.parametrize(("box", "size"), [((0, 0, 126, 21), (216, 117)), ((0, 0, 60, 150), (228, 87)),
                                           ((0, 0, 78, 9), (166, 65)), ((0, 0, 138, 20), (35, 254))])
def test_keep_aspect_rounds_the_content_size_exactly_at_ties(box, size, rng):
    """Contents whose exact scaled side ends in .5 (where float arithmetic rounds either way)."""
    img = image(rng, 150, 140)
    got = V.crop_resize(ember.tensor(img), [box], size, keep_aspect="left", background=-1.0).numpy()[0]
    ch, cw = content_size(box[3], box[2], size)
    assert (got[:ch, :cw] >= 0).all() and (got[ch:] == -1).all() and (got[:, cw:] == -1).all()
