"""The arithmetic of ember.runtime.vendor's rewrites of vendor calls, checked in torch on the cpu (on a GPU the
calls themselves run in tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_array

torch = pytest.importorskip("torch")

from ember.runtime.vendor import input_grad_as_forward  # noqa: E402


@pytest.mark.parametrize("kernel, padding, dilation", [((1, 1), (0, 0), (1, 1)), ((3, 3), (1, 1), (1, 1)),
                                                     ((3, 5), (0, 2), (1, 1)), ((3, 3), (2, 1), (2, 1)),
                                                     ((5, 1), (1, 0), (1, 1))])
def test_a_stride_one_input_gradient_is_the_forward_convolution_the_vendor_writes_in_place(kernel, padding, dilation,
                                                                                           rng):
    """vendor.input_grad_as_forward: the input gradient of a stride-1 convolution is the forward convolution of
    the output gradient with the weight's channels swapped and its window flipped (what cuDNN writes straight
    into ember's buffer on a GPU); a strided, grouped or over-padded one has no such form."""
    x = torch.tensor(random_array(rng, (2, 3, 9, 8), "float64"))
    w = torch.tensor(random_array(rng, (4, 3, *kernel), "float64"))
    conv = ((1, 1), padding, dilation, 1)
    g = torch.tensor(random_array(rng, tuple(torch.nn.functional.conv2d(x, w, None, *conv).shape), "float64"))
    weight, forward = input_grad_as_forward(w, conv)
    got = torch.nn.functional.conv2d(g, weight.contiguous(), None, *forward)
    want = torch.nn.grad.conv2d_input(tuple(x.shape), w, g, *conv)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
    assert input_grad_as_forward(w, ((2, 2), padding, dilation, 1)) is None
    assert input_grad_as_forward(w, ((1, 1), (kernel[0], 0), (1, 1), 1)) is None  # wider than the window reaches
    assert input_grad_as_forward(torch.ones(4, 1, 3, 3), ((1, 1), (1, 1), (1, 1), 3)) is None
