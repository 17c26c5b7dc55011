"""Column reductions (the kept axis the contiguous one: sums over the rows of an (R, C) matrix, as batch-norm
statistics and bias gradients in channels-last) against torch, and how a long one is planned: split across
programs along the reduced axis, its partial results combined by a second kernel.

Test ids read `op-dtype-shape`. Small shapes run in one kernel; the split ones are large enough to be split
(slow through Triton's interpreter: a few run in the quick tier).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import check_against_torch, random_array

import ember
from ember.compiler.fused import KernelKind
from ember.explain import plan

on_each_device = pytest.mark.usefixtures("device")  # the reference backend, and generated kernels

OPS = {
    "sum": lambda m, x: x.sum(0),
    "mean-keepdim": lambda m, x: x.mean(0, keepdim=True),
    "amax": lambda m, x: m.amax(x, 0),
    "amin": lambda m, x: m.amin(x, 0),
}
SHAPES = [(0, 3), (1, 1), (5, 1), (1, 64), (7, 3), (300, 3), (33, 300), (129, 64)]
SPLIT_SHAPES = [(65539, 5), (4100, 64), (2049, 1000)]  # rows not a multiple of the parts: padded
FLOATS = ["float32", "bfloat16", "float16"]


def _cases(shapes):
    return [pytest.param(name, dtype, shape, id=f"{name}-{dtype}-{shape[0]}x{shape[1]}")
            for name in OPS for dtype in FLOATS for shape in shapes
            if not (shape[0] == 0 and name in ("amax", "amin"))]


@on_each_device
@pytest.mark.parametrize("name, dtype, shape", _cases(SHAPES))
def test_column_reduction_matches_torch(name, dtype, shape, rng):
    check_against_torch(OPS[name], random_array(rng, shape, dtype))


@on_each_device
@pytest.mark.slow
@pytest.mark.parametrize("name, dtype, shape", _cases(SPLIT_SHAPES))
def test_split_column_reduction_matches_torch(name, dtype, shape, rng):
    # float32 sums of up to 65539 values in another order than torch's: ~1e-4 of the sum's scale apart
    loose = {"rtol": 1e-3, "atol": 2e-3} if dtype == "float32" else {}
    check_against_torch(OPS[name], random_array(rng, shape, dtype), grad=False, **loose)


@on_each_device
def test_split_column_sum_of_half_floats_rounds_once_like_torch(rng):
    x = random_array(rng, (65539, 5), "bfloat16")
    check_against_torch(OPS["sum"], x, grad=False)


@on_each_device
def test_split_column_sums_take_their_producers_and_consumers(rng):
    """Batch-norm statistics in channels-last: sums of x * g and of (x - mean)^2 over the rows, read by a
    pointwise consumer."""
    x, g = random_array(rng, (4100, 64), "float32"), random_array(rng, (4100, 64), "float32")

    def statistics(m, x, g):
        centred = x - x.mean(0, keepdim=True)
        return (x * g).sum(0) * 0.5, (centred * centred).mean(0).add(1e-5).rsqrt()

    # sums of 4100 float32 products in another order than torch's: a few ulps of the sum apart
    check_against_torch(statistics, x, g, grad=False, rtol=1e-4, atol=1e-4)


def _reduce_kernels(y):
    return [k for k in plan(y).kernels if k.kind is KernelKind.REDUCE]


def test_long_column_sum_is_split_so_its_partial_stage_fills_the_gpu():
    with ember.device("cuda"):
        x = ember.randn((1 << 20, 64), dtype=ember.bfloat16)
        partial, total = _reduce_kernels(x.sum(0))
    parts, rows, channels = partial.space
    assert channels == 64 and parts * rows >= 1 << 20
    assert parts * channels // 32 >= 2 * 132  # programs of 32 kept positions: two waves of an H100's SMs at least
    assert total.space[0] == parts
    assert partial.reductions[0].dtype is ember.float32  # partial sums of bf16 kept in float32, rounded once


def test_split_column_sum_into_three_channels_reads_32_rows_at_once_as_contiguous_blocks():
    with ember.device("cuda"):
        x = ember.randn((1 << 20, 3), dtype=ember.bfloat16)
        partial, total = _reduce_kernels(x.sum(0))
    parts, _, width = partial.space
    assert width == 32 * 3  # three blocks of 32 contiguous positions
    assert total.space == (parts * 32, 3)


def test_column_sum_whose_kept_positions_fill_the_gpu_is_one_kernel():
    with ember.device("cuda"):
        x = ember.randn((64, 1 << 16), dtype=ember.float32)
        assert len(_reduce_kernels(x.sum(0))) == 1


def test_short_column_sum_is_one_kernel():
    with ember.device("cuda"):
        x = ember.randn((1000, 64), dtype=ember.float32)
        assert len(_reduce_kernels(x.sum(0))) == 1


@on_each_device
def test_empty_column_sum_is_zero():
    assert np.array_equal(ember.zeros((0, 3)).sum(0).numpy(), np.zeros(3, np.float32))


@pytest.mark.usefixtures("cuda_backend")
def test_the_column_sums_of_an_mlps_outputs_stay_in_the_mlp_kernels_programs():
    """A column mean over many rows of a narrow MLP's output is split in two stages, as the MLP kernel sums its
    first stage as the rows pass (not rows read together as wider ones, which it does not take): one kernel."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).half().eval()
    em = ember.from_torch(model).to("cuda")
    with ember.no_grad():
        x = ember.from_dlpack(torch.randn(2**18 + 3, 64, dtype=torch.float16)).to("cuda")
        out = em(x).float()
        kernels = plan(out.mean(0), (out ** 2).mean()).kernels
    assert [k.kind for k in kernels] == [KernelKind.MLP] and len(kernels[0].payload.summed) == 2


@pytest.mark.usefixtures("cuda_backend")
def test_many_independent_column_sums_share_kernels_whose_partial_results_fit_the_registers(rng):
    """Bias and layer-norm gradients of every layer of a network are column sums over one space: they merge a few
    to a kernel, and a kernel keeping more partial-result tiles narrows them (each tile is a thread's registers)."""
    from ember.compiler.patterns import rows
    from ember.compiler.planner import MAX_KERNEL_REDUCTIONS

    values = [random_array(rng, (300, 64), "float32") for _ in range(20)]
    with ember.device("cuda"):
        sums = [ember.tensor(v).sum(0) for v in values]
        p = plan(*sums)
        kernels = [k for k in p.kernels if k.kind is KernelKind.REDUCE]
        assert len(kernels) >= 20 // MAX_KERNEL_REDUCTIONS
        for k in kernels:
            assert len(k.reductions) <= MAX_KERNEL_REDUCTIONS
            (launch,) = p.sources[id(k)].launches
            tile = launch.constexprs["BLOCK_M"] * launch.constexprs["BLOCK_N"]
            assert tile * max(len(k.reductions), rows.TILE_ACCUMULATORS) <= rows.COLUMN_TILE * rows.TILE_ACCUMULATORS
        ember.realize(*sums)
    for got, v in zip(sums, values):
        np.testing.assert_allclose(got.numpy(), v.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("cuda_backend")
@pytest.mark.parametrize("axis", [2, 0])
def test_a_column_sum_of_a_concatenation_reads_its_parts_at_positions_triton_sees_run_contiguously(axis, rng):
    """A layer's q, k and v bias gradients: the sum over the tokens of a concatenation of three head-split
    tensors. A block of kept positions starts at a multiple of BLOCK_M computed from the program's number, and a
    part's positions along the tile are not clamped (its loads are masked instead): a clamp, or the first row's
    remainder, hides from Triton that the positions run contiguously, and the loads would not coalesce. A part
    placed along an outer axis (one position a program) is still clamped: a scalar load has no mask."""
    sizes = (1, 2, 3) if axis == 0 else (2, 2, 2)
    values = [random_array(rng, (b, 3, 16, 32), "float32") for b in sizes]
    with ember.device("cuda"):
        parts = [ember.tensor(v).permute(0, 2, 1, 3).reshape(-1, 16, 96) for v in values]
        out = ember.cat(parts, axis).sum(1)
        (source,) = [s for k, s in plan(out).sources.items() if "reduce" in s.name]
        assert re.search(r"within = \(pid % \d+\) \* BLOCK_M", source.text), source.text
        assert ("minimum" in source.text) == (axis == 0), source.text
    want = np.concatenate([v.transpose(0, 2, 1, 3).reshape(-1, 16, 96) for v in values], axis).sum(1)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
