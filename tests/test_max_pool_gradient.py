"""max_pool2d's gradient by stride phase: values and gradients equal torch's (a tie's gradient goes to the first
maximum of its window), and each input element reads only the windows that hold it.

Test ids read `dtype-shape-kernel-stride-padding[-ceil]`.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check_against_torch, random_array

import ember
from ember.explain import plan

on_each_device = pytest.mark.usefixtures("device")  # the reference backend, and generated kernels

POOLS = [  # (N, C, H, W), kernel, stride, padding, ceil_mode
    ((2, 3, 9, 9), 3, 2, 1, False),  # a ResNet stem's
    ((1, 2, 8, 7), 3, 2, 1, True),
    ((2, 2, 6, 6), 2, 2, 0, False),  # windows that do not overlap: one term per input
    ((1, 1, 1, 1), 1, 1, 0, False),
    ((1, 1, 5, 5), 3, 1, 1, False),  # stride 1: every window of the kernel holds an input
    ((1, 2, 7, 8), (3, 2), (2, 1), (1, 0), True),
    ((1, 1, 6, 6), 5, 2, 2, False),
    ((1, 1, 3, 3), 3, 3, 1, True),
    ((0, 2, 5, 5), 3, 2, 1, False),
    ((3, 5, 5), 3, 2, 1, False),  # no batch axis
]


def _id(shape, k, s, p, ceil) -> str:
    return f"{'x'.join(map(str, shape))}-k{k}-s{s}-p{p}{'-ceil' if ceil else ''}".replace(" ", "")


def _pool(k, s, p, ceil):
    return lambda m, x: m.nn.functional.max_pool2d(x, k, s, p, ceil_mode=ceil)


@on_each_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape, k, s, p, ceil", [pytest.param(*c, id=_id(*c)) for c in POOLS])
def test_max_pool2d_value_and_gradient_match_torch(dtype, shape, k, s, p, ceil, rng):
    check_against_torch(_pool(k, s, p, ceil), random_array(rng, shape, dtype))


@on_each_device
@pytest.mark.parametrize("shape, k, s, p, ceil", [pytest.param(*c, id=_id(*c)) for c in POOLS[:3]])
def test_max_pool2d_gradient_of_ties_goes_to_the_first_maximum_like_torch(shape, k, s, p, ceil, rng):
    x = np.round(random_array(rng, shape, "float32"))  # values in {-2, ..., 2}: many windows hold ties
    check_against_torch(_pool(k, s, p, ceil), x, grad_rtol=0, grad_atol=0)


@on_each_device
def test_max_pool2d_gradient_of_channels_last_memory_matches_torch(rng):
    x = random_array(rng, (2, 6, 6, 4), "bfloat16")  # (N, H, W, C) memory, pooled as (N, C, H, W)
    check_against_torch(lambda m, t: m.nn.functional.max_pool2d(t.permute(0, 3, 1, 2), 3, 2, 1), x)


def test_max_pool2d_gradient_reads_at_most_four_windows_per_input():
    """Kernel 3, stride 2: an input lies in at most 2 x 2 windows, so its gradient loads the output gradient and
    the first maximum's window 4 times each, not once per kernel offset (9)."""
    with ember.device("cuda"):
        # a stem's size, where the first maximum's window is stored once rather than found again per read
        x = ember.tensor(np.zeros((8, 64, 112, 112), np.float32), dtype=ember.bfloat16, requires_grad=True)
        y = ember.nn.functional.max_pool2d(x, 3, 2, 1)
        (grad,) = ember.grad(y, [x], ember.tensor(np.zeros(y.shape, np.float32), dtype=ember.bfloat16))
        planned = plan(grad)
    (writer,) = [k for k in planned.kernels if any(o.shape == x.shape for o in k.outputs)]
    source = planned.sources[id(writer)].text
    assert source.count("tl.load(") == 2 * 4
