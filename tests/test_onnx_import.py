"""ember.from_onnx: an ONNX model as an ember Module (inputs and outputs in graph order, initializers as
trainable parameters, lazy, any device), its errors, and real models exported by torch matching torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import ember  # noqa: E402


def _linear_model(op_type: str = "Relu") -> onnx.ModelProto:
    """y = op(x @ w + b), z = y summed over rows: two outputs, two initializers."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("fc.weight", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32))
    b = helper.make_tensor("fc.bias", TensorProto.FLOAT, [3], rng.standard_normal(3).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["x", "fc.weight"], ["h"]), helper.make_node("Add", ["h", "fc.bias"], ["a"]),
             helper.make_node(op_type, ["a"], ["y"], name="act"),
             helper.make_node("ReduceSum", ["y"], ["z"], keepdims=0)]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_from_onnx_takes_a_path_bytes_or_a_model_and_returns_outputs_in_graph_order(tmp_path):
    model = _linear_model()
    path = tmp_path / "linear.onnx"
    onnx.save(model, path)
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    w, b = (onnx.numpy_helper.to_array(t) for t in model.graph.initializer)
    expected = np.maximum(x @ w + b, 0)
    for source in (model, model.SerializeToString(), str(path)):
        module = ember.from_onnx(source)
        assert module.input_names == ["x"] and module.output_names == ["y", "z"]
        y, z = module(ember.tensor(x))
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(z.numpy(), expected.sum(), rtol=1e-6)


def test_initializers_are_trainable_parameters():
    module = ember.from_onnx(_linear_model("Sigmoid"))
    names = dict(module.named_parameters())
    assert set(names) == {"fc_weight", "fc_bias"} and all(p.requires_grad for p in names.values())
    optimizer = ember.optim.SGD(module.parameters(), lr=0.1)
    x = ember.tensor(np.ones((2, 4), np.float32))
    before = module(x)[1].item()
    for _ in range(3):
        optimizer.zero_grad()
        module(x)[1].backward()
        optimizer.step()
    assert module(x)[1].item() < before


def test_the_forward_is_lazy_until_a_value_is_read():
    module = ember.from_onnx(_linear_model())
    y, _ = module(ember.tensor(np.ones((2, 4), np.float32)))
    assert y.shape == (2, 3) and not y._node.realized


def test_an_unsupported_operator_is_named_with_its_node_op_type_and_opset():
    with pytest.raises(ember.UnsupportedOperatorError, match=r"'act' \(StringNormalizer, opset 13"):
        ember.from_onnx(_linear_model("StringNormalizer"))


def test_an_error_inside_an_operator_names_its_node():
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [5])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"], name="flatten")], "bad",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
    module = ember.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    with pytest.raises(ember.ShapeError, match=r"ONNX node 'flatten' \(Reshape, opset 13.*reshape: shape \(5,\)"):
        module(ember.tensor(np.ones((2, 3), np.float32)))


def test_shapes_computed_in_the_graph_are_read_and_data_dependent_outputs_work():
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ReduceProd", ["s"], ["n"], keepdims=1),
             helper.make_node("Reshape", ["x", "n"], ["flat"]),
             helper.make_node("NonZero", ["flat"], ["nz"])]
    graph = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("flat", TensorProto.FLOAT, [6]),
                               helper.make_tensor_value_info("nz", TensorProto.INT64, [1, None])])
    module = ember.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    x = np.array([[0, 1, 0], [2, 0, 3]], np.float32)
    flat, nz = module(ember.tensor(x))
    np.testing.assert_array_equal(flat.numpy(), x.reshape(-1))
    np.testing.assert_array_equal(nz.numpy(), [[1, 3, 5]])


def test_shape_arithmetic_of_the_graph_is_folded_on_the_host_without_reading_the_device(monkeypatch):
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["d"], axis=0),
             helper.make_node("Mul", ["d", "d"], ["dd"]),
             helper.make_node("Concat", ["one", "dd"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    graph = helper.make_graph(nodes, "fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 9])], [one])
    module = ember.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    reads = []
    monkeypatch.setattr(ember.Tensor, "numpy", lambda self: reads.append(self) or pytest.fail("a device read"))
    y = module(ember.tensor(np.arange(9, dtype=np.float32).reshape(3, 3)))
    assert y.shape == (1, 9) and not reads


def test_importing_and_running_on_the_cpu_loads_neither_torch_nor_triton():
    code = ("import sys, numpy as np, ember, onnx; from onnx import helper, TensorProto as T;"
            "g = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g',"
            "[helper.make_tensor_value_info('x', T.FLOAT, [2])], [helper.make_tensor_value_info('y', T.FLOAT, [2])]);"
            "m = ember.from_onnx(helper.make_model(g)); print(m(ember.tensor(np.ones(2, np.float32))).numpy());"
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("pads", [[1, 0, 2, 1, 0, 2], [1, 1, 1, 1, 1, 1]], ids=["asymmetric", "symmetric"])
def test_volumetric_convolutions_import_as_torchs_conv3d_and_conv_transpose3d(pads):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5, 6, 3)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 2, 3)).astype(np.float32)  # two groups
    wt = rng.standard_normal((6, 3, 2, 3, 2)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=2, pads=pads, strides=[2, 1, 1],
                              dilations=[1, 2, 1]),
             helper.make_node("ConvTranspose", ["y", "wt"], ["z"], group=2, strides=[2, 1, 2], pads=[0, 1, 0, 0, 0, 1],
                              output_padding=[1, 0, 1])]
    graph = helper.make_graph(nodes, "volumetric", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(wt, "wt"),
                               numpy_helper.from_array(b, "b")])
    got = ember.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))(ember.tensor(x))
    padded = torch.nn.functional.pad(torch.tensor(x), [p for i in (2, 1, 0) for p in (pads[i], pads[i + 3])])
    y = torch.nn.functional.conv3d(padded, torch.tensor(w), torch.tensor(b), (2, 1, 1), 0, (1, 2, 1), 2)
    z = torch.nn.functional.conv_transpose3d(y, torch.tensor(wt), None, (2, 1, 2), 0, (1, 0, 1), 2)
    z = z[:, :, :, 1:, :-1]  # ONNX's pads crop the full output: one row of H before, one column of W after
    np.testing.assert_allclose(got.numpy(), z.numpy(), rtol=1e-4, atol=1e-4)


def _torchvision_models():
    from model_libraries import library  # noqa: PLC0415 - imports torch

    models = library("torchvision").models
    return {
        "resnet18": lambda: models.resnet18(num_classes=10),
        "mobilenet_v3_small": lambda: models.mobilenet_v3_small(num_classes=10),
        "vit": lambda: models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, num_classes=10),
    }


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript_exporter", "dynamo_exporter"])
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "vit"])
def test_torchvision_models_exported_by_torch_match_torch(name, dynamo, tmp_path):
    torch = pytest.importorskip("torch")
    if dynamo:
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = _torchvision_models()[name]().eval()
    if name == "vit":  # torchvision starts its head at zero
        torch.nn.init.normal_(model.heads.head.weight, std=0.1)
    x = torch.randn(2, 3, 32, 32) if name == "vit" else torch.randn(2, 3, 64, 64)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=dynamo, opset_version=18)
    with torch.no_grad():
        expected = model(x).numpy()
    got = ember.from_onnx(str(path))(ember.tensor(x.numpy())).numpy()
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "vit"])
def test_torchvision_models_exported_by_torch_match_torch_on_cuda(name, tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = _torchvision_models()[name]().eval()
    if name == "vit":
        torch.nn.init.normal_(model.heads.head.weight, std=0.1)
    x = torch.randn(2, 3, 32, 32) if name == "vit" else torch.randn(2, 3, 64, 64)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18)
    with torch.no_grad():
        expected = model(x).numpy()
    module = ember.from_onnx(str(path), device="cuda")
    got = module(ember.tensor(x.numpy(), device="cuda")).numpy()
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-3  # TF32 may be on for the GPU's matmuls
