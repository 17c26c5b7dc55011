"""ONNX's own conformance suite (the node tests of `onnx.backend.test`) run against `ember.onnx`.

Every node case of the installed onnx runs: on the cpu (ember's reference backend) in the full tier, a fixed sample
of op families in the quick tier, and on cuda in the GPU suite (`pytest -m gpu tests/test_onnx_node_suite.py`).
The cases ember does not pass are listed in `NOT_PASSED`, each group with the reason; they run as expected failures,
so one that starts passing fails the suite until it leaves the list.
"""

from __future__ import annotations

import re

import pytest

backend_test = pytest.importorskip("onnx.backend.test")

import ember.onnx  # noqa: E402

# The node cases ember does not pass (regular expressions over the case name, without the device suffix), by reason.
NOT_PASSED: dict[str, list[str]] = {
    # Element types ember holds no tensors of: 8-bit and 4-bit floats, 4-bit and 2-bit integers, strings.
    "element types ember does not hold": [
        r"float8", r"float4", r"_e4m3", r"_e5m2", r"int4", r"uint4", r"int2", r"uint2", r"_string", r"strnorm",
        r"string_", r"regex_full_match", r"label_encoder", r"cast_.*STRING", r"castlike_.*STRING",
    ],
    # Quantized arithmetic (QuantizeLinear, QLinearConv, ConvInteger ...): not built.
    "quantized operators": [
        r"quantizelinear", r"qlinear", r"convinteger", r"matmulinteger", r"dynamicquantizelinear",
    ],
    # Operators ember has no implementation of and onnx defines as no function of others.
    "operators not implemented": [
        r"gridsample", r"nonmaxsuppression", r"_dft", r"_stft", r"bitcast", r"image_decoder", r"tfidfvectorizer",
        r"col2im", r"roialign", r"deform_conv", r"_det_", r"maxunpool", r"tensorscatter", r"ai_onnx_ml",
        r"_momentum", r"_adagrad", r"_adam", r"treeensemble", r"melweightmatrix", r"_blackmanwindow",
        r"_hammingwindow", r"_hannwindow", r"affine_grid", r"_rnn_seq", r"_simple_rnn", r"_gru_", r"_lstm_",
        r"_bernoulli", r"randomuniformlike", r"randomnormallike",
    ],
}

# One case of each family for the quick tier (the full tier runs them all).
QUICK_SAMPLE = [
    "test_abs", "test_add_bcast", "test_conv_with_strides_padding", "test_maxpool_2d_pads", "test_averagepool_2d_pads",
    "test_reshape_negative_dim", "test_gather_0", "test_reduce_sum_keepdims_example", "test_softmax_axis_1",
    "test_slice_neg_steps", "test_resize_upsample_scales_linear", "test_layer_normalization_2d_axis0",
    "test_if", "test_loop11", "test_nonzero_example", "test_sequence_insert_at_back", "test_einsum_batch_matmul",
]


def _cases(device_suffix: str, keep: str, drop: str | None = None):
    """The node cases named `test_<case>_<device_suffix>` whose case matches `keep` and not `drop`, with the cases
    of NOT_PASSED as expected failures."""
    suite = backend_test.BackendTest(ember.onnx, __name__)
    for patterns in NOT_PASSED.values():
        for pattern in patterns:
            suite.xfail(pattern)
    cases = suite.test_cases["OnnxBackendNodeModelTest"]
    for name in [name for name in vars(cases) if name.startswith("test_")]:
        case = name.removesuffix(f"_{device_suffix}")
        if case == name or not re.fullmatch(keep, case) or (drop and re.fullmatch(drop, case)):
            delattr(cases, name)
    return cases


_QUICK = "|".join(re.escape(name) for name in QUICK_SAMPLE)

OnnxNodeCpuQuick = _cases("cpu", _QUICK)
OnnxNodeCpu = pytest.mark.slow(_cases("cpu", ".*", _QUICK))
OnnxNodeCuda = pytest.mark.gpu(_cases("cuda", ".*"))
