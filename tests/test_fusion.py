"""The fusion compiler: fused Triton kernels (run by Triton's interpreter in CI) against the
reference backend, and the fusion decisions themselves (how many kernels a graph becomes)."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
from conftest import ON_GPU
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiers import examples

import ember
from ember.compiler.fused import KernelKind
from ember.explain import plan

pytestmark = [pytest.mark.usefixtures("cuda_backend"), *([pytest.mark.gpu] if ON_GPU else [])]


def pair(rng, *shape, device="cuda", low=-2.0, high=2.0):
    """The same random float32 values as a cuda tensor and a cpu tensor."""
    values = rng.uniform(low, high, size=shape).astype(np.float32)
    return ember.tensor(values, device=device), ember.tensor(values)


def assert_close(fused, reference, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(fused.numpy(), reference.numpy(), rtol=rtol, atol=atol)


def kernels(*tensors) -> int:
    return plan(*tensors).launches


def test_a_chain_of_ten_pointwise_ops_is_one_kernel(rng):
    x, xc = pair(rng, 33, 65)
    y, yc = pair(rng, 65)

    def chain(a, b):
        a = (a * 1.5 + b).tanh()
        a = a.exp() - b.sigmoid()
        a = a.abs().sqrt() * b
        return (a - 0.25).relu() / (b.abs() + 1)

    out = chain(x, y)
    assert kernels(out) == 1
    assert_close(out, chain(xc, yc))


def test_softmax_and_log_softmax_are_one_kernel_each(rng):
    x, xc = pair(rng, 20, 300, low=-8, high=8)
    s = x.softmax(-1)
    assert kernels(s) == 1
    assert_close(s, xc.softmax(-1))
    ls = x.log_softmax(1)
    assert kernels(ls) == 1
    assert_close(ls, xc.log_softmax(1), atol=1e-5)


def test_layer_norm_forward_is_one_kernel(rng):
    x, xc = pair(rng, 48, 97)
    w, wc = pair(rng, 97)

    def layer_norm(a, weight):
        centred = a - a.mean(-1, keepdim=True)
        return centred / (centred.var(-1, keepdim=True, correction=0) + 1e-5).sqrt() * weight

    out = layer_norm(x, w)
    assert kernels(out) == 1
    assert_close(out, layer_norm(xc, wc), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_long_rows_are_reduced_in_a_loop(rng, monkeypatch):
    from ember.compiler import passes

    monkeypatch.setattr(passes, "SPLIT_MIN_PROGRAMS", 0)  # keep each row in one program
    x, xc = pair(rng, 3, 10000, low=-5, high=5)
    out = x.softmax(-1)
    assert kernels(out) == 1
    assert_close(out, xc.softmax(-1), atol=1e-7)
    assert_close(x.logsumexp(-1), xc.logsumexp(-1), rtol=1e-5)
    assert (x.argmax(-1).numpy() == xc.argmax(-1).numpy()).all()


def test_every_reduction_walked_in_chunks_matches_the_reference(rng, monkeypatch):
    """Rows longer than a tile are walked in chunks, each reduction keeping a partial result per position of the
    chunk and reducing them once after the loop: sums, products, extrema with NaNs, boolean any/all, integer
    sums and arg reductions, over a row whose last chunk is partly masked, against the reference backend."""
    from ember.compiler import passes
    from ember.compiler.patterns import rows

    monkeypatch.setattr(rows, "ROW_TILE", 256)  # rows longer than 256 are reduced in a loop, 128 columns a step
    monkeypatch.setattr(rows, "LOOP_CHUNK", 128)
    monkeypatch.setattr(passes, "SPLIT_MIN_PROGRAMS", 0)  # keep each row in one program
    x, xc = pair(rng, 5, 1000, low=-3, high=3)
    near_one, near_one_c = pair(rng, 5, 1000, low=0.999, high=1.001)
    values = rng.uniform(-3, 3, size=(5, 1000)).astype(np.float32)
    values[1, 517] = values[3, 999] = np.nan
    nan, nan_c = ember.tensor(values, device="cuda"), ember.tensor(values)
    counts = rng.integers(-9, 9, size=(5, 1000))
    ints, ints_c = ember.tensor(counts, device="cuda"), ember.tensor(counts)
    for name, fn in [("sum", lambda a, *_: a.sum(-1)), ("prod", lambda _, b, *__: b.prod(-1)),
                     ("amax", lambda a, *_: a.amax(-1)), ("amin", lambda a, *_: a.amin(-1)),
                     ("amax with NaN", lambda *args: args[2].amax(-1)),
                     ("amin with NaN", lambda *args: args[2].amin(-1)),
                     ("any", lambda a, *_: (a > 2.99).any(-1)), ("all", lambda a, *_: (a > -2.99).all(-1)),
                     ("integer sum", lambda *args: args[3].sum(-1)), ("argmax", lambda a, *_: a.argmax(-1)),
                     ("argmin", lambda a, *_: a.argmin(-1)), ("variance", lambda a, *_: a.var(-1)),
                     ("log_softmax", lambda a, *_: a.log_softmax(-1)), ("softmax", lambda a, *_: a.softmax(-1)),
                     ("logsumexp", lambda a, *_: a.logsumexp(-1)),
                     ("softmax with NaN", lambda *args: args[2].softmax(-1))]:
        fused, reference = fn(x, near_one, nan, ints), fn(xc, near_one_c, nan_c, ints_c)
        assert all(k.rows == 5 for k in plan(fused).kernels), name
        np.testing.assert_allclose(fused.numpy(), reference.numpy(), rtol=2e-5, atol=1e-5, err_msg=name)
    # softmax's max and sum of exponentials in one pass over the row (then the output's pass): rows with infinities
    # and a row of -inf, as the reference computes them in two passes
    values[0, :] = -np.inf
    values[1, 3], values[2, 700], values[2, 10] = np.inf, -np.inf, 50.0
    values[3, :500] = -np.inf
    special, special_c = ember.tensor(values, device="cuda"), ember.tensor(values)
    walked = plan(special.softmax(-1))
    loops = [walked.sources[id(k)].text.count("for start in range") for k in walked.kernels]
    assert loops == [2], loops
    for name, fn in [("softmax", lambda a: a.softmax(-1)), ("log_softmax", lambda a: a.log_softmax(-1))]:
        np.testing.assert_allclose(fn(special).numpy(), fn(special_c).numpy(), rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_few_long_reductions_are_split_across_programs(rng):
    x, xc = pair(rng, 3, 100_000, low=-5, high=5)
    total = x.sum(-1)
    p = plan(total)
    assert p.kernels[0].rows >= 3 * 64  # many partial sums per output, in parallel
    assert_close(total, xc.sum(-1), rtol=1e-5, atol=1e-3)
    column, column_c = pair(rng, 100_000, 5)
    assert_close(column.amax(0), column_c.amax(0))
    wide, wide_c = pair(rng, 4096, 256)  # a bias gradient: a short column reduction into few programs
    assert len(plan(wide.sum(0)).kernels) == 2
    assert_close(wide.sum(0), wide_c.sum(0), rtol=1e-5, atol=1e-4)
    assert_close(x.softmax(-1), xc.softmax(-1), atol=1e-7)


@pytest.mark.parametrize(("shape", "dims"), [((2**10, 16), (0, 1)), ((4, 256, 16), (0, 1)),
                                           ((16, 32, 8), (1, 2)), ((3, 2**9, 7, 1), (1, 2, 3))])
def test_a_long_reduction_over_several_adjacent_axes_is_split_across_programs(rng, monkeypatch, shape, dims):
    """A loss over every element (a mean over batch and features) reads millions of elements into one
    output: it is spread over many programs like a reduction along one long axis. (The thresholds are
    scaled down here, so that the interpreter runs thousands of elements, not millions.)"""
    from ember.compiler import passes

    for name, value in (("SPLIT_MIN_PROGRAMS", 64), ("SPLIT_MIN_LENGTH", 128), ("SPLIT_MIN_ELEMENTS", 1 << 12)):
        monkeypatch.setattr(passes, name, value)
    x, xc = pair(rng, *shape)
    total = (x * x).mean(dims)
    p = plan(total)
    assert len(p.kernels) >= 2 and p.kernels[0].rows >= 64, str(p)  # partial results first, in parallel
    assert_close(total, (xc * xc).mean(dims), rtol=1e-4, atol=1e-6)  # float32 sums in another order
    assert_close(x.amax(dims), xc.amax(dims))


def test_a_norms_weight_gradient_reads_each_input_once_and_its_row_statistics_once_per_row(rng, monkeypatch):
    """A layer norm's weight and bias gradients sum x̂·dy and dy down the rows: a split column sum whose programs
    each hold a block of columns inside one part of the rows. Each row's mean and variance vary along the rows
    only, so they are loaded (and the inverse deviation computed) once per row of a chunk, not per element, and
    dy, read by both sums through the same reshape, is loaded once. (Thresholds scaled down, as above.)"""
    from ember.compiler import passes

    for name, value in (("SPLIT_MIN_PROGRAMS", 64), ("SPLIT_MIN_LENGTH", 128), ("SPLIT_MIN_ELEMENTS", 1 << 12)):
        monkeypatch.setattr(passes, name, value)
    x, xc = pair(rng, 512, 512)
    dy, dyc = pair(rng, 512, 512)
    w, wc = pair(rng, 512)
    b, bc = pair(rng, 512)
    grads = []
    for inputs in ((x, dy, w, b), (xc, dyc, wc, bc)):
        xi, dyi, *params = (t.detach().requires_grad_() for t in inputs)
        out = ember.nn.functional.layer_norm(xi, (512,), *params)
        grads.append(ember.grad(out, params, dyi.detach()))
    p = plan(*grads[0])
    # the partial sums: over the middle axis of (parts, rows per part, 512)
    column_sums = [p.sources[id(k)].text for k in p.kernels if k.axes == (1,) and len(k.space) == 3]
    assert len(column_sums) == 1, str(p)
    (text,) = column_sums
    assert text.count("tl.load(") == 4, text  # x, dy, and the two row statistics
    assert text.count("mask=cmask") == 2, text  # the statistics: one value per row of the chunk
    for fused, reference in zip(*grads):
        assert_close(fused, reference, rtol=1e-4, atol=1e-4)


def test_a_row_kernels_loads_are_issued_before_its_reductions(rng):
    """A layer norm's forward and backward in one row kernel: x, dy, the weight and the bias are loaded before the
    first row sum, so their loads are in flight together rather than each after the reductions before it."""
    x, xc = pair(rng, 6, 40)
    dy, dyc = pair(rng, 6, 40)
    w, wc = pair(rng, 40)
    b, bc = pair(rng, 40)
    results = []
    for inputs in ((x, dy, w, b), (xc, dyc, wc, bc)):
        xi, dyi, wi, bi = (t.detach().requires_grad_() for t in inputs)
        out = ember.nn.functional.layer_norm(xi, (40,), wi, bi)
        results.append((out, *ember.grad(out, [xi], dyi.detach())))
    rows = [s.text for s in plan(*results[0]).sources.values() if "tl.sum(" in s.text]
    assert rows
    for text in rows:
        body = text[text.index("@triton.jit"):]
        assert body.rindex("tl.load(") < body.index("tl.sum("), text
    for fused, reference in zip(*results):
        assert_close(fused, reference, rtol=1e-4, atol=1e-5)


def test_a_row_sum_of_a_product_with_a_per_row_factor_is_the_factor_times_the_sum(rng):
    """Σ(c·y) over a row, c one value per row, is taken as c·Σy: the sum then reads no other row sum's result, so a
    layer norm's forward and backward in one row kernel make two passes of row sums (the mean; then the variance
    and the gradient's sums), not three."""
    x, xc = pair(rng, 6, 40)
    dy, dyc = pair(rng, 6, 40)
    results = []
    for xi, dyi in ((x, dy), (xc, dyc)):
        xi = xi.detach().requires_grad_()
        out = ember.nn.functional.layer_norm(xi, (40,))
        results.append((out, *ember.grad(out, [xi], dyi)))
    (row,) = plan(*results[0]).kernels
    inside, sums = {id(n) for n in row.covers}, {id(r): r for r in row.reductions}

    def depth(node) -> int:  # row sums in a chain through the kernel's nodes, this one included
        return (id(node) in sums) + max([depth(i) for i in node.inputs if id(i) in inside or id(i) in sums] + [0])

    assert max(depth(r) for r in row.reductions) == 2
    for fused, reference in zip(*results):
        assert_close(fused, reference, rtol=1e-4, atol=1e-5)


def test_a_division_by_a_literal_power_of_two_is_a_multiplication(rng):
    """A norm's division by its row length, a power of two fixed by the expansion, is the product with its
    reciprocal (the same number: scaling by a power of two is exact), so no division's instructions run per row."""
    values = rng.uniform(-3, 3, size=(5, 8)).astype(np.float32)
    values[0] *= np.float32(2.0**-120)  # statistics near float32's smallest normal
    values[1] *= np.float32(2.0**60)
    x, xc = ember.tensor(values, device="cuda"), ember.tensor(values)
    out = ember.nn.functional.layer_norm(x, (8,))
    (text,) = [s.text for s in plan(out).sources.values()]
    assert "* 0.125" in text and "div_rn(v" not in text, text  # 1 / std stays div_rn(1.0, ...)
    assert_close(out, ember.nn.functional.layer_norm(xc, (8,)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(6, 5, 4, 3), (1, 5, 4, 3), (6, 1, 4, 3), (6, 5, 1, 1), (6, 5, 1, 3), (6, 5, 0, 3)])
def test_reductions_over_axes_that_kept_axes_interleave_run_in_two_stages(rng, shape):
    x, xc = pair(rng, *shape)
    n, c, h, w = shape
    if n > 1 and c > 1 and h * w > 1:  # batch norm's statistics: N, H, W reduced, C kept
        first, second = plan(x.sum((0, 2, 3))).kernels  # contiguous rows first, then across them
        assert set(first.axes) == {a for a in (2, 3) if shape[a] > 1} and second.axes == (0,)
    for dims in ((0, 2, 3), (0, 3), (0, 2)):
        assert_close(x.sum(dims), xc.sum(dims), rtol=1e-5, atol=1e-5)
        assert_close(x.mean(dims, keepdim=True), xc.mean(dims, keepdim=True), rtol=1e-5, atol=1e-6)
        if 0 not in shape:
            assert_close(x.amax(dims), xc.amax(dims))
            assert_close(x.amin(dims, keepdim=True), xc.amin(dims, keepdim=True))
    half, half_c = x.to(ember.bfloat16) * 1.1, xc.to(ember.bfloat16) * 1.1  # partial sums in float32, rounded once
    np.testing.assert_array_equal(half.sum((0, 2, 3)).numpy(), half_c.sum((0, 2, 3)).numpy())


class _ResidualBlock(ember.nn.Module):
    """A strided convolution, batch norm, ReLU, a grouped convolution and a 1x1-convolution shortcut."""

    def __init__(self, dtype):
        super().__init__()
        nn, kw = ember.nn, dict(dtype=dtype)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, 2, 1, bias=False, **kw), nn.BatchNorm2d(8, **kw)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, 1, 1, groups=2, **kw), nn.BatchNorm2d(8, **kw)
        self.shortcut, self.head = nn.Conv2d(3, 8, 1, 2, bias=False, **kw), nn.Linear(8, 5, **kw)

    def forward(self, x):
        F = ember.nn.functional
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _trained_on_each_device(net, images: np.ndarray) -> tuple[dict, object]:
    """A training step's loss and gradients of `net` (bfloat16 images) on the cuda device and on the cpu's
    reference, and the cuda step's plan."""
    labels = np.array([0, 1, 2, 4])
    results = {}
    for device in ("cuda", "cpu"):
        net.to(device)
        x = ember.tensor(images, device=device).to(ember.bfloat16)
        loss = ember.nn.functional.cross_entropy(net(x).float(), ember.tensor(labels, device=device))
        results[device] = (loss, *ember.grad(loss, list(net.parameters())))
    return results, plan(*results["cuda"])


def _read_transposed(p) -> list:
    """The nodes of plan `p` that read a permuted value of 4 axes or more."""
    permutes = {id(n) for n in p.lowered.nodes if n.op is ember.ir.Op.PERMUTE and len(n.shape) >= 4}
    return [n for n in p.lowered.nodes if any(id(i) in permutes for i in n.inputs)]


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last", "the module's channels_last"])
def test_convolutions_in_either_memory_format_train_as_the_reference(rng, memory_format):
    with ember.conv_memory_format(memory_format if memory_format == "channels_last" else "contiguous"):
        ember.manual_seed(0)
        net = _ResidualBlock(ember.bfloat16)
        if memory_format.startswith("the module's"):  # as PyTorch users write it; the process setting stays
            net.to(memory_format=ember.channels_last)
            memory_format = "channels_last"
        results, p = _trained_on_each_device(net, rng.standard_normal((4, 3, 9, 9)).astype(np.float32))
    convolutions = [k.cores[0] for k in p.kernels if k.kind.value == "conv2d"]
    assert len(convolutions) == 7  # conv1, conv2, the shortcut; two input gradients; three weight gradients
    assert all(bool(c.attrs.get("channels_last")) == (memory_format == "channels_last") for c in convolutions)
    if memory_format == "channels_last":  # nothing is read transposed but the input, by the convolutions
        readers = _read_transposed(p)
        assert readers and all(n.op.name.startswith("CONV2D") for n in readers), [n.op for n in readers]
    for fused, reference in zip(*results.values()):
        np.testing.assert_allclose(fused.float().numpy(), reference.float().numpy(), rtol=2e-2, atol=1e-3)


def _sgd_steps(device: str, images: np.ndarray) -> list:
    """Three SGD-with-momentum steps of two channels-last bfloat16 1x1 convolutions on `device`: the losses and
    the parameters after."""
    ember.manual_seed(0)
    nn = ember.nn
    with ember.conv_memory_format("channels_last"):
        net = nn.Sequential(nn.Conv2d(3, 8, 1, bias=False), nn.ReLU(), nn.Conv2d(8, 3, 1, bias=False))
        net = net.to(device).to(ember.bfloat16)
        opt = ember.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        x = ember.tensor(images, device=device).to(ember.bfloat16)
        losses = []
        for _ in range(3):
            loss = net(x).float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
    return [np.array(losses), *(p.float().numpy() for p in net.parameters())]


def test_an_optimizer_step_of_channels_last_convolutions_trains_as_the_reference(rng):
    """A weight's update reads its gradient (a channels-last weight gradient) transposed back and reshaped; the
    forward's transposed copy of the same weight is a kernel of the same size, so the two merge. The merged
    kernel still waits for the weight gradient (it read it through its own stored output, which the planner once
    missed and launched it before the gradient existed)."""
    images = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    for got, expected in zip(_sgd_steps("cuda", images), _sgd_steps("cpu", images)):
        np.testing.assert_allclose(got, expected, rtol=3e-2, atol=3e-3)


@pytest.mark.skipif("EMBER_CONV_MEMORY_FORMAT" in os.environ, reason="the environment sets another default")
def test_half_precision_convolutions_run_channels_last_by_default_and_float32_ones_on_nchw(rng):
    """ember's default layout: cuDNN's half-precision kernels run on (N, H, W, C) memory, so float16 and bfloat16
    convolutions (and what lies between them) run there; float32 ones stay where the user's values are. Values
    are the reference's either way."""
    images = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    for dtype, tolerance in ((ember.bfloat16, 2e-2), (ember.float16, 4e-3), (ember.float32, 1e-5)):
        ember.manual_seed(0)
        conv = ember.nn.Conv2d(3, 4, 3, padding=1, dtype=dtype)
        results = {}
        for device in ("cuda", "cpu"):
            conv.to(device)
            results[device] = (conv(ember.tensor(images, device=device).to(dtype)) * 1.7).relu()
        laid_out = [bool(k.cores[0].attrs.get("channels_last")) for k in plan(results["cuda"]).kernels
                    if k.kind.value == "conv2d"]
        assert laid_out == [dtype is not ember.float32], dtype
        np.testing.assert_allclose(results["cuda"].float().numpy(), results["cpu"].float().numpy(),
                                   rtol=tolerance, atol=tolerance)


def test_a_convolution_keeps_the_memory_format_set_when_it_was_called_and_a_modules_own_overrides_it(rng):
    """ember is lazy: a convolution's plan is made when a value is read, after the `with` block that chose its
    layout has ended; it runs in the layout asked for at the call. A module's memory format (torch's way to ask
    for one) overrides the setting either way, so `contiguous_format` opts one module out of channels-last."""
    images = ember.tensor(rng.standard_normal((2, 3, 6, 5)).astype(np.float32), device="cuda").bfloat16()

    def laid_out(out) -> list[bool]:
        return [bool(k.cores[0].attrs.get("channels_last")) for k in plan(out).kernels if k.kind.value == "conv2d"]
    conv = ember.nn.Conv2d(3, 4, 3, padding=1, dtype=ember.bfloat16, device="cuda")
    with ember.conv_memory_format("contiguous"):
        nchw = conv(images)
    with ember.conv_memory_format("channels_last"):
        nhwc = conv(images)
        assert laid_out(nchw) == [False] and laid_out(nhwc) == [True]
        conv.to(memory_format=ember.contiguous_format)
        assert laid_out(conv(images)) == [False]
    with ember.conv_memory_format("contiguous"):
        conv.to(memory_format=ember.channels_last)
        assert laid_out(conv(images)) == [True]
    np.testing.assert_allclose(nchw.float().numpy(), nhwc.float().numpy(), rtol=1e-2, atol=1e-2)


class _Stem(ember.nn.Module):
    """A ResNet's stem in miniature: convolution, batch norm, ReLU, a 3x3 max-pooling of stride 2, then one more
    convolution, pooled and classified."""

    def __init__(self, dtype):
        super().__init__()
        nn, kw = ember.nn, dict(dtype=dtype)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False, **kw), nn.BatchNorm2d(8, **kw)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False, **kw), nn.BatchNorm2d(8, **kw)
        self.head = nn.Linear(8, 5, **kw)

    def forward(self, x):
        F = ember.nn.functional
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        h = F.relu(self.bn2(self.conv2(h)))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def test_a_max_pooling_between_channels_last_convolutions_runs_on_their_memory_forward_and_backward(rng):
    """The max-pooling's windows (pads and strided slices) and its gradient (the output gradient repeated by
    stride phase: pads, reshapes, broadcasts, slices) sink through the channels-last layout as pointwise ops do:
    no kernel reads a value transposed but the convolutions their input."""
    with ember.conv_memory_format("channels_last"):
        ember.manual_seed(0)
        results, p = _trained_on_each_device(_Stem(ember.bfloat16),
                                             rng.standard_normal((4, 3, 10, 10)).astype(np.float32))
    readers = _read_transposed(p)
    assert readers and all(n.op.name.startswith("CONV2D") for n in readers), [n.op for n in readers]
    for fused, reference in zip(*results.values()):
        np.testing.assert_allclose(fused.float().numpy(), reference.float().numpy(), rtol=2e-2, atol=2e-3)


class _Convolutions(ember.nn.Module):
    """Stride-1 convolutions of every form whose input gradient is a forward convolution (3x3, 1x1, dilated, a
    3x1 window without padding), and a strided and a grouped one, whose input gradients are not."""

    def __init__(self, dtype):
        super().__init__()
        nn, kw = ember.nn, dict(dtype=dtype)
        self.layers = nn.ModuleList([
            nn.Conv2d(3, 8, 3, 1, 1, **kw), nn.Conv2d(8, 8, 3, 1, 1, bias=False, **kw), nn.Conv2d(8, 6, 1, **kw),
            nn.Conv2d(6, 8, 3, 1, 2, dilation=2, **kw), nn.Conv2d(8, 8, (3, 1), **kw),
            nn.Conv2d(8, 8, 3, 2, 1, **kw), nn.Conv2d(8, 8, 3, 1, 1, groups=2, **kw)])
        self.head = nn.Linear(8, 5, **kw)

    def forward(self, x):
        F = ember.nn.functional
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_channels_last_convolutions_read_their_operands_as_cudnn_lays_them_out_and_input_gradients_run_forward(rng):
    """On channels-last memory every convolution's operands are stored as cuDNN's channels-last kernels read them
    (the network's input and each weight transposed by the plan's own kernels, so cuDNN transposes nothing),
    and a stride-1 convolution's input gradient is a forward convolution of the output gradient by the swapped,
    flipped weight: values and gradients are the reference's."""
    with ember.conv_memory_format("channels_last"):
        ember.manual_seed(0)
        results, p = _trained_on_each_device(_Convolutions(ember.bfloat16),
                                             rng.standard_normal((4, 3, 11, 9)).astype(np.float32))
    cores = [k.cores[0] for k in p.kernels if k.kind.value == "conv2d"]
    Op = ember.ir.Op
    # 7 forwards and 7 weight gradients; the input gradients of the 6 convolutions after the first: the strided
    # and the grouped ones backward-data calls, the other 4 forward convolutions
    assert sorted(c.op.name for c in cores) == ["CONV2D"] * 11 + ["CONV2D_INPUT_GRAD"] * 2 + ["CONV2D_WEIGHT_GRAD"] * 7
    assert all(c.attrs["channels_last"] for c in cores)
    assert all(i.op is not Op.PERMUTE or id(i) in p.stored for c in cores for i in c.inputs)
    assert sum(1 for n in p.lowered.nodes if n.op is Op.FLIP) == 3  # 1x1 windows are not flipped
    for fused, reference in zip(*results.values()):
        np.testing.assert_allclose(fused.float().numpy(), reference.float().numpy(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_a_per_channel_value_under_a_pooling_padded_windows_is_computed_once_not_per_window(rng, channels_last):
    """A max-pooling's nine padded windows each read the activation before it at other positions, but a value
    broadcast along those positions (a batch norm's per-channel factor) is the same for all nine: the kernel
    computes it once (its loads do not take the windows' bound checks), and the pooling's values are the
    reference's, padding included."""
    values = rng.uniform(-2, 2, (2, 3, 9, 8)).astype(np.float32)
    scales = rng.uniform(-1, 1, (3,)).astype(np.float32)
    results = {}
    for device in ("cuda", "cpu"):
        x, scale = ember.tensor(values, device=device), ember.tensor(scales, device=device)
        if channels_last:
            x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        h = (x * (scale.exp() / 7).reshape(1, 3, 1, 1) - 0.1).relu()
        results[device] = ember.nn.functional.max_pool2d(h, 3, 2, 1)
    p = plan(results["cuda"])
    (kernel,) = [k for k in p.kernels if k.kind is KernelKind.POINTWISE and len(k.space) == 4]
    assert p.sources[id(kernel)].text.split("@triton.jit")[1].count("exp(") == 1
    assert_close(results["cuda"], results["cpu"])


def batch_norm_gradients(x, device):
    weight = ember.tensor(np.linspace(0.5, 1.5, x.shape[1], dtype=np.float32), device=device).requires_grad_()
    bias = ember.tensor(np.linspace(-0.3, 0.3, x.shape[1], dtype=np.float32), device=device).requires_grad_()
    x = x.requires_grad_()
    y = ember.nn.functional.batch_norm(x, None, None, weight, bias, training=True)
    ((y * y).sum() + y.sum()).backward()
    return y, x.grad, weight.grad, bias.grad


def test_a_batch_norms_per_channel_factors_over_a_large_activation_are_computed_once_and_loaded():
    """A batch norm's per-channel factors (a mean's division, the inverse of a standard deviation) broadcast over
    an activation of millions of elements would be recomputed for each element by a flat kernel over it: at the
    GPU's costs the planner stores them instead, in the epilogue of the reduction they read, and the kernels over
    the activation load them (planned at full size, not run). Over a small activation they are recomputed."""
    x = ember.randn(32, 64, 64, 64, device="cuda")
    p = plan(*batch_norm_gradients(x, "cuda")[:2])
    large = [k for k in p.kernels if k.kind is KernelKind.POINTWISE and math.prod(k.space) == x.numel()]
    assert large
    for kernel in large:
        assert "sqrt" not in p.sources[id(kernel)].text.split("@triton.jit")[1]
    assert "reciprocal [1, 64, 1, 1] float32, broadcast to 8,388,608 elements, stored" in str(p)
    small = plan(*batch_norm_gradients(ember.randn(2, 64, 8, 8, device="cuda"), "cuda")[:2])
    assert "broadcast to" not in str(small)  # recomputing costs less than a launch


def test_values_stored_before_their_broadcast_match_the_reference(rng, monkeypatch):
    """With launches free, every value the planner can store before a broadcast is stored: a batch norm's
    forward and backward, and a per-row factor, still match the reference, in both memory layouts."""
    from ember.compiler import targets
    triton_target = targets.TARGETS["triton"]
    monkeypatch.setitem(targets.TARGETS, "triton", dataclasses.replace(
        triton_target, costs=dataclasses.replace(triton_target.costs, launch_seconds=0.0)))
    values = rng.uniform(-2, 2, (3, 5, 7, 6)).astype(np.float32)
    results = {}
    for device in ("cuda", "cpu"):
        x = ember.tensor(values, device=device)
        x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) if device == "cuda" else x
        rows = ember.tensor(values.reshape(15, 42), device=device)
        scaled = rows / (rows.abs().sum(1, keepdim=True) + 1).sqrt()
        results[device] = (*batch_norm_gradients(x, device), scaled)
    assert "stored: recomputing" in str(plan(*results["cuda"]))
    for fused, reference in zip(results["cuda"], results["cpu"], strict=True):
        assert_close(fused, reference, rtol=2e-5, atol=2e-5)


def test_reductions_over_leading_and_middle_axes(rng):
    x, xc = pair(rng, 6, 7, 8)
    for dims in ((0,), (1,), (0, 2), (0, 1, 2)):
        assert_close(x.sum(dims), xc.sum(dims), rtol=1e-5, atol=1e-5)
        assert_close(x.amax(dims, keepdim=True), xc.amax(dims, keepdim=True))
    assert_close(x.prod(1), xc.prod(1), rtol=1e-5)
    assert (x.argmin(1).numpy() == xc.argmin(1).numpy()).all()


def test_cross_entropy_forward_and_backward_match_reference(rng):
    logits, logits_c = pair(rng, 32, 50, low=-4, high=4)
    target = rng.integers(0, 50, size=32)
    results = []
    for x, device in ((logits, "cuda"), (logits_c, "cpu")):
        x = x.detach().requires_grad_()
        t = ember.tensor(target, device=device)
        loss = -(x.log_softmax(-1).gather(1, t.reshape(-1, 1))).mean()
        loss.backward()
        results.append((loss, x.grad))
    assert_close(results[0][0], results[1][0])
    assert_close(results[0][1], results[1][1], atol=1e-7)


def test_cross_entropys_backward_as_torch_decomposes_it_sums_nothing_over_the_classes(rng):
    """torch's nll_loss backward scatters -1 into zeros at the targets (aten.scatter.value), and log_softmax's
    backward sums that over the classes: the scatter is a select, and the sum of a select of a number is the
    number where the target is valid, so the gradient is one pointwise pass over the logits."""
    torch = pytest.importorskip("torch")
    from ember.frontends.aten_graph import lookup

    logits, logits_c = pair(rng, 32, 500, low=-4, high=4)
    target = rng.integers(0, 500, size=(32, 1))
    weight = rng.uniform(0.5, 1.5, size=(32, 1)).astype(np.float32)
    grads = []
    for x, device in ((logits, "cuda"), (logits_c, "cpu")):
        zeros = ember.zeros((32, 500), device=device)
        picked = lookup(torch.ops.aten.scatter.value)(zeros, 1, ember.tensor(target, device=device), -1.0)
        g = picked * ember.tensor(weight, device=device)
        out = x.log_softmax(-1)
        grads.append(g - out.exp() * g.sum(1, keepdim=True))
    reductions = [len(k.reductions) for k in plan(grads[0]).kernels if k.kind is KernelKind.REDUCE]
    assert reductions == [2], str(plan(grads[0]))  # the log-softmax's own max and sum only
    assert_close(*grads, atol=1e-6)


def test_views_fold_into_index_arithmetic(rng):
    x, xc = pair(rng, 5, 6, 7)

    def views(a):
        b = a.permute(2, 0, 1)[::2, 1:, ::-1]
        c = ember.pad(b, (1, 2, 0, 1), value=0.5)
        r = c.flip(0).reshape(-1, c.shape[-1]).T
        return r * 2 + a.sum(2).reshape(-1)[: r.shape[-1]]

    out = views(x)
    assert kernels(out) == 2  # the sum, then one kernel for every view and the arithmetic
    assert_close(out, views(xc), rtol=1e-5, atol=1e-5)


def test_gather_and_integer_indexing_fuse_with_pointwise_neighbours(rng):
    table, table_c = pair(rng, 40, 8)
    idx = rng.integers(0, 40, size=(6, 5))
    out = (table.exp()[ember.tensor(idx, device="cuda")] * 2).sum(-1)
    ref = (table_c.exp()[ember.tensor(idx)] * 2).sum(-1)
    assert kernels(out) == 1
    assert_close(out, ref, rtol=1e-5)


def test_scatter_add_matches_reference(rng):
    src, src_c = pair(rng, 12, 4)
    idx = rng.integers(0, 5, size=(12, 4))
    base, base_c = pair(rng, 5, 4)
    out = base.scatter_add(0, ember.tensor(idx, device="cuda"), src)
    ref = base_c.scatter_add(0, ember.tensor(idx), src_c)
    assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_random_numbers_match_the_reference_generator():
    ember.manual_seed(7)
    a = ember.rand(1000, device="cuda") + ember.randn(1000, device="cuda")
    ember.manual_seed(7)
    b = ember.rand(1000) + ember.randn(1000)
    assert_close(a, b, atol=1e-6)


@pytest.mark.parametrize("start", [2**31 - 300, 2**32 - 300])
def test_random_numbers_past_2_to_the_31_match_the_reference_generator(start):
    """A draw's offsets cross 2^31 and 2^32: the kernel reads its offset as 64 bits from device memory and
    counts on with Philox's second counter word, as the reference does."""
    from ember.ops import random

    values = []
    for device in ("cuda", "cpu"):
        ember.manual_seed(11)
        random._state.offset = start
        values.append((ember.rand(1000, device=device), ember.randn(1000, device=device)))
    for a, b in zip(*values):
        assert_close(a, b, atol=1e-6)


@pytest.mark.parametrize("seed", [2**63 + 5, 2**64 - 1, -1])
def test_seeds_are_taken_modulo_2_to_the_64_as_the_reference_takes_them(seed):
    values = []
    for device in ("cuda", "cpu"):
        ember.manual_seed(seed)
        values.append(ember.rand(50, device=device))
    assert_close(*values, atol=1e-6)


def test_dropout_mask_is_recomputed_not_stored(rng):
    x, _ = pair(rng, 64, 64)
    x.requires_grad_()
    y = ember.dropout(x, 0.5)
    y.sum().backward()
    grad = x.grad.numpy()
    kept = y.numpy() != 0
    np.testing.assert_allclose(grad[kept], 2.0)
    assert (grad[~kept] == 0).all()


def test_optimizer_update_over_fifty_parameters_is_at_most_three_launches(rng):
    shapes = [(rng.integers(1, 40), rng.integers(1, 40)) for _ in range(50)]
    params = [pair(rng, *s)[0] for s in shapes]
    grads = [pair(rng, *s)[0] for s in shapes]
    ms = [pair(rng, *s)[0] for s in shapes]
    vs = [pair(rng, *s, low=0, high=1)[0] for s in shapes]
    lr, b1, b2, eps, step = 1e-3, 0.9, 0.999, 1e-8, 3
    new = []
    for p, g, m, v in zip(params, grads, ms, vs):
        m2 = m * b1 + g * (1 - b1)
        v2 = v * b2 + g * g * (1 - b2)
        p2 = p - lr * (m2 / (1 - b1**step)) / ((v2 / (1 - b2**step)).sqrt() + eps)
        new += [p2, m2, v2]
    assert kernels(*new) <= 3
    expected = [t.to("cpu").numpy() for t in new]
    ember.realize(*new)
    for t, e in zip(new, expected):
        np.testing.assert_allclose(t.numpy(), e, rtol=1e-5, atol=1e-7)


def test_the_kernel_graph_kept_while_merging_is_the_graph_made_afresh(rng, monkeypatch):
    """Merging keeps each kernel's dependencies and a height above them current instead of recomputing them for
    every pair it tries: after each merge they equal the graph recomputed from the kernels left, and the pruned
    cycle test answers as the full search does, on a training step with many kernels over equal spaces."""
    from ember.compiler.kernel_graph import KernelGraph, closes_cycle

    checked = []
    absorb, acyclic = KernelGraph.absorb, KernelGraph.acyclic

    def checked_absorb(graph, target, k):
        absorb(graph, target, k)
        kernels = [k2 for k2 in graph.kernels if k2 is not k]
        graph.kernels = kernels
        fresh = KernelGraph(graph.planner, kernels)
        assert graph.deps == fresh.deps and graph.refs.keys() == fresh.refs.keys()
        assert all(graph.height[k2] > graph.height[d] for k2, waited in graph.deps.items() for d in waited)
        checked.append(1)

    def checked_acyclic(graph, a, b):
        answer = acyclic(graph, a, b)
        assert answer == (not closes_cycle(graph.deps, [a, b]))
        return answer

    def tracking_init(graph, planner, kernels):
        init(graph, planner, kernels)
        graph.kernels = list(kernels)

    init = KernelGraph.__init__
    monkeypatch.setattr(KernelGraph, "__init__", tracking_init)
    monkeypatch.setattr(KernelGraph, "absorb", checked_absorb)
    monkeypatch.setattr(KernelGraph, "acyclic", checked_acyclic)
    nn = ember.nn
    model = nn.Sequential(*[layer for _ in range(3) for layer in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
                                                                    nn.ReLU())]).to("cuda")
    optimizer = ember.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, _ = pair(rng, 2, 4, 6, 6)
    loss = model(x).square().mean()
    loss.backward()
    with ember.explain.capture():
        optimizer.step()
    assert checked


@pytest.mark.parametrize("cap", [40, 100])
def test_independent_kernels_join_only_up_to_the_kernel_size_cap(rng, monkeypatch, cap):
    """Updates of many parameters of one shape merge into one kernel, and independent kernels share a segmented
    launch, only while the joined kernel computes at most MAX_KERNEL_OPS nodes (a far bigger one takes long to
    compile); the values are the reference's either way."""
    from ember.compiler import planner

    monkeypatch.setattr(planner, "MAX_KERNEL_OPS", cap)
    params = [pair(rng, 7, 5) for _ in range(12)] + [pair(rng, 3 + k) for k in range(6)]
    grads = [pair(rng, *p.shape) for p, _ in params]
    new, expected = [], []
    for (p, pc), (g, gc) in zip(params, grads):
        update = lambda a, b: a - 0.1 * (b * 0.9 + a.tanh() * 0.01).clamp(-1, 1)  # noqa: E731
        new.append(update(p, g))
        expected.append(update(pc, gc))
    fused = plan(*new)
    for k in fused.kernels:
        parts = k.segments or [k]
        assert sum(len(part.covers) for part in parts) <= cap or len(parts) == 1
        assert all(len(part.covers) <= cap or len(part.outputs) == 1 for part in parts)
    merged = max(len(part.outputs) for k in fused.kernels for part in (k.segments or [k]))
    assert merged > 1  # merging still happens below the cap
    ember.realize(*new)
    for t, e in zip(new, expected):
        assert_close(t, e)


def test_unrelated_updates_merge_only_while_light(rng):
    """Updates of parameters of one shape that share no loads merge while the merged kernel computes at most
    POINTWISE_HEAVY nodes at each element: beyond that its programs would take a quarter of the elements, and
    every parameter's loads would move a quarter of the bytes. The values are the reference's."""
    from ember.compiler.fused import POINTWISE_HEAVY, element_nodes

    params = [pair(rng, 24, 40) for _ in range(12)]
    grads = [pair(rng, 24, 40) for _ in range(12)]
    lr = pair(rng, 1, low=0.01, high=0.1)  # one value every update reads: no shared load

    def update(p, g, lr):
        m = g * 0.9 + p.tanh() * 0.01
        return p - lr * (m / (m.abs() + 0.3)).clamp(-1, 1) + (p * 0.01).sin()

    new = [update(p, g, lr[0]) for (p, _), (g, _) in zip(params, grads)]
    expected = [update(pc, gc, lr[1]) for (_, pc), (_, gc) in zip(params, grads)]
    parts = [part for k in plan(*new).kernels for part in (k.segments or [k])]
    merged = [part for part in parts if len(part.outputs) > 1]
    assert merged, "light updates still merge"
    assert all(element_nodes(part.covers) <= POINTWISE_HEAVY for part in merged)
    assert len(parts) > 1  # not all twelve in one kernel
    ember.realize(*new)
    for t, e in zip(new, expected):
        assert_close(t, e, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_segmented_launch_gives_its_heavy_segments_smaller_blocks_than_the_rest(rng):
    """A segmented launch joining a heavy kernel (many nodes at each element) with a light one over many
    elements: the heavy segment's programs take fewer elements (BLOCK_HEAVY), the light one's the full block;
    both compute the reference's values."""
    from ember.compiler.fused import POINTWISE_HEAVY, element_nodes

    x, xc = pair(rng, 37)
    big, bigc = pair(rng, 600, 1000)  # enough elements that the light segment's blocks do not shrink

    def heavy(t):
        for k in range(POINTWISE_HEAVY // 3 + 2):
            t = (t * (0.9 + 0.01 * k)).tanh() + 0.1
        return t

    outs, expected = [heavy(x), big * 0.5 + 1.0], [heavy(xc), bigc * 0.5 + 1.0]
    p = plan(*outs)
    (launch,) = [k for k in p.kernels if k.kind is KernelKind.SEGMENTED]
    assert sorted(element_nodes(part.covers) > POINTWISE_HEAVY for part in launch.segments) == [False, True]
    assert "BLOCK 1024x256" in str(p)
    ember.realize(*outs)
    for t, e in zip(outs, expected):
        assert_close(t, e, rtol=1e-5, atol=1e-5)


def test_an_adam_step_keeps_each_parameters_update_whole_and_apart_from_the_others(rng):
    """Adam's update of one parameter is pieces that feed one another (its moments, then the parameter); pieces
    that share loads join first, so a parameter's update is one kernel, and updates of different parameters of
    one size (even of transposed shapes) join only while light: no kernel computing more than POINTWISE_HEAVY
    nodes an element updates more than one parameter. The parameters are the reference's."""
    from ember.compiler.fused import POINTWISE_HEAVY, element_nodes

    shapes = [(24, 40), (40, 24)] * 4 + [(40,)] * 4
    values = [rng.uniform(-1, 1, size=s).astype(np.float32) for s in shapes]
    grads = [rng.uniform(-1, 1, size=s).astype(np.float32) for s in shapes]
    results = []
    for device in ("cuda", "cpu"):
        params = [ember.nn.Parameter(ember.tensor(v, device=device)) for v in values]
        opt = ember.optim.Adam(params, lr=0.01)
        for step in range(2):
            for p, g in zip(params, grads):
                p.grad = ember.tensor(g * (step + 1), device=device)
            if device == "cuda" and step == 1:
                with ember.explain.capture() as plans:
                    opt.step()
            else:
                opt.step()
        results.append([p.numpy() for p in params])
    parts = [part for p in plans for k in p.kernels for part in (k.segments or [k])]
    heavy = [part for part in parts if element_nodes(part.covers) > POINTWISE_HEAVY]
    assert all(len(part.outputs) <= 3 for part in heavy), [len(part.outputs) for part in heavy]
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(6, 8), (1, 8), (6, 1), (0, 8)])
def test_a_value_and_its_reshaped_reader_are_one_pointwise_kernel(rng, shape):
    """Pointwise kernels over spaces of one size are one space: each computes an element at its linear position,
    which a reshape keeps, so a stored value and a reader of it reshaped (a bias add over (M, N), the activation
    over (B, T, N)) are one kernel that computes the value once. A reader at other positions (a transpose) stays
    right. Empty and size-1 dimensions included."""
    x, xc = pair(rng, *shape)
    rows, cols = shape
    split = (2, rows // 2, cols) if rows % 2 == 0 and rows else (rows, 1, cols)

    def outputs(t):
        y = t * 2 + 1
        return y, y.reshape(*split).tanh() * 3, y.t().exp()

    got, expected = outputs(x), outputs(xc)
    p = plan(*got[:2])
    if math.prod(shape):
        assert [k.kind for k in p.kernels] == [KernelKind.POINTWISE] and len(p.kernels[0].outputs) == 2, str(p)
    ember.realize(*got)
    for t, e in zip(got, expected):
        assert_close(t, e)


def test_a_repeated_step_hits_the_plan_cache(rng, fresh_caches):
    from ember.runtime import cuda

    x, _ = pair(rng, 16, 16)
    before = dict(cuda.stats)
    for lr in (0.1, 0.2, 0.3):
        x = (x - lr * x.tanh()).realize()
    made = (cuda.stats["plans_compiled"] + cuda.stats["plans_loaded"]
            - before["plans_compiled"] - before["plans_loaded"])
    assert made == 1  # planned once
    assert cuda.stats["plan_hits"] - before["plan_hits"] == 2


# -- random graphs ---------------------------------------------------------------------------

UNARY_FNS = {"tanh": lambda t: t.tanh(), "sigmoid": lambda t: t.sigmoid(), "abs": lambda t: t.abs(),
             "neg": lambda t: -t, "relu": lambda t: t.relu(), "sin": lambda t: t.sin(),
             "exp_bounded": lambda t: t.tanh().exp(), "square": lambda t: t * t}
BINARY_FNS = {"add": lambda p, q: p + q, "sub": lambda p, q: p - q, "mul": lambda p, q: p * q,
              "maximum": ember.maximum, "where": lambda p, q: ember.where(p > q, p, q)}
UNARY, BINARY = list(UNARY_FNS), list(BINARY_FNS)


def apply_program(program, inputs):
    """Run a drawn program (list of steps) on input tensors; return every value it made."""
    values = list(inputs)
    for step in program:
        kind, a, b, extra = step
        x, y = values[a % len(values)], values[b % len(values)]
        if kind == "unary":
            out = UNARY_FNS[extra](x)
        elif kind == "binary":
            y = y if y.shape == x.shape else x.flip(0)
            if b % 2 and y.ndim:
                y = y[..., :1]  # broadcast along the last axis
            out = BINARY_FNS[extra](x, y)
        elif kind == "reduce":
            if x.ndim == 0:
                continue
            dim = extra % x.ndim
            out = [x.sum(dim, keepdim=True), x.amax(dim, keepdim=True), x.mean(dim, keepdim=True),
                   x.softmax(dim)][extra % 4]
            out = out.expand(x.shape) if out.shape != x.shape else out
        elif kind == "view":
            if x.ndim < 2:
                continue
            out = [x.mT, x.flip(-1), x[..., ::2].repeat(*([1] * (x.ndim - 1)), 2)[..., : x.shape[-1]],
                   ember.pad(x[..., 1:], (0, 1), value=0.25), x.reshape(x.shape[0], -1).reshape(x.shape)][extra % 5]
            if out.shape != x.shape:
                out = out.reshape(x.shape) if out.numel() == x.numel() else x
        else:  # gather along the last axis
            if x.ndim == 0:
                continue
            n = x.shape[-1]
            idx = ember.arange(n, device=x.device).flip(0).expand(x.shape) % max(n - extra % 3, 1)
            out = x.gather(x.ndim - 1, idx)
        values.append(out)
    return values


step = st.tuples(st.sampled_from(["unary", "binary", "reduce", "view", "gather"]), st.integers(0, 50),
                 st.integers(0, 50), st.integers(0, 20))


@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(program=st.lists(step, min_size=5, max_size=40),
       shape=st.sampled_from([(4, 6), (3, 5, 7), (17, 3), (2, 3, 4)]),
       seed=st.integers(0, 2**16), outputs=st.integers(1, 4))
def test_random_graphs_fused_equal_reference(program, shape, seed, outputs):
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(-2, 2, size=shape).astype(np.float32) for _ in range(2)]
    step_names = {"unary": UNARY, "binary": BINARY}
    program = [(k, a, b, step_names[k][e % len(step_names[k])] if k in step_names else e) for k, a, b, e in program]
    fused = apply_program(program, [ember.tensor(a, device="cuda") for a in arrays])[-outputs:]
    reference = apply_program(program, [ember.tensor(a) for a in arrays])[-outputs:]
    ember.realize(*fused)
    for f, r in zip(fused, reference):
        np.testing.assert_allclose(f.numpy(), r.numpy(), rtol=2e-5, atol=2e-5,
                                   err_msg=f"program={program} shape={shape} seed={seed}")


def test_plans_are_stored_on_disk_and_a_corrupt_entry_is_rebuilt(rng, tmp_path, monkeypatch):
    from ember.runtime import cuda, plan_cache

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_cache, "_plans", {})
    x, xc = pair(rng, 9, 31)

    def step(t):
        return (t.softmax(-1) * 2 + t.sum(0)).realize()

    expected = step(xc).numpy()
    before = dict(cuda.stats)
    np.testing.assert_allclose(step(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    assert list((tmp_path / "plans").glob("*.pkl"))
    plan_cache.clear()  # as a new process would start
    np.testing.assert_allclose(step(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    assert cuda.stats["plans_loaded"] - before["plans_loaded"] == 1
    for path in (tmp_path / "plans").glob("*.pkl"):
        path.write_bytes(b"not a plan")
    plan_cache.clear()
    np.testing.assert_allclose(step(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    assert cuda.stats["plans_compiled"] - before["plans_compiled"] == 2


def test_a_convolution_takes_bias_batch_norm_residual_and_activation_in_one_neighbour_kernel(rng):
    import ember.nn as nn
    import ember.nn.functional as F

    def block(device):
        ember.manual_seed(0)
        conv, bn = nn.Conv2d(8, 8, 3, padding=1).to(device), nn.BatchNorm2d(8).to(device)
        bn.running_mean.data = ember.randn(8, device=device) * 0.1
        bn.running_var.data = ember.rand(8, device=device) + 0.5
        bn.eval()
        x = ember.tensor(data, device=device)
        return F.relu(bn(conv(x)) + x)

    data = rng.standard_normal((2, 8, 12, 12)).astype(np.float32)
    out = block("cuda")  # the module is moved lazily: explain moves it first, as the runtime does
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == ["conv2d", "pointwise"]
    assert_close(out, block("cpu"), rtol=1e-4, atol=1e-5)


REDUCTIONS = {
    "sum": lambda t, d, k: t.sum(d, keepdim=k), "mean": lambda t, d, k: t.mean(d, keepdim=k),
    "amax": lambda t, d, k: t.amax(d, keepdim=k), "amin": lambda t, d, k: t.amin(d, keepdim=k),
    "prod": lambda t, d, k: t.prod(d, keepdim=k) if isinstance(d, int) else t.prod(),
    "argmax": lambda t, d, k: t.argmax(d, keepdim=k) if isinstance(d, int) else t.argmax(),
    "logsumexp": lambda t, d, k: t.logsumexp(d, keepdim=k), "var": lambda t, d, k: t.var(d, keepdim=k),
}
AFTER = {  # a consumer in the same kernel, a scalar parameter not exactly representable in float32
    "none": lambda t: t, "clamp": lambda t: t.clamp(-0.5, 0.7), "scaled_exp": lambda t: (t * 3.3).tanh().exp(),
    "broadcast_back": lambda t: t,  # replaced below by a use beside the reduced input
}


def _degenerate_program(x, reduction, dims, keepdim, after):
    y = (x * 1.7 - 0.2).relu() + x  # a producer fused before the reduction
    r = REDUCTIONS[reduction](y, dims, keepdim)
    if after == "broadcast_back" and keepdim and r.dtype == y.dtype:
        return y - r  # read again beside the input: the kernel stores both shapes
    return AFTER[after](r if r.dtype.is_floating_point else r.to(ember.float32))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
@example(shape=[1, 1], reduction="sum", axes=1, keepdim=True, after="clamp", seed=0)
@example(shape=[1, 1, 0], reduction="amax", axes=4, keepdim=False, after="none", seed=0)
@given(shape=st.lists(st.sampled_from([0, 1, 1, 2, 3, 5]), min_size=0, max_size=4),
       reduction=st.sampled_from(sorted(REDUCTIONS)), axes=st.integers(0, 15), keepdim=st.booleans(),
       after=st.sampled_from(sorted(AFTER)), seed=st.integers(0, 2**16))
def test_reductions_over_size_0_and_1_axes_compile_and_match_the_reference(shape, reduction, axes, keepdim, after,
                                                                          seed):
    """Shapes with 0s and 1s in every position: reductions over them, kernels whose every value is one scalar,
    and reductions the planner removes (over size-1 axes) all compile and equal the reference, or raise the
    same error (an empty max or argmax has no value)."""
    shape = tuple(shape)
    rank = len(shape)
    picked = tuple(d for d in range(rank) if axes >> d & 1)
    dims = picked[0] if len(picked) == 1 else (picked if picked else None)
    if reduction in ("prod", "argmax") and isinstance(dims, tuple):
        dims = None
    if dims is None and keepdim:
        dims = tuple(range(rank)) or None
    array = np.random.default_rng(seed).uniform(-2, 2, size=shape).astype(np.float32)
    outcomes = []
    for device in ("cuda", "cpu"):
        try:
            value = _degenerate_program(ember.tensor(array, device=device), reduction, dims, keepdim, after)
            outcomes.append(value.numpy())
        except (IndexError, RuntimeError, ValueError) as error:
            outcomes.append(type(error))
    fused, reference = outcomes
    where = f"{reduction} over dims {dims} (keepdim={keepdim}) of shape {shape}, then {after}"
    if isinstance(reference, type):
        assert fused is reference, where
    else:
        assert not isinstance(fused, type), f"{where}: cuda raised {fused.__name__}"
        np.testing.assert_allclose(fused, reference, rtol=2e-5, atol=2e-5, err_msg=where)


def test_a_shared_widening_cast_is_stored_as_its_half_precision_input(rng):
    """A bfloat16 value read in float32 by several kernels is stored in bfloat16 (half the bytes; the
    widening is exact) and the results match the unfused reference."""
    def program(a):
        for _ in range(30):  # more work than the planner recomputes in each reader
            a = (a * 1.01 + 0.1).tanh()
        wide = a.float()  # not held after the program: the planner chooses how to store it
        return [wide.sum(-1), wide.amax(0), wide * 3]

    a, a_c = pair(rng, 40, 300)
    outs, refs = program(a.to(ember.bfloat16)), program(a_c.to(ember.bfloat16))
    p = plan(*outs)
    outputs = {id(n) for n in p.lowered.outputs}
    intermediates = [n for n in p.lowered.nodes if id(n) in p.stored and id(n) not in outputs]
    assert [(n.op.label, n.dtype) for n in intermediates] == [("tanh", ember.bfloat16)]
    for out, ref in zip(outs, refs):  # the fused chain rounds to bfloat16 once, the reference after each op
        assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_a_tiny_shared_producer_is_recomputed_by_its_readers_not_stored_by_a_launch_of_its_own(cuda_backend):
    """Per-box values read by several ops (a test on a box's width): storing them saves a few bytes and costs
    a launch, so each reader recomputes them; a large shared producer is still weighed by its bytes."""
    boxes = np.int64([(0, 0, 20, 30), (10, 5, 1, 20), (1, 1, 5, 5)])

    def build(device):
        b = ember.tensor(boxes, device=device)
        thin = (b[:, 2].to(ember.int32) < 2)[:, None]
        a = ember.arange(8, device=device, dtype=ember.float32)[None, :]
        return ember.where(thin, 1.0, 2.0) * a + ember.where(thin, 3.0, 4.0) * a * a + ember.where(thin, 5.0, 6.0)

    out = build("cuda")
    p = plan(out)
    assert p.launches == 1, str(p)
    np.testing.assert_array_equal(out.numpy(), build("cpu").numpy())


@pytest.mark.parametrize("shape", [(2**22,), (2**18, 16), (4, 2**20)])
def test_a_long_reduction_into_few_outputs_takes_two_kernels_not_a_tree_of_three(shape, cuda_backend):
    rng = np.random.default_rng(8)
    a = rng.standard_normal(shape).astype(np.float32)
    x = ember.tensor(a, device="cuda")
    out = x.sum() if len(shape) < 2 or shape[0] > 4 else x.sum(-1)
    p = plan(out)
    assert [k.kind.value for k in p.kernels] == ["reduce", "reduce"], str(p)
    want = a.sum(dtype=np.float64) if out.ndim == 0 else a.sum(-1, dtype=np.float64)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-2)


def test_pointwise_kernels_nothing_reads_share_the_last_launch(rng):
    """An update nothing else in the graph reads (an optimizer's, of a small parameter) waits for the deepest
    level, so the updates computed early and late share one launch; the values are the reference's."""
    (x, xc), (y, yc) = pair(rng, 100), pair(rng, 37)

    def build(a, b):
        early = a * 2 + 1  # reads inputs only: ready at once
        late = b * (a * a).sum()  # after a reduction
        return early, late

    outs, refs = build(x, y), build(xc, yc)
    p = plan(*outs)
    assert [k.kind.value for k in p.kernels] == ["reduce", "segmented"], str(p)
    for out, ref in zip(outs, refs):
        assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_held_value_read_at_other_positions_is_computed_again_by_its_reader_not_waited_for(rng):
    """A value the user holds is written; a pointwise step reading it flipped or transposed computes it again
    where it reads it (cheaper than a launch after the write), so both are one launch, each the reference's."""
    (x, xc), (y, yc) = pair(rng, 33, 65), pair(rng, 65)

    def build(a, b):
        held = (a * 1.5 + b).tanh()
        return held, held.flip(1) * b - held, (held.t() + 1).exp()

    outs, refs = build(x, y), build(xc, yc)
    p = plan(*outs)
    assert p.launches == 1 and "recomputes tanh [33, 65] float32, a requested value" in str(p), str(p)
    for out, ref in zip(outs, refs):
        assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_a_held_value_whose_recomputation_costs_more_than_a_launch_is_loaded_and_explain_says_so(rng):
    """Fifty ops per element over nine million elements take longer than a launch and a read of their result."""
    x = ember.tensor(rng.uniform(-1, 1, (3000, 3000)).astype(np.float32), device="cuda")
    held = x
    for i in range(25):
        held = (held * 0.5 + i).sin()
    p = plan(held, held.flip(0) + 1)
    assert p.launches == 2 and "loads sin [3000, 3000] float32" in str(p), str(p)
