"""`ember.from_torch` beyond Sequential: any torch module whose forward torch.fx can trace (residual blocks,
functional calls, Tensor methods), convolutional and normalisation layers, shared parameters and buffers, the
training mode, gradients and an optimizer step against torch, and errors that name what cannot be imported."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest

import ember

torch = pytest.importorskip("torch")
tnn, TF = torch.nn, torch.nn.functional


class Block(tnn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = tnn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = tnn.BatchNorm2d(c)
        self.conv2 = tnn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = tnn.BatchNorm2d(c)
        self.scale = tnn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        y = TF.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y)) * self.scale
        return torch.relu(x + y)


class Net(tnn.Module):
    """A small residual CNN: a Sequential stem, blocks in a ModuleList, functional calls and methods."""

    def __init__(self, p: float = 0.0, width: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.fc = tnn.Linear(width, classes)  # declared first, called last: the import keeps torch's order
        self.stem = tnn.Sequential(tnn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), tnn.BatchNorm2d(width),
                                  tnn.ReLU())
        self.blocks = tnn.ModuleList([Block(width), Block(width)])
        self.pool = tnn.AdaptiveAvgPool2d(1)
        self.p = p

    def forward(self, x, temperature: float = 1.0):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = torch.flatten(self.pool(x), 1)
        x = TF.dropout(x, self.p, self.training)
        return TF.log_softmax(self.fc(x).view(x.size(0), -1) / temperature, dim=-1)


def net(seed: int, p: float = 0.0, width: int = 6, classes: int = 5) -> Net:
    torch.manual_seed(seed)
    model = Net(p, width, classes)
    with torch.no_grad():  # running statistics away from their initial 0 and 1
        for m in model.modules():
            if isinstance(m, tnn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def images(n: int, seed: int, size: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2, 2, size=(n, 3, size, size)).astype(np.float32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_traced_residual_cnn_computes_what_torch_computes(device):
    if device == "cuda":
        from ember.runtime import cuda

        if not cuda.is_available():
            pytest.skip("the cuda backend needs a GPU or EMBER_INTERPRET=1")
    model = net(1).eval()
    em = ember.from_torch(model)
    assert not em.training
    assert [n for n, _ in em.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(em.state_dict()) == list(model.state_dict())
    x = images(3, 2)
    with torch.no_grad():
        model.blocks[1].scale.mul_(-2.0)  # shared: the import sees a later in-place change
        ref = model(torch.from_numpy(x)).numpy()
        ref_hot = model(torch.from_numpy(x), temperature=0.5).numpy()
    em = em.to(device)
    got = em(ember.tensor(x, device=device)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    hot = em(ember.tensor(x, device=device), temperature=0.5).numpy()
    np.testing.assert_allclose(hot, ref_hot, rtol=1e-4, atol=1e-5)


def test_training_mode_gradients_and_an_optimizer_step_match_torch():
    """Batch statistics, their running averages, every gradient and an SGD step with momentum, as torch."""
    model = net(3).train()
    em = ember.from_torch(model)
    assert em.training
    before = {name: b.clone() for name, b in model.named_buffers()}  # ember's updates do not write torch's
    x, target = images(4, 4), np.random.default_rng(5).integers(0, 5, size=4)
    opt_t = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_e = ember.optim.SGD(em.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        # ember first, all of it computed: its pending graph reads the shared memory that torch's step then
        # writes in place (the running statistics in its forward, the parameters in its update)
        loss_e = ember.nn.functional.nll_loss(em(ember.tensor(x)), ember.tensor(target))
        opt_e.zero_grad()
        loss_e.backward()
        grads_e = {n: p.grad.numpy() for n, p in em.named_parameters()}
        buffers_e = {n: b.numpy() for n, b in em.named_buffers()}
        opt_e.step()
        ember.realize(*em.parameters())
        loss_t = TF.nll_loss(model(torch.from_numpy(x)), torch.from_numpy(target))
        opt_t.zero_grad()
        loss_t.backward()
        np.testing.assert_allclose(loss_e.item(), loss_t.item(), rtol=1e-5)
        for name, p in model.named_parameters():
            np.testing.assert_allclose(grads_e[name], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
        for name, b in model.named_buffers():
            np.testing.assert_allclose(buffers_e[name], b.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
        opt_t.step()
    trained = dict(model.named_parameters())
    for name, p in em.named_parameters():
        np.testing.assert_allclose(p.numpy(), trained[name].detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    assert any(not torch.equal(before[n], b) for n, b in model.named_buffers())


class Modes(tnn.Module):
    """Reads its training mode three ways torch.fx fixes at the trace: a dropout's flag, a branch, a submodule's
    own mode (a frozen batch norm); and draws Monte Carlo dropout in either mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = tnn.Linear(6, 6)
        self.bn = tnn.BatchNorm1d(6)

    def forward(self, x):
        x = TF.dropout(self.fc(x), 0.5, self.training)
        x = self.bn(x) * (2.0 if self.training else 3.0)
        return x, TF.dropout(x, 0.5, training=True)


def test_the_imported_module_follows_the_training_mode_of_each_of_its_modules():
    torch.manual_seed(12)
    model = Modes()
    model.bn.eval()  # frozen statistics inside a model that trains
    em = ember.from_torch(model)
    assert em.training and not em.bn.training
    assert len(em._ember_graphs) == 1  # traced once at import, in the modes the torch modules had
    x = np.random.default_rng(13).uniform(-1, 1, size=(64, 6)).astype(np.float32)
    got = em(ember.tensor(x))[0].numpy()
    dropped = got == 0
    assert 0.3 < dropped.mean() < 0.7  # the first dropout, in training mode
    with torch.no_grad():
        h = model.fc(torch.from_numpy(x)) * torch.from_numpy(~dropped) * 2.0
        np.testing.assert_allclose(got, (model.bn(h) * 2.0).numpy(), rtol=1e-5, atol=1e-5)
    em.eval()
    model.eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(x))[0].numpy()  # no dropout, the running statistics, the eval branch (x 3)
    out, mc = em(ember.tensor(x))
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)
    assert 0.3 < (mc.numpy() == 0).mean() < 0.7  # training=True stays on in eval mode, as in torch
    assert len(em._ember_graphs) == 2  # traced again for the new modes, once
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        em(ember.tensor(x), scale=2.0)  # an unknown argument is torch's error, not ignored


def test_tied_weights_extra_arguments_attributes_and_unused_layers():
    class Tied(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = tnn.Embedding(10, 4)
            self.head = tnn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # one parameter, two layers
            self.aux = tnn.Linear(4, 2)  # never called: still in the state dict
            self.blocks = tnn.Sequential(tnn.Linear(4, 4), tnn.Tanh())

        def forward(self, ids, *scales, shift=0.0):
            h = self.emb(ids).to(self.head.weight.dtype)  # an attribute of a layer read before calling it
            h = self.blocks(h) + torch.ones(4) * shift  # a constant torch.fx would set on the model
            return self.head(h * scales[0] * scales[1])

    torch.manual_seed(14)
    model = Tied()
    em = ember.from_torch(model)
    assert [n for n, _ in em.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(em.state_dict()) == list(model.state_dict())
    assert em.emb.weight is em.head.weight
    assert not [name for name in vars(model) if name.startswith("_tensor_constant")]  # the torch model is as it was
    assert isinstance(em.blocks, ember.nn.Sequential)
    ids = np.random.default_rng(15).integers(0, 10, size=(3, 5))
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), 2.0, 0.5, shift=0.25).numpy()
    got = em(ember.tensor(ids), 2.0, 0.5, shift=0.25)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
    got.sum().backward()  # the tied weight's gradient adds both uses
    want = model(torch.from_numpy(ids), 2.0, 0.5, shift=0.25).sum()
    want.backward()
    np.testing.assert_allclose(em.emb.weight.grad.numpy(), model.emb.weight.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(em.blocks[0](ember.tensor(np.ones((1, 4), np.float32))).numpy(),
                               model.blocks[0](torch.ones(1, 4)).detach().numpy(), rtol=1e-6)


def test_a_sequential_of_the_new_layers_and_a_traced_child():
    class Scaled(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = tnn.LayerNorm(12)
            self.register_buffer("shift", torch.linspace(-1, 1, 12))

        def forward(self, x):
            return self.norm(x).mul(2.0) + self.shift.unsqueeze(0)

    torch.manual_seed(8)
    model = tnn.Sequential(tnn.Conv2d(3, 4, 3, stride=2), tnn.BatchNorm2d(4), tnn.SiLU(),
                           tnn.ConvTranspose2d(4, 3, 2, stride=2), tnn.MaxPool2d(2), tnn.AvgPool2d(2, ceil_mode=True),
                           tnn.Flatten(), tnn.Linear(27, 12), Scaled(), tnn.Softmax(dim=1)).eval()
    em = ember.from_torch(model)
    assert isinstance(em, ember.nn.Sequential)
    assert list(em.state_dict()) == list(model.state_dict())
    x = images(2, 9, size=11)
    ref = model(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), ref, rtol=1e-4, atol=1e-6)

    torch.manual_seed(10)
    words = tnn.Sequential(tnn.Embedding(20, 6, padding_idx=0), tnn.Flatten(), tnn.Linear(18, 4), tnn.LogSoftmax(1))
    ids = np.random.default_rng(11).integers(0, 20, size=(5, 3))
    ref = words(torch.from_numpy(ids)).detach().numpy()
    np.testing.assert_allclose(ember.from_torch(words)(ember.tensor(ids)).numpy(), ref, rtol=1e-5, atol=1e-6)


def test_errors_name_every_part_that_cannot_be_imported():
    class Odd(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = tnn.GRU(4, 4)
            self.fc = tnn.Linear(4, 4)

        def forward(self, x):
            x = TF.softsign(self.fc(x))
            return x.type_as(x) + torch.fft.fft(x).real

    model = tnn.Sequential(tnn.Linear(4, 4), Odd(), tnn.Sequential(tnn.SELU()))
    with pytest.raises(TypeError) as caught:
        ember.from_torch(model, via="fx")
    text = str(caught.value)
    assert "cannot import Sequential" in text
    assert "1 (Odd): torch.nn.functional.softsign has no ember equivalent" in text
    assert "Tensor.type_as has no ember equivalent" in text and "fft" in text
    assert "unsupported layer 2.0: SELU" in text

    class Branchy(tnn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    # imported through torch.export instead, the model fails on what ember lacks there (the FFT), and the error
    # says why the layer-by-layer import refused it too
    with pytest.raises(TypeError) as caught:
        ember.from_torch(model, example_inputs=(ember.randn(3, 4),))
    text = str(caught.value)
    assert "cannot import Sequential through torch.export" in text and "no ember op for aten._fft_r2c" in text
    assert "imported layer by layer it was refused: 1 (Odd): torch.nn.functional.softsign" in text

    with pytest.raises(TypeError, match=r"\(the model\): the forward of Branchy cannot be traced by torch.fx"):
        ember.from_torch(Branchy(), via="fx")
    with pytest.raises(TypeError, match=r"unsupported layer pair: Bilinear"):
        class Pairwise(tnn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.pair = tnn.Bilinear(4, 4, 2)

            def forward(self, x):
                return self.pair(x, x)

        ember.from_torch(Pairwise(), via="fx")
    with pytest.raises(TypeError, match="EmbeddingBag: EmbeddingBag: max_norm, scale_grad_by_freq and sparse are not "
                                        "supported"):
        ember.from_torch(tnn.Sequential(tnn.EmbeddingBag(4, 2, max_norm=1.0)), via="fx")
    with pytest.raises(ValueError, match="via must be"):
        ember.from_torch(Branchy(), via="onnx")


def test_a_torch_layer_the_forward_never_calls_is_left_out():
    class Holding(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = tnn.Linear(3, 2)
            self.pair = tnn.Bilinear(3, 3, 3)  # no ember equivalent, but never called

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(16)
    model = Holding().eval()
    em = ember.from_torch(model)
    x = np.random.default_rng(17).uniform(-1, 1, size=(4, 3)).astype(np.float32)
    ref = model(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), ref, rtol=1e-6)
    assert not em.training and [n for n, _ in em.named_parameters()] == ["fc.weight", "fc.bias"]


def test_an_error_while_running_names_the_traced_step():
    class Wrong(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = tnn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) + x  # (n, 3) + (n, 4)

    em = ember.from_torch(Wrong())
    with pytest.raises(ember.ShapeError) as caught:
        em(ember.tensor(np.ones((2, 4), np.float32)))
    assert "in the forward of Wrong imported from torch, at add" in "".join(caught.value.__notes__)


class Residual(tnn.Sequential):
    """A Sequential with a forward of its own (timm's DenseStage, torchvision's ASPPPooling): not a chain."""

    def forward(self, x):
        return x + 0.5 * super().forward(x)


class ConvAct(tnn.Sequential):
    """A Sequential subclass that only chains its layers (torchvision's Conv2dNormActivation)."""

    def __init__(self, c: int) -> None:
        super().__init__(tnn.Conv2d(c, c, 1), tnn.BatchNorm2d(c), tnn.ReLU())


class HoldsResidual(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = tnn.Linear(5, 5)
        self.res = Residual(tnn.Linear(5, 5), tnn.Tanh())
        self.deep = tnn.Sequential(Residual(tnn.Linear(5, 5), tnn.Sigmoid()))

    def forward(self, x):
        return self.deep(self.res(self.fc(x))) * 2.0


def residual() -> Residual:
    return Residual(tnn.Linear(5, 5), tnn.Tanh())


def assert_forward_and_gradients_match(model, em, x: np.ndarray) -> None:
    weights = np.random.default_rng(21).uniform(-1, 1, size=model(torch.from_numpy(x)).shape).astype(np.float32)
    want = model(torch.from_numpy(x))
    (want * torch.from_numpy(weights)).sum().backward()
    got = em(ember.tensor(x))
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    (got * ember.tensor(weights)).sum().backward()
    grads = dict(model.named_parameters())
    assert [n for n, _ in em.named_parameters()] == list(grads)
    # a bias before a norm has a gradient of rounding noise only: what is near zero is compared on the scale of the
    # model's gradients
    atol = 1e-6 * max([1.0] + [float(g.grad.abs().max()) for g in grads.values() if g.grad is not None])
    for name, p in em.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), grads[name].grad.numpy(), rtol=1e-4, atol=atol, err_msg=name)


@pytest.mark.parametrize("where", ["the root", "a Sequential", "two Sequentials", "a traced module"])
def test_a_sequential_subclass_with_its_own_forward_keeps_it(where):
    torch.manual_seed(20)
    model = {"the root": residual,
             "a Sequential": lambda: tnn.Sequential(tnn.Linear(5, 5), residual(), tnn.Linear(5, 3)),
             "two Sequentials": lambda: tnn.Sequential(tnn.Sequential(tnn.ReLU(), residual()), tnn.Linear(5, 3)),
             "a traced module": HoldsResidual}[where]()
    em = ember.from_torch(model)
    x = np.random.default_rng(22).uniform(-2, 2, size=(4, 5)).astype(np.float32)
    assert_forward_and_gradients_match(model, em, x)
    if where == "a traced module":  # the inner Residual still runs on its own
        np.testing.assert_allclose(em.res(ember.tensor(x)).numpy(), model.res(torch.from_numpy(x)).detach().numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_a_sequential_subclass_that_only_chains_its_layers_is_an_ember_sequential():
    torch.manual_seed(23)
    model = ConvAct(3).eval()
    em = ember.from_torch(model)
    assert isinstance(em, ember.nn.Sequential)
    x = images(2, 24, size=4)
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), model(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)


class Shifted(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = tnn.Linear(5, 5)
        self.scale = tnn.Parameter(torch.tensor(0.75))
        self.register_buffer("shift", torch.linspace(-1, 1, 5))

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale + self.shift + torch.ones(5)  # a constant torch.fx holds


class Stack(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = tnn.Sequential(Shifted(), tnn.ReLU(), residual())
        self.head = tnn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.body(x) + x)


class KeepsShiftedWhole(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname: str) -> bool:
        return isinstance(m, Shifted) or super().is_leaf_module(m, qualname)


class Wraps(tnn.Module):
    def __init__(self, gm) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, x):
        return self.gm(x) * 2.0


@pytest.mark.parametrize("how", ["symbolic_trace", "a tracer keeping a module whole", "wrapped in a module"])
def test_a_graph_module_runs_its_own_graph(how):
    """Its layers, parameters and buffers sit at the paths its graph names, under plain torch Modules."""
    torch.manual_seed(25)
    model = Stack()
    if how == "a tracer keeping a module whole":
        gm = torch.fx.GraphModule(model, KeepsShiftedWhole().trace(model))
    else:
        gm = torch.fx.symbolic_trace(model)
    model = Wraps(gm) if how == "wrapped in a module" else gm
    em = ember.from_torch(model)
    assert list(em.state_dict()) == list(model.state_dict())
    x = np.random.default_rng(26).uniform(-2, 2, size=(4, 5)).astype(np.float32)
    assert_forward_and_gradients_match(model, em, x)


def test_an_import_error_names_each_unsupported_layer_and_function_once():
    """A layer in a Sequential that a traced forward calls is seen from both; the error lists it once."""

    class Inverted(tnn.Module):  # a MobileNet-like block of layers ember lacks: SELU, Softsign
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv = tnn.Sequential(tnn.Sequential(tnn.Conv2d(c, c, 1), tnn.SELU()), tnn.Conv2d(c, c, 1))
            self.act = tnn.Softsign()

        def forward(self, x):
            return x + TF.celu(self.act(self.conv(x)))

    class Mobile(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = tnn.Sequential(tnn.Sequential(tnn.Conv2d(3, 4, 1), tnn.SELU()), Inverted(4), Inverted(4))

        def forward(self, x):
            return self.features(x).mean((2, 3))

    with pytest.raises(TypeError) as caught:
        ember.from_torch(Mobile(), via="fx")
    text = str(caught.value)
    for path in ["features.0.1", "features.1.conv.0.1", "features.2.conv.0.1"]:
        assert text.count(f"unsupported layer {path}: SELU") == 1
    for block in ["features.1", "features.2"]:
        assert text.count(f"unsupported layer {block}.act: Softsign") == 1
        assert text.count(f"{block} (Inverted): torch.nn.functional.celu has no ember equivalent") == 1
    assert text.count("SELU") == 3 and text.count("Softsign") == 2 and text.count("celu") == 2


Outputs = namedtuple("Outputs", ["logits", "aux_logits"])


class WithAuxiliary(tnn.Module):
    """GoogLeNet's way: in training, the logits and an auxiliary classifier's as a named tuple; in eval, the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = tnn.Linear(5, 8), tnn.Linear(8, 3), tnn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return Outputs(self.head(h), self.aux(h)) if self.training else self.head(h)


def test_a_named_tuple_of_outputs_is_the_same_named_tuple_of_ember_tensors():
    torch.manual_seed(3)
    model = WithAuxiliary()
    em = ember.from_torch(model)
    x = np.random.default_rng(4).standard_normal((2, 5)).astype(np.float32)
    out, expected = em(ember.tensor(x)), model(torch.from_numpy(x))
    assert type(out) is Outputs and isinstance(out.aux_logits, ember.Tensor)
    for mine, theirs in zip(out, expected):
        np.testing.assert_allclose(mine.numpy(), theirs.detach().numpy(), rtol=1e-6)
    em.eval()
    model.eval()
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), model(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)  # float32: the linear layer's sums in another order


def test_torchvision_stochastic_depth_imports_layer_by_layer():
    from model_libraries import library

    ops = library("torchvision").ops

    class Residual(tnn.Module):  # EfficientNet's and ConvNeXt's blocks: a branch dropped per sample in training
        def __init__(self) -> None:
            super().__init__()
            self.branch, self.drop = tnn.Linear(4, 4), ops.StochasticDepth(0.5, "row")

        def forward(self, x):
            return x + self.drop(self.branch(x))

    model = Residual()
    em = ember.from_torch(model, via="fx")
    x = np.random.default_rng(5).standard_normal((32, 4)).astype(np.float32)
    branch = em.branch(ember.tensor(x)).numpy()
    kept = em(ember.tensor(x)).numpy() - x  # each sample's branch dropped or doubled, as torch draws it
    assert np.all(np.isclose(kept, 0, atol=1e-6).all(1) | np.isclose(kept, 2 * branch, atol=1e-6).all(1))
    em.eval()
    model.eval()
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), model(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)  # float32: the linear layer's sums in another order


# -- attention and transformer layers, and torch._assert ------------------------------------------------------

class PatchViT(tnn.Module):
    """A miniature ViT as torchvision writes one: patches by a strided convolution, a class token, learned
    positions, an input-shape check (torch._assert), a pre-norm encoder of GELU layers, a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = tnn.Conv2d(3, 16, 4, 4)
        self.cls = tnn.Parameter(torch.randn(1, 1, 16))
        self.pos = tnn.Parameter(torch.randn(1, 5, 16))
        layer = tnn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation="gelu", batch_first=True,
                                            norm_first=True)
        self.encoder = tnn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = tnn.Linear(16, 10)

    def forward(self, x):
        n, _, h, _ = x.shape
        torch._assert(h == 8, "expected images of height 8")
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(n, -1, -1), x], dim=1) + self.pos
        return self.head(self.encoder(x)[:, 0])


def test_a_vit_with_an_input_check_imports_and_trains_as_torch():
    torch.manual_seed(0)
    model = PatchViT().eval()
    em = ember.from_torch(model)
    assert list(em.state_dict()) == list(model.state_dict())
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert_forward_and_gradients_match(model, em, x)
    with pytest.raises(AssertionError, match="expected images of height 8"):
        em(ember.tensor(np.ones((2, 3, 12, 12), np.float32)))


@pytest.mark.parametrize("layer", ["attention", "encoder layer", "decoder layer", "encoder", "transformer"])
def test_attention_and_transformer_layers_import_with_their_parameters_shared(layer):
    torch.manual_seed(1)
    make = {
        "attention": lambda: tnn.MultiheadAttention(16, 4, batch_first=True),
        "encoder layer": lambda: tnn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, norm_first=True),
        "decoder layer": lambda: tnn.TransformerDecoderLayer(16, 2, 24, dropout=0.0, activation=tnn.GELU()),
        "encoder": lambda: tnn.TransformerEncoder(tnn.TransformerEncoderLayer(16, 4, 24, dropout=0.0), 2,
                                                  norm=tnn.LayerNorm(16), enable_nested_tensor=False),
        "transformer": lambda: tnn.Transformer(16, 4, 1, 1, 24, dropout=0.0),
    }[layer]
    model = make().eval()
    em = ember.from_torch(model)
    assert list(em.state_dict()) == list(model.state_dict())
    x = np.random.default_rng(4).standard_normal((3, 5, 16)).astype(np.float32)
    arguments = {"attention": 3, "decoder layer": 2, "transformer": 2}.get(layer, 1)
    want = model(*[torch.from_numpy(x)] * arguments)
    got = em(*[ember.tensor(x)] * arguments)
    want, got = (want[0], got[0]) if layer == "attention" else (want, got)
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the parameters are torch's memory: a change there is seen here
        next(iter(model.parameters())).add_(1.0)
    np.testing.assert_array_equal(next(iter(em.parameters())).numpy(), next(iter(model.parameters())).detach().numpy())


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_group_and_instance_norms_1d_layers_and_resampling_import(kind):
    torch.manual_seed(2)
    if kind == "1d":
        model = tnn.Sequential(tnn.Conv1d(3, 8, 3, padding=1, groups=1), tnn.GroupNorm(4, 8), tnn.ReLU(),
                               tnn.MaxPool1d(2), tnn.Conv1d(8, 8, 3, groups=2), tnn.InstanceNorm1d(8, affine=True),
                               tnn.AvgPool1d(2), tnn.AdaptiveAvgPool1d(2), tnn.AdaptiveMaxPool1d(1))
        x = np.random.default_rng(5).standard_normal((2, 3, 17)).astype(np.float32)
    else:
        model = tnn.Sequential(tnn.Conv2d(3, 4, 3), tnn.InstanceNorm2d(4, affine=True), tnn.GroupNorm(2, 4),
                               tnn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                               tnn.AdaptiveMaxPool2d((3, 2)))
        x = np.random.default_rng(6).standard_normal((2, 3, 7, 6)).astype(np.float32)
    model.train()
    em = ember.from_torch(model)
    assert list(em.state_dict()) == list(model.state_dict())
    assert_forward_and_gradients_match(model, em, x)


def test_a_mobilenet_style_block_of_the_new_activations_imports():
    """MobileNetV3's pieces: hard-swish and hard-sigmoid gates, ReLU6, PReLU, a pixel shuffle, zero padding."""
    torch.manual_seed(3)
    model = tnn.Sequential(tnn.ZeroPad2d(1), tnn.Conv2d(3, 8, 3), tnn.Hardswish(), tnn.Conv2d(8, 8, 1), tnn.ReLU6(),
                           tnn.PReLU(8), tnn.PixelShuffle(2), tnn.Hardsigmoid(), tnn.Mish(), tnn.ELU(0.5),
                           tnn.Hardtanh(-0.5, 0.5), tnn.Dropout2d(0.0), tnn.Flatten(), tnn.Unflatten(1, (2, -1)),
                           tnn.GLU(1))
    em = ember.from_torch(model)
    assert list(em.state_dict()) == list(model.state_dict())
    x = np.random.default_rng(7).standard_normal((2, 3, 5, 5)).astype(np.float32) * 3
    assert_forward_and_gradients_match(model, em, x)


# -- forwards written for torch's own runs: a cache kept between calls, out=None passed on -------------------------

class CachedBias(tnn.Module):
    """LeViT's attention: in eval mode, a bias gathered from a table once and kept on the module by device."""

    def __init__(self) -> None:
        super().__init__()
        self.table = tnn.Parameter(torch.randn(4))
        self.register_buffer("index", torch.tensor([3, 0, 2, 1]))
        self.cache: dict[str, object] = {}

    def bias(self, device):
        if self.training:
            return self.table[self.index]
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.table[self.index]
        return self.cache[key]

    def forward(self, x):
        return x + self.bias(x.device)


class CachedBiasTwice(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = tnn.Sequential(tnn.Linear(4, 4), CachedBias())

    def forward(self, x):
        return self.inner(x).relu()


def test_a_forward_that_caches_a_value_on_its_module_is_imported_through_export():
    """Traced on its own and again inside its parent's forward, the module's second trace would read a value of the
    first from the cache: the layer-by-layer import refuses it, and the export (which runs the cache's branch once)
    takes the model."""
    torch.manual_seed(4)
    model = CachedBiasTwice().eval()
    em = ember.from_torch(model)
    assert type(em).__name__ == "Exported"
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(em(ember.tensor(x)).numpy(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"inner.1 \(CachedBias\): the trace reads a value an earlier trace left"):
        ember.from_torch(CachedBiasTwice().eval(), via="fx")


def test_torch_functions_that_record_their_out_argument_import():
    """F.normalize records itself with `out=None` (torch's output-buffer argument) in a torch.fx trace."""

    class Cosine(tnn.Module):
        def forward(self, q, k):
            return TF.normalize(q, dim=-1) @ TF.normalize(k, dim=-1).transpose(-2, -1)

    rng = np.random.default_rng(9)
    q, k = (rng.standard_normal((2, 3, 5)).astype(np.float32) for _ in range(2))
    em = ember.from_torch(Cosine())
    assert type(em).__name__ == "Traced"
    expected = Cosine()(torch.from_numpy(q), torch.from_numpy(k)).numpy()
    np.testing.assert_allclose(em(ember.tensor(q), ember.tensor(k)).numpy(), expected, rtol=1e-5, atol=1e-6)
