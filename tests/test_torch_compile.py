"""torch.compile(..., backend="ember"): torch training and inference code run by ember, against torch eager on the
same weights and batches (the cpu device here; the same models on a GPU's cuda device in the GPU suite)."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
from conftest import ON_GPU

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import ember.frontends.dynamo  # noqa: E402,F401  (registers the backend where the entry point is not installed)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
DEVICES = ["cpu", *([pytest.param("cuda", marks=pytest.mark.gpu)] if ON_GPU else [])]


class Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int = 50, context: int = 16, d: int = 32) -> None:
        super().__init__()
        self.embedding, self.position = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.embedding(idx) + self.position(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(h))).reshape(-1, self.head.out_features)


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, stride=2, groups=2, bias=False), nn.BatchNorm2d(8), nn.Hardswish(),
                         nn.AvgPool2d(2, ceil_mode=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def case(name: str, device: str):
    torch.manual_seed(0)
    if name == "cnn":
        return cnn().to(device), torch.randn(4, 3, 16, 16, device=device), torch.randint(0, 10, (4,), device=device)
    return (GPT().to(device), torch.randint(0, 50, (2, 16), device=device),
            torch.randint(0, 50, (32,), device=device))


def mlp(device: str):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)).to(device)
    return net, torch.randn(6, 8, device=device), torch.randint(0, 10, (6,), device=device)


def train(model, x, y, compiled: bool, steps: int = 3, optimizer=torch.optim.SGD, whole_step: bool = False,
          set_to_none: bool = True):
    """Losses and the final state of `steps` training steps; the forward and backward compiled by ember
    (`compiled`), and the optimizer's update with them (`whole_step`); gradients zeroed in place where not
    `set_to_none`."""
    opt = optimizer(model.parameters(), lr=0.05) if optimizer is not torch.optim.SGD else optimizer(
        model.parameters(), lr=0.05, momentum=0.9)

    def forward_backward(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def step(x, y):
        opt.zero_grad(set_to_none=set_to_none)
        loss = forward_backward(x, y)
        opt.step()
        return loss

    if whole_step:
        run = torch.compile(step, backend="ember") if compiled else step
    else:
        inner = torch.compile(forward_backward, backend="ember") if compiled else forward_backward

        def run(x, y):
            opt.zero_grad(set_to_none=set_to_none)
            loss = inner(x, y)
            opt.step()
            return loss
    losses = [run(x, y).item() for _ in range(steps)]
    return losses, {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def assert_same_training(expected, got, rtol=1e-4):
    (losses, state), (my_losses, my_state) = expected, got
    np.testing.assert_allclose(my_losses, losses, rtol=rtol)
    for k in state:
        scale = max(np.abs(state[k]).max(), 1e-6)
        np.testing.assert_allclose(my_state[k] / scale, state[k] / scale, atol=rtol, err_msg=k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["cnn", pytest.param("gpt", marks=pytest.mark.slow)])
def test_training_through_the_ember_backend_matches_torch_eager(model, device):
    net, x, y = case(model, device)
    expected = train(copy.deepcopy(net), x, y, compiled=False)
    assert_same_training(expected, train(net, x, y, compiled=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_a_whole_step_with_its_optimizer_update_compiles_to_ember(device, optimizer):
    # AdamW on an MLP: in the cnn and the GPT some parameters (a bias before a batch norm, the keys' bias) have
    # gradients of rounding noise only, which Adam scales to full steps of either sign in any two implementations
    net, x, y = case("cnn", device) if optimizer == "SGD" else mlp(device)
    kind = getattr(torch.optim, optimizer)
    expected = train(copy.deepcopy(net), x, y, False, optimizer=kind, whole_step=True)
    assert_same_training(expected, train(net, x, y, True, optimizer=kind, whole_step=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_the_inputs_a_graph_writes_get_their_values_in_multi_tensor_copies_of_one_kind_each(device, optimizer,
                                                                                           monkeypatch):
    """The inputs a graph writes (batch norms' running statistics and int64 counters, parameters, momenta, Adam's
    step counts) and does not write in place (ember.jit's write_into_arguments, on replays) are copied back in
    lists torch copies in one multi-tensor pass each (one device and dtype, sizes and strides alike pair by pair):
    a mixed list is copied tensor by tensor. The training still matches eager."""
    calls = []
    copy_lists = torch._foreach_copy_

    def spy(targets, values, *args, **kwargs):
        calls.append(({(t.device, t.dtype) for t in targets}, {(v.device, v.dtype) for v in values},
                      all(t.shape == v.shape and t.stride() == v.stride() for t, v in zip(targets, values))))
        return copy_lists(targets, values, *args, **kwargs)

    net, x, y = case("cnn", device)
    kind = getattr(torch.optim, optimizer)
    expected = train(copy.deepcopy(net), x, y, False, optimizer=kind, whole_step=True)
    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    got = train(net, x, y, True, optimizer=kind, whole_step=True)
    monkeypatch.undo()
    if optimizer == "SGD":
        assert_same_training(expected, got)
    else:  # (see the test above: rounding noise as full steps, which the later steps' statistics see)
        np.testing.assert_allclose(got[0][0], expected[0][0], rtol=1e-4)
        np.testing.assert_array_equal(got[1]["1.num_batches_tracked"], expected[1]["1.num_batches_tracked"])
    assert calls  # (the first calls record: they copy every value written)
    assert all(len(targets) == 1 and len(values) == 1 and alike for targets, values, alike in calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_gradients_zeroed_in_place_and_first_momenta_are_tensors_of_their_own(device, optimizer):
    """`zero_grad(set_to_none=False)` keeps each parameter's `.grad` and zeroes it in place; SGD's first momentum
    is `clone(grad)`, which ember computes as the gradient's own value: handed to torch as the gradient's memory,
    zeroing the gradient would zero the momentum. Each new tensor a graph returns is torch's own."""
    net, x, y = case("cnn", device) if optimizer == "SGD" else mlp(device)  # AdamW: see the test above
    kind = getattr(torch.optim, optimizer)
    for whole_step in (False, True):
        expected = train(copy.deepcopy(net), x, y, False, steps=4, optimizer=kind, whole_step=whole_step,
                         set_to_none=False)
        got = train(copy.deepcopy(net), x, y, True, steps=4, optimizer=kind, whole_step=whole_step,
                    set_to_none=False)
        assert_same_training(expected, got)


def test_each_graph_is_interpreted_once_and_built_from_its_template_on_new_batches(monkeypatch):
    from ember.frontends.aten_graph import AtenGraph

    interpreted = []
    run = AtenGraph._run
    monkeypatch.setattr(AtenGraph, "_run", lambda self, *args: interpreted.append(self) or run(self, *args))
    net, _, _ = case("cnn", "cpu")
    reference = copy.deepcopy(net)
    compiled = torch.compile(net, backend="ember")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (reference, net)]
    for _ in range(4):
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        losses = []
        for model, opt in zip((reference, compiled), opts):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    assert len(interpreted) == len(set(interpreted)) == 2  # the forward and the backward graph, each once
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(net.state_dict()[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_dropout_draws_a_new_mask_each_call_of_a_graph_built_from_its_template(monkeypatch):
    from ember.frontends.aten_graph import AtenGraph

    interpreted = []
    run = AtenGraph._run
    monkeypatch.setattr(AtenGraph, "_run", lambda self, *args: interpreted.append(self) or run(self, *args))
    net = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.25), nn.Linear(256, 8))
    compiled = torch.compile(net, backend="ember")
    x = torch.randn(16, 64, requires_grad=True)
    hidden = {}
    net[1].register_forward_hook(lambda m, i, o: hidden.update(out=o))  # the dropout's output, seen in torch
    masks = []
    for _ in range(3):
        compiled(x).sum().backward()
        masks.append((hidden["out"] != 0).numpy())
        x.grad = None
    assert all(abs(m.mean() - 0.75) < 0.03 for m in masks)
    assert (masks[0] != masks[1]).mean() > 0.2 and (masks[1] != masks[2]).mean() > 0.2
    assert len(set(interpreted)) == len(interpreted)


def test_inference_at_several_batch_sizes_and_in_eval_mode():
    net, x, _ = case("cnn", "cpu")
    net.eval()
    compiled = torch.compile(net, backend="ember")
    with torch.no_grad():
        for batch in (4, 1, 7):
            images = torch.randn(batch, 3, 16, 16)
            np.testing.assert_allclose(compiled(images).numpy(), net(images).numpy(), rtol=1e-4, atol=1e-5)


def test_a_graph_break_runs_its_python_in_torch_between_two_ember_graphs():
    torch.manual_seed(0)
    first, second = nn.Linear(6, 5), nn.Linear(5, 3)
    seen = []

    def forward(x):
        h = first(x).relu()
        seen.append(float(h.sum()))  # .item() on a value: dynamo breaks the graph here
        return second(h).tanh()

    x = torch.randn(4, 6)
    expected = forward(x)
    got = torch.compile(forward, backend="ember")(x)
    np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert len(seen) == 2 and seen[0] == pytest.approx(seen[1], rel=1e-5)


def test_explain_capture_around_a_step_sees_its_backward_run_on_another_thread():
    """On a GPU, autograd runs the backward on a thread of its own (here: a thread started for it): its plans are
    shown to the capture of the thread that ran the forward, and to no capture elsewhere."""
    import threading

    import ember

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(4, 6)
    compiled = torch.compile(lambda x: net(x).square().sum(), backend="ember")
    elsewhere: list = []

    def other_thread():  # a capture of its own, which the step's backward must not report to
        with ember.explain.capture() as plans:
            started.set()
            finished.wait(timeout=60)
        elsewhere.extend(plans)

    for call in range(2):  # the first call compiles the backward graph, the second runs it as built
        started, finished = threading.Event(), threading.Event()
        watcher = threading.Thread(target=other_thread)
        watcher.start()
        started.wait(timeout=60)
        with ember.explain.capture() as plans:
            loss = compiled(x)
            forward_only = len(plans)
            backward = threading.Thread(target=loss.backward)
            backward.start()
            backward.join()
        finished.set()
        watcher.join()
        assert forward_only >= 1 and len(plans) > forward_only, (call, forward_only, len(plans))
        assert not elsewhere
    grads = [p.grad.clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = None
    (net(x).square().sum() * 2).backward()  # two backward calls accumulated
    for got, want in zip(grads, (p.grad for p in net.parameters())):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_the_forward_saves_an_activations_input_and_output_and_the_backward_recomputes_what_lies_between(
        monkeypatch):
    """GPT-2's activation as transformers writes it: a chain of powers, a tanh and products between two Linear
    layers. The forward hands the backward the chain's input and its output (which the second layer's weight
    gradient reads), not the values between: those are recomputed where the backward's kernels need them."""
    import math

    import ember.frontends.dynamo as dynamo

    saved = []
    compile_graph = dynamo._compile

    def spy(gm, example_inputs, **options):
        if not saved:  # the forward graph: its outputs are the result, then what it saves for the backward
            (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
            saved.extend(tuple(o.meta["val"].shape) for o in outputs[1:] if isinstance(o.meta["val"], torch.Tensor))
        return compile_graph(gm, example_inputs, **options)

    monkeypatch.setattr(dynamo, "_compile", spy)
    torch._dynamo.reset()  # shapes static, as at a first compile

    class NewGELU(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), NewGELU(), nn.Linear(32, 4))
    reference = copy.deepcopy(net)
    x = torch.randn(6, 8)
    torch.compile(net, backend="ember")(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert saved.count((6, 32)) == 2, saved
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_operator_ember_lacks_is_named_in_the_error():
    compiled = torch.compile(lambda a: torch.linalg.cholesky(a @ a.mT + torch.eye(3)), backend="ember")
    with pytest.raises(Exception, match="no ember op for aten.linalg_cholesky"):
        compiled(torch.randn(3, 3))


def test_as_strided_on_views_trains_through_the_backend_as_torch():
    """AOTAutograd's backward of as_strided writes the gradient with as_strided_scatter into zeros and reads it
    back with as_strided: ember runs both by the layouts the graphs record."""
    def loss(x, w):
        h = (x * w).t()
        shifted = torch.as_strided(h, (3, 2), (1, 3), 1)
        return (shifted * shifted).sum() + torch.as_strided(x[:, ::2], (2, 2), (2, 1)).tanh().sum()

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    expected = loss(x, w)
    want = torch.autograd.grad(expected, (x, w))
    got = torch.compile(loss, backend="ember")(x, w)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    for g, e in zip(torch.autograd.grad(got, (x, w)), want):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a process of its own
def test_backend_ember_is_found_through_the_entry_point_in_a_fresh_process():
    code = ("import torch\n"
            "f = torch.compile(lambda x: (x * 1.5).relu().sum(0), backend='ember')\n"
            "print(f(torch.tensor([[1.0, -2.0], [3.0, 4.0]])).tolist())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[6.0, 6.0]"


@pytest.mark.parametrize("where", ["cpu", "cuda"])  # ember's device: the reference, or generated kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float64: no fused kernel takes it
@pytest.mark.parametrize("form", ["flash", "efficient", "cudnn"])
def test_the_attention_operators_of_torchs_gpu_kernels_run_as_ember_attention(form, dtype, where, request):
    """What AOTAutograd records on a GPU depends on the kernel torch picks there (FlashAttention, memory-efficient,
    cuDNN): each form's forward and backward operator, run by ember, against torch's attention. The forward hands
    its backward the rows' log-sum-exp, and the backward computes no attention forward again."""
    from ember.frontends.aten_graph import lookup
    from ember.ir import Op, toposort

    if where == "cuda":
        request.getfixturevalue("cuda_backend")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), grad)
    eq, ek, ev, eg = (ember.from_dlpack(t.detach().cpu()).to(where) for t in (q, k, v, grad))
    forward = lookup(getattr(torch.ops.aten, f"_scaled_dot_product_{form}_attention").default)
    backward = lookup(getattr(torch.ops.aten, f"_scaled_dot_product_{form}_attention_backward").default)
    mine = forward(eq, ek, ev, 0.0, True) if form == "flash" else forward(eq, ek, ev, None, True, 0.0, True)
    ember.realize(*(t for t in mine[:2] if isinstance(t, ember.Tensor)))  # as the forward graph's outputs
    if form == "flash":
        grads = backward(eg, eq, ek, ev, mine[0], mine[1], None, None, 5, 5, 0.0, True, None, None)
    elif form == "efficient":
        grads = backward(eg, eq, ek, ev, None, mine[0], mine[1], None, None, 0.0, [True, True, True, False], True)
    else:
        grads = backward(eg, eq, ek, ev, mine[0], mine[1], None, None, None, None, None, 5, 5, 0.0, True)
    assert not [n for n in toposort([g._node for g in grads[:3]]) if n.op is Op.ATTENTION]
    tolerance = dict(rtol=1e-9, atol=1e-12) if dtype is torch.float64 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mine[0].numpy(), out.detach().numpy(), **tolerance)
    for got, want in zip(grads[:3], expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), **tolerance)


def _dropped_attention_check(q, k, v, out, grads, grad, p: float) -> None:
    """With v the identity, an attention's output is its weights after dropout: those kept (about 1 - p of the
    causal ones) are torch's weights over 1 - p, and the gradients of q, k and v are those of the attention that
    dropped exactly the others."""
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool).tril().to(q.device)
    keep = out.detach() != 0
    kept = keep[..., causal].double().mean().item()
    assert abs(kept - (1 - p)) < 0.1, f"kept {kept:.3f} of the weights, expected about {1 - p}"
    assert not keep[..., ~causal].any()
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))  # the reference in float64
    weights = torch.softmax((qq @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5 + torch.zeros_like(
        causal, dtype=qq.dtype).masked_fill(~causal, float("-inf")), -1)
    expected = (weights * keep / (1 - p)) @ vv
    tolerance = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6),
                 torch.float16: dict(rtol=5e-3, atol=5e-3)}[q.dtype]
    np.testing.assert_allclose(out.detach().double().cpu().numpy(), expected.detach().cpu().numpy(), **tolerance)
    for got, want, name in zip(grads, torch.autograd.grad(expected, (qq, kk, vv), grad.double()), "qkv"):
        np.testing.assert_allclose(got.double().cpu().numpy(), want.cpu().numpy(), **tolerance,
                                   err_msg=f"gradient of {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_attention_with_dropout_trains_through_the_backend_dropping_the_same_weights_forward_and_back(device):
    """On the cpu AOTAutograd records the math decomposition (native_dropout); on a GPU the form of the kernel
    torch picks (memory-efficient attention for float32), whose backward gets ember's mask."""
    torch.manual_seed(0)
    p, length = 0.3, 16
    q, k = (torch.randn(2, 3, length, 8, device=device, requires_grad=True) for _ in range(2))
    v = torch.eye(length, device=device).expand(2, 3, length, length).clone().requires_grad_(True)
    attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True),
                           backend="ember")
    out = attend(q, k, v)
    grad = torch.randn_like(out)
    _dropped_attention_check(q, k, v, out, torch.autograd.grad(out, (q, k, v), grad), grad, p)
    assert (attend(q, k, v) != out).any()  # a new mask each call


@pytest.mark.parametrize("form, dtype", [("flash", torch.float64), ("flash", torch.float16),
                                         ("efficient", torch.float64), ("cudnn", torch.float64)])
def test_the_attention_operators_of_torchs_gpu_kernels_with_dropout_hand_their_backward_the_mask(form, dtype):
    from ember.frontends.aten_graph import lookup

    torch.manual_seed(1)
    p, length = 0.4, 16
    q, k = (torch.randn(2, 3, length, 8, dtype=dtype) for _ in range(2))
    v = torch.eye(length, dtype=dtype).expand(2, 3, length, length).clone()
    grad = torch.randn(2, 3, length, length, dtype=dtype)
    eq, ek, ev, eg = (ember.from_dlpack(t) for t in (q, k, v, grad))
    forward = lookup(getattr(torch.ops.aten, f"_scaled_dot_product_{form}_attention").default)
    backward = lookup(getattr(torch.ops.aten, f"_scaled_dot_product_{form}_attention_backward").default)
    if form == "flash":
        mine = forward(eq, ek, ev, p, True)
        grads = backward(eg, eq, ek, ev, mine[0], mine[1], None, None, length, length, p, True, mine[6], mine[7])
    elif form == "efficient":
        mine = forward(eq, ek, ev, None, True, p, True)
        grads = backward(eg, eq, ek, ev, None, mine[0], mine[1], mine[2], mine[3], p, [True, True, True, False], True)
    else:
        mine = forward(eq, ek, ev, None, True, p, True)
        grads = backward(eg, eq, ek, ev, mine[0], mine[1], mine[6], mine[7], None, None, None, length, length, p, True)
    out = torch.from_dlpack(mine[0])
    _dropped_attention_check(q, k, v, out, [torch.from_dlpack(g) for g in grads[:3]], grad, p)


@pytest.mark.parametrize("where", ["cpu", "cuda"])
@pytest.mark.parametrize("given", ["ember's", "torch's"])
def test_max_poolings_backward_reads_where_the_forward_found_each_maximum(given, where, request):
    """aten.max_pool2d_with_indices hands its backward, in the indices' place, the offset of each window's first
    maximum (one byte): the backward reads the windows no more. Indices torch computed (int64 positions) still give
    the gradient, derived from the input. Ties and padding as torch has them."""
    from ember.frontends.aten_graph import lookup
    from ember.ir import Op, toposort

    if where == "cuda":
        request.getfixturevalue("cuda_backend")
    torch.manual_seed(0)
    x = torch.randint(-3, 4, (2, 3, 9, 8)).float().requires_grad_(True)  # ties within windows
    args = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    out, indices = torch.ops.aten.max_pool2d_with_indices(x, *args)
    grad = torch.randn_like(out)
    expected = torch.ops.aten.max_pool2d_with_indices_backward(grad, x.detach(), *args, indices)
    ex, eg = (ember.from_dlpack(t.detach()).to(where) for t in (x, grad))
    mine = lookup(torch.ops.aten.max_pool2d_with_indices.default)(ex, *args)
    ember.realize(*mine)  # as the forward graph's outputs
    assert mine[1].dtype is ember.uint8
    handed = mine[1] if given == "ember's" else ember.from_dlpack(indices).to(where)
    dx = lookup(torch.ops.aten.max_pool2d_with_indices_backward.default)(eg, ex, *args, handed)
    maxima = [n for n in toposort([dx._node]) if n.op in (Op.MAX_POOL2D, Op.MAXIMUM)]
    assert bool(maxima) == (given == "torch's")
    np.testing.assert_array_equal(mine[0].numpy(), out.detach().numpy())
    np.testing.assert_allclose(dx.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
