"""torch.compile(..., backend="ember") on ember's cuda device: the path a GPU runs (generated kernels, ember.jit
replays, the boundary between torch's tensors and ember's), here through Triton's interpreter, where torch's cpu
tensors are the cuda device's memory (`options={"device": "cuda"}`). On a GPU the same tests run on torch's cuda
tensors."""

from __future__ import annotations

import contextlib
import copy
import importlib

import numpy as np
import pytest
from conftest import ON_GPU

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import ember  # noqa: E402
import ember.frontends.dynamo  # noqa: E402  (registers the backend where the entry point is not installed)

pytestmark = [pytest.mark.usefixtures("cuda_backend", "fresh_dynamo"), *([pytest.mark.gpu] if ON_GPU else [])]
DEVICE = "cuda" if ON_GPU else "cpu"  # torch's device; ember's is cuda either way
OPTIONS = {"device": "cuda"}


def block():
    """A ResNet stem's shape in miniature: convolution, batch norm, ReLU, twice, pooled and classified."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to(DEVICE)


def batch(seed: int, dtype=None):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 3, 8, 8, generator=generator).to(DEVICE, dtype),
            torch.randint(0, 10, (4,), generator=generator).to(DEVICE))


def train(model, compiled: bool, steps: int = 4, during_last=None, dtype=None) -> tuple[list[float], dict]:
    """Losses and final state of SGD steps with momentum, the whole step compiled by ember (`compiled`); the last
    step runs inside the context `during_last` gives, if any."""
    run = training_step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), compiled)
    losses = [run(*batch(i, dtype)).item() for i in range(steps - 1)]
    with during_last() if during_last else contextlib.nullcontext():
        losses.append(run(*batch(steps - 1, dtype)).item())
    return losses, {k: (v.float() if v.is_floating_point() else v).detach().cpu().numpy()
                    for k, v in model.state_dict().items()}


def training_step(model, opt, compiled: bool):
    """One training step of `model` by `opt` (cross entropy), compiled whole by ember where asked."""
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    return torch.compile(step, backend="ember", options=OPTIONS) if compiled else step


@contextlib.contextmanager
def counting_copies_into(tensors: list, counted: list):
    """Per-tensor copies (`Tensor.copy_`) into `tensors` made inside the block, appended to `counted`."""
    addresses = {t.data_ptr() for t in tensors}
    copy_ = torch.Tensor.copy_

    def counting(self, *args, **kwargs):
        if self.data_ptr() in addresses:
            counted.append(self)
        return copy_(self, *args, **kwargs)
    torch.Tensor.copy_ = counting
    try:
        yield
    finally:
        torch.Tensor.copy_ = copy_


def _graph_number(line: str) -> int:
    return int(line.split(":")[0].split()[1])  # "graph 3: ..."


def test_a_training_step_on_embers_cuda_device_replays_and_matches_torch_eager():
    """The forward and backward graphs replay (from their second call), and the tensors the step updates
    (parameters, running statistics) are written by ember at the end of its graphs, not by a copy per tensor in
    torch after them."""
    net = block()
    expected_losses, expected_state = train(copy.deepcopy(net), compiled=False)
    before = max(map(_graph_number, ember.frontends.dynamo.replay_report()), default=-1)
    copies = []
    held = [*net.parameters(), *net.buffers()]
    losses, state = train(net, compiled=True, during_last=lambda: counting_copies_into(held, copies))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    for name, value in expected_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # (graphs compiled earlier may be collected meanwhile: the report lists the live ones)
    report = [line for line in ember.frontends.dynamo.replay_report() if _graph_number(line) > before]
    assert len(report) >= 2 and all(" 0 replayed" not in line for line in report[:2]), report
    assert not copies


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_an_optimizer_steps_replays_write_parameters_and_state_into_torchs_tensors(optimizer, monkeypatch):
    """The graph of `opt.step()` computes each parameter's and each optimizer state's new value straight into
    torch's tensor on replays (the kernel computing it is the last to read the old value, element for element):
    nothing is copied into them after the graph, every value is torch eager's, and each parameter's version
    counter counts the write as torch's own in-place update would."""
    dynamo = importlib.import_module("ember.frontends.dynamo")
    copied = []
    copy_tensors = dynamo.copy_tensors
    monkeypatch.setattr(dynamo, "copy_tensors", lambda targets, values: (copied.extend(targets),
                                                                          copy_tensors(targets, values)))
    net = block()
    reference = copy.deepcopy(net)
    results = []
    for model in (reference, net):
        opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "SGD" else
               torch.optim.AdamW(model.parameters(), lr=0.01))
        run = training_step(model, opt, compiled=model is net)
        losses = [run(*batch(i)).item() for i in range(3)]  # recorded, then replayed
        copied.clear()
        versions = [p._version for p in model.parameters()]
        losses += [run(*batch(i)).item() for i in range(3, 6)]
        moved = [p._version - v for p, v in zip(model.parameters(), versions)]
        state = [t for group in opt.state.values() for t in group.values() if isinstance(t, torch.Tensor)]
        results.append((losses, [*model.parameters(), *state], moved))
    (expected, reference_values, eager_moved), (losses, values, moved) = results
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert all(m >= 3 for m in moved) and all(m >= 3 for m in eager_moved)  # three in-place updates each, at least
    for got, want in zip(values, reference_values):
        np.testing.assert_allclose(got.detach().float().cpu().numpy(), want.detach().float().cpu().numpy(),
                                   rtol=1e-4, atol=1e-5)
    written = {t.data_ptr() for t in values}
    assert not [t for t in copied if t.data_ptr() in written]


def _accumulate(total, x):
    total.mul_(0.5).add_(x.tanh())  # written in place: each new value where the old one was read
    return total.sum()


def test_inputs_written_in_place_stay_right_across_more_bindings_than_graphs_kept():
    """A graph that updates its input, called on more distinct input tensors than ember.jit keeps CUDA graphs
    for: each call writes the tensor it was given (the bindings beyond the kept graphs run launch by launch, never
    into copies of the program's own), and every value is torch eager's."""
    jit_module = importlib.import_module("ember.jit")
    run = torch.compile(_accumulate, backend="ember", options=OPTIONS)
    generator = torch.Generator().manual_seed(0)
    count = jit_module.GRAPHS_KEPT + 3
    mine = [torch.randn(5, 7, generator=generator).to(DEVICE) for _ in range(count)]
    theirs = [t.clone() for t in mine]
    for _ in range(2):
        for k in range(count):
            x = torch.randn(5, 7, generator=generator).to(DEVICE)
            np.testing.assert_allclose(run(mine[k], x).item(), _accumulate(theirs[k], x).item(), rtol=1e-4)
    for got, want in zip(mine, theirs):
        np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), rtol=1e-5, atol=1e-6)
    if ON_GPU:  # (elsewhere nothing is captured) the report counts the calls beyond the kept graphs
        from ember.frontends import dynamo

        assert any("run uncaptured" in line for line in dynamo.replay_report()), dynamo.replay_report()


def _update_one_read_another(p, q, r):
    p.mul_(0.5).add_(r)
    return q.sum() * 2


def test_an_input_written_in_place_under_dynamic_shapes_is_that_input():
    """Under dynamic shapes a graph takes its sizes before its tensors: the input a replay writes in place is
    found among the tensors (not at its position among all inputs), so the inputs it only reads keep their values
    and every call matches torch eager."""
    assert_updates_match_eager(_update_one_read_another, [(5, 7)] * 3, calls=4, dynamic=True)


@pytest.mark.parametrize("layout", ["transposed", "every other column"])
def test_an_input_not_contiguous_written_in_place_is_written_where_it_lies(layout):
    """An update of an input that does not lie contiguously (a transposed tensor, a strided slice of a larger one)
    is computed on a contiguous copy of it; the new value still lands in the input's own memory at every replay."""
    assert_updates_match_eager(_update_one_read_another, [(5, 7)] * 3, calls=4, layout=layout)


def _running_variance(x, running):
    running.mul_(0.9).add_(x.var(0) * 0.1)  # a batch norm's running variance, updated once the batch is summed
    return x.sum()


def test_a_running_statistic_updated_after_its_batchs_sums_is_written_where_it_lies(monkeypatch):
    """An input's update computed in the epilogue of a row kernel (a running variance after the batch's sums:
    each position read and written once, by the program reducing its row) is written into the input itself at
    each replay; only the calls before the replays copy it in after the graph. Every value is torch eager's."""
    from ember.frontends import dynamo

    copies, copy_tensors = [], dynamo.copy_tensors
    monkeypatch.setattr(dynamo, "copy_tensors", lambda targets, values: (copies.append(len(targets)),
                                                                         copy_tensors(targets, values)))
    assert_updates_match_eager(_running_variance, [(8, 5), (5,)], calls=6)
    assert len(copies) <= 2, copies  # the calls recorded, not the four replays


def _swap_pointwise(x, a, b):
    new_a, new_b = b * 0.5 + x, a * 0.5 + x  # each input's new value reads the other's old one
    a.copy_(new_a)
    b.copy_(new_b)
    return x.sum()


def _swap_after_sums(x, a, b):
    s = x.sum(0)
    new_a, new_b = b * 0.5 + s, a * 0.5 + s  # one row kernel's epilogue makes both
    a.copy_(new_a)
    b.copy_(new_b)
    return x.sum()


@pytest.mark.parametrize("fn, shapes", [(_swap_pointwise, [(64, 300)] * 3),
                                        (_swap_after_sums, [(8192, 5), (5,), (5,)])], ids=["pointwise", "row kernel"])
def test_inputs_updated_from_each_others_old_values_stay_right(fn, shapes):
    """Two inputs' new values made by one kernel, each from the other's old value: the one written in place first
    must not be read back as the other's old value (a kernel stores an output before it loads what only a later
    output reads; 8192 rows make the row kernel walk its columns in a loop)."""
    assert_updates_match_eager(fn, shapes, calls=4)


def _drift(x, running):
    running.add_((x + running.flip(0)).mean(0) * 0.1)  # the row kernel reads the old value at other columns
    return x.sum()


def test_an_update_whose_row_kernel_reads_the_old_value_at_other_positions_stays_right():
    """Where the row kernel computing an input's new value also reads the old value at other positions (another
    program's columns), a program writing its own columns must not change what another still reads: the values
    stay torch eager's (4,096 columns take several programs)."""
    assert_updates_match_eager(_drift, [(64, 4096), (4096,)], calls=4)


def assert_updates_match_eager(fn, shapes: list, calls: int, layout: str = "contiguous", **compile_options) -> None:
    """`fn`, compiled by ember and run `calls` times on inputs of `shapes` it updates in place, returns what torch
    eager's does and leaves every input as torch eager's does (inputs laid out as `layout` says: "contiguous",
    "transposed" or "every other column" of a tensor twice as wide)."""
    run = torch.compile(fn, backend="ember", options=OPTIONS, **compile_options)
    generator = torch.Generator().manual_seed(0)

    def laid_out(shape):
        if layout == "transposed":
            return torch.randn(*shape[::-1], generator=generator).to(DEVICE).t()
        if layout == "every other column":
            return torch.randn(*shape[:-1], 2 * shape[-1], generator=generator).to(DEVICE)[..., ::2]
        return torch.randn(*shape, generator=generator).to(DEVICE)
    mine = [laid_out(shape) for shape in shapes]
    theirs = [t.clone() for t in mine]
    for _ in range(calls):
        np.testing.assert_allclose(run(*mine).item(), fn(*theirs).item(), rtol=1e-4)
        for got, want in zip(mine, theirs):
            np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), rtol=1e-5, atol=1e-5)


def _update_read_elsewhere(x, y):
    x.add_(x.flip(0) * 0.5 + y)  # the new value reads the old one at other positions
    y.mul_(0.9)
    return x.sum()


def test_an_input_update_reading_the_old_value_elsewhere_is_not_written_in_place():
    """An update of an input whose new value reads the input's old value at other positions (a flip) cannot be
    written into the input while it is read: it stays a value of its own, copied in after the graph, and is
    right at every replay."""
    assert_updates_match_eager(_update_read_elsewhere, [(6, 5)] * 2, calls=5)


def test_results_handed_to_torch_are_its_own_and_cross_no_dlpack_capsule(monkeypatch):
    """Each call's outputs are torch tensors no later replay writes (those of ember.jit's buffers copied out
    together), and no tensor crosses the boundary through a DLPack capsule of its own: a graph's hundreds of
    inputs and outputs cost no per-tensor protocol every call."""
    net = block().eval()
    compiled = torch.compile(net, backend="ember", options=OPTIONS)
    images = [batch(i)[0] for i in range(4)]
    with torch.no_grad():
        compiled(images[0]), compiled(images[1])  # recorded: the next calls replay
        capsules = []
        monkeypatch.setattr(ember.Tensor, "__dlpack__", lambda self, **kw: capsules.append(self))
        outputs = [compiled(x) for x in images]
        expected = [net(x) for x in images]
    assert not capsules
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), rtol=1e-4, atol=1e-5)


def test_results_torch_lets_go_of_within_the_step_are_handed_over_without_a_copy(monkeypatch):
    """A training step's saved activations and gradients are results of ember.jit replays that torch drops within
    the step: they are handed to torch on the replay's own memory, no copy, so the backward and the optimizer step
    read them where the previous graph wrote them (the same buffers every step: one CUDA graph each, no inputs
    copied), and the values stay torch eager's."""
    jit_module = importlib.import_module("ember.jit")  # the module (ember.jit is also the function)
    from ember.runtime import dlpack, executor

    handed = {"shared": 0, "copied": 0}
    torch_buffers, replay_buffers = dlpack.torch_buffers, jit_module._Program.replay_buffers

    def counting(nodes):  # a replay of ember Tensors (a call that records, or the first after)
        replayed = [(n, n.buffer.data_ptr()) for n in nodes if n in executor.transient]
        out = torch_buffers(nodes)
        by_node = dict(zip(map(id, nodes), out))
        for n, address in replayed:
            handed["shared" if by_node[id(n)].data_ptr() == address else "copied"] += 1
        return out

    def counting_replays(program, buffers):  # a replay on torch's tensors as they are
        leaves = replay_buffers(program, buffers)
        own = {b.data_ptr() for results in program.results for b in results}
        for (kind, slot, _), leaf in zip(program.out_slots, leaves):
            if kind == "result" and leaf.numel() and slot not in program.into:  # (into: written in torch's input)
                handed["shared" if leaf.data_ptr() in own else "copied"] += 1
        return leaves
    monkeypatch.setattr(dlpack, "torch_buffers", counting)
    monkeypatch.setattr(jit_module._Program, "replay_buffers", counting_replays)
    net = block()
    reference = copy.deepcopy(net)
    x, y = batch(0)
    losses = []
    for model in (reference, net):
        run = training_step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                            compiled=model is net)
        losses.append([run(x, y).item() for _ in range(6)])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    assert handed["shared"] > 0 and handed["copied"] == 0, handed


def test_gradients_torch_keeps_across_steps_stay_right(monkeypatch):
    """`zero_grad(set_to_none=False)`: torch keeps each step's gradients in `.grad` and zeroes and accumulates into
    them in place, holding results of the backward's replays past the step; later replays write other buffers, and
    the training stays torch eager's."""
    net = block()
    reference = copy.deepcopy(net)
    losses, states = [], []
    for model in (reference, net):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step(x, y, model=model, opt=opt):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            return loss
        run = step if model is reference else torch.compile(step, backend="ember", options=OPTIONS)
        losses.append([run(*batch(i)).item() for i in range(6)])
        states.append({k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    for name, value in states[0].items():
        np.testing.assert_allclose(states[1][name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_graph_of_dynamic_shapes_replays_at_each_batch_size():
    """Once dynamo makes the batch size dynamic, a graph's inputs include its sizes (Python ints among the tensors):
    each batch size replays its own recording, on torch's tensors as they are, and matches torch."""
    net = block().eval()
    compiled = torch.compile(net, backend="ember", options=OPTIONS)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (2, 3, 5, 5, 5, 3, 3, 3, 5):
            x = torch.randn(n, 3, 8, 8, generator=generator).to(DEVICE)
            np.testing.assert_allclose(compiled(x).cpu().numpy(), net(x).cpu().numpy(), rtol=1e-4, atol=1e-5)


def _views(x):
    y = x * 2
    z = torch.sin(x)
    return y, y.view(-1), z.t(), z[1:]  # an output and its view; two views of a value the graph does not return


def _clone_then_write(x):
    y = x.clone()
    x.add_(1)
    return y


def _swap(a, b):
    t = a.clone()
    a.copy_(b)
    b.copy_(t)


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_outputs_share_memory_exactly_as_torchs_do(options):
    """What a graph returns shares memory where torch's outputs do and nowhere else: a view of an output, or two
    views of one value, see each other's in-place writes; a clone of an input keeps the input's old value when the
    graph then writes the input; inputs swapped through a clone are both right."""
    run = {f: torch.compile(f, backend="ember", options=options) for f in (_views, _clone_then_write, _swap)}
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):  # recorded, then replayed
        x = torch.randn(3, 4, generator=generator).to(DEVICE)
        with torch.no_grad():
            got, want = run[_views](x), _views(x)
            for outputs in (got, want):
                outputs[0][0, 0] = 100.0
                outputs[2][0, 0] = -100.0
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.cpu().numpy(), w.cpu().numpy(), rtol=1e-5, atol=1e-6)
        mine, theirs = x.clone(), x.clone()
        np.testing.assert_allclose(run[_clone_then_write](mine).cpu().numpy(), x.cpu().numpy(), rtol=1e-6)
        _clone_then_write(theirs)
        np.testing.assert_allclose(mine.cpu().numpy(), theirs.cpu().numpy(), rtol=1e-6)
        a, b = x.clone(), torch.randn(3, 4, generator=generator).to(DEVICE)
        a0, b0 = a.clone(), b.clone()
        run[_swap](a, b)
        np.testing.assert_array_equal(a.cpu().numpy(), b0.cpu().numpy())
        np.testing.assert_array_equal(b.cpu().numpy(), a0.cpu().numpy())


def _transposed_views(x):
    y = x.permute(0, 2, 1, 3) * 2  # torch keeps y's memory in x's order: y.transpose(1, 2) is contiguous
    return y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1), y


def _transposed_view_alone(x):
    y = x.permute(0, 2, 1, 3) * 2
    return y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1) + 0, y.transpose(1, 2).reshape(-1)


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (1, 5, 1, 4), (2, 1, 3, 1)])
def test_a_view_only_torchs_layout_of_its_value_allows_shares_memory_as_torchs(options, dynamic, shape):
    """A reshape of a transposed value that torch keeps transposed in memory (as it keeps an attention's output)
    is a view in torch only: the graph's outputs still share memory exactly where torch's do, the value comes back
    in torch's layout, and a view no other output shares is the graph's own value. Forward and backward, with
    static and symbolic sizes (the view's sizes are then inputs of the graph)."""
    run = {f: torch.compile(f, backend="ember", options=options, dynamic=dynamic)
           for f in (_transposed_views, _transposed_view_alone)}
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # recorded, then replayed
        x = torch.randn(*shape, generator=generator).to(DEVICE)
        with torch.no_grad():
            got, want = run[_transposed_views](x), _transposed_views(x)
            strides = [[s for s, n in zip(t.stride(), t.shape) if n > 1] for t in (got[1], want[1])]
            assert strides[0] == strides[1]  # (a dimension of size 1 has any stride)
            for outputs in (got, want):
                outputs[1].mul_(-3.0)  # the view sees it in both
            for g, w in zip(got, want):
                np.testing.assert_allclose(g.cpu().numpy(), w.cpu().numpy(), rtol=1e-6)
            got, want = run[_transposed_view_alone](x), _transposed_view_alone(x)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g.cpu().numpy(), w.cpu().numpy(), rtol=1e-6)
        mine, theirs = (x.clone().requires_grad_() for _ in range(2))
        weight = torch.randn(shape[0], shape[1], shape[2] * shape[3], generator=generator).to(DEVICE)
        for f, leaf in ((run[_transposed_views], mine), (_transposed_views, theirs)):
            a, b = f(leaf)
            ((a * weight).sum() + b.sin().sum()).backward()
        np.testing.assert_allclose(mine.grad.cpu().numpy(), theirs.grad.cpu().numpy(), rtol=1e-5, atol=1e-6)


def _channels_last_block(x, w):
    return torch.relu(torch.nn.functional.conv2d(x, w, padding=1) * 1.5 + x)


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_values_torch_keeps_channels_last_cross_the_boundary_in_that_layout_and_are_read_as_they_lie(options,
                                                                                                   monkeypatch):
    """Activations torch lays out channels-last come back channels-last (ember computes them in that memory order)
    and, saved for the backward, are read there as they lie: no input of a replayed graph needs a copy."""
    run = torch.compile(_channels_last_block, backend="ember", options=options)
    copied = []
    as_buffer = ember.frontends.dynamo._as_buffer
    monkeypatch.setattr(ember.frontends.dynamo, "_as_buffer", lambda t: copied.append(not t.is_contiguous())
                        or as_buffer(t))
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(2, 4, 5, 3, generator=generator).to(DEVICE).to(memory_format=torch.channels_last)
        w = torch.randn(4, 4, 3, 3, generator=generator).to(DEVICE)
        mine, theirs = (x.clone().requires_grad_() for _ in range(2))
        got, want = run(mine, w), _channels_last_block(theirs, w)
        assert got.stride() == want.stride() and want.is_contiguous(memory_format=torch.channels_last)
        np.testing.assert_allclose(got.detach().cpu().numpy(), want.detach().cpu().numpy(), rtol=1e-4, atol=1e-5)
        (got * got).sum().backward()
        (want * want).sum().backward()
        np.testing.assert_allclose(mine.grad.cpu().numpy(), theirs.grad.cpu().numpy(), rtol=1e-4, atol=1e-4)
    assert not any(copied)


def pooled_block():
    """`block` with a ResNet stem's max-pooling (3x3, stride 2) after its first ReLU."""
    net = block()
    return nn.Sequential(*net[:3], nn.MaxPool2d(3, 2, 1), *net[3:])


@pytest.mark.parametrize("model", [block, pooled_block], ids=["block", "pooled"])
def test_activations_saved_for_the_backward_cross_channels_last_where_embers_convolutions_run_so(model, monkeypatch):
    """With ember.set_conv_memory_format("channels_last"), a half-precision training step's forward hands the
    activations it saves to the backward (and a max-pooling's window offsets) as channels-last tensors (the memory
    ember computed them in), AOTAutograd traces the backward on those strides, and the backward reads them as they
    lie; the step's values are those of the contiguous layout's, and torch's."""
    saved, copied = [], []
    finish, as_buffer = ember.frontends.dynamo._finish, ember.frontends.dynamo._as_buffer

    def spy(*args):  # per call, whether each activation a graph returns (4 images x 8 channels) is channels-last
        results = finish(*args)
        saved.append([(t.dtype, t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous())
                      for t in results if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[:2] == (4, 8)])
        return results
    monkeypatch.setattr(ember.frontends.dynamo, "_finish", spy)
    monkeypatch.setattr(ember.frontends.dynamo, "_as_buffer", lambda t: (
        copied.append((tuple(t.shape), t.stride(), t.dtype)) if not t.is_contiguous() else None) or as_buffer(t))
    net = model().to(torch.bfloat16)
    expected_losses, expected_state = train(copy.deepcopy(net), compiled=False, steps=3, dtype=torch.bfloat16)
    with ember.conv_memory_format("contiguous"):
        contiguous_losses, _ = train(copy.deepcopy(net), compiled=True, steps=3, dtype=torch.bfloat16)
    torch._dynamo.reset()
    saved.clear()
    with ember.conv_memory_format("channels_last"):
        losses, state = train(net, compiled=True, steps=3, dtype=torch.bfloat16)
    forward = [outputs for outputs in saved if outputs]  # (the backward returns the weights' gradients)
    assert len(forward) == 3 and all(len(outputs) >= 2 and all(cl for _, cl in outputs) for outputs in forward), saved
    if model is pooled_block:  # the window offsets: one byte each
        assert all(sum(dtype == torch.uint8 for dtype, _ in outputs) == 1 for outputs in forward), saved
    assert not copied  # no input of a replayed graph needs a copy
    np.testing.assert_allclose(losses, contiguous_losses, rtol=2e-2)
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-2)
    for name, value in expected_state.items():
        np.testing.assert_allclose(state[name], value, rtol=5e-2, atol=5e-2, err_msg=name)
    torch._dynamo.reset()
    saved.clear()
    with ember.conv_memory_format("channels_last"):  # float32 convolutions run on (N, C, H, W): nothing crosses moved
        train(model(), compiled=True, steps=2, dtype=torch.float32)
    assert saved and not any(cl for outputs in saved for _, cl in outputs), saved


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_views_torch_makes_again_cost_ember_no_buffer_of_their_own(options, monkeypatch):
    """Outputs torch makes again as views of another output (`_views`) are not computed into buffers of their own:
    what ember returns at their positions is the viewed value's buffer."""
    seen = []
    finish = ember.frontends.dynamo._finish

    def spy(outputs, plan, *rest):
        seen.extend(outputs[i].data_ptr() == outputs[base].data_ptr() for i, base, _ in plan.views)
        return finish(outputs, plan, *rest)

    monkeypatch.setattr(ember.frontends.dynamo, "_finish", spy)
    run = torch.compile(_views, backend="ember", options=options)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(3, 4, generator=generator).to(DEVICE)
        with torch.no_grad():
            for g, w in zip(run(x), _views(x)):
                np.testing.assert_allclose(g.cpu().numpy(), w.cpu().numpy(), rtol=1e-6)
    assert len(seen) == 9 and all(seen)


def _views_of_a_clone(x):
    y = x.clone()
    return y.view(-1), y.t()


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_views_of_a_clone_share_new_memory_not_the_inputs(options):
    """Views of a clone the graph does not return (ember computes the clone as its input's own value) share memory
    of their own, as torch's do: writing the input afterwards changes neither."""
    run = torch.compile(_views_of_a_clone, backend="ember", options=options)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        x = torch.randn(3, 4, generator=generator).to(DEVICE)
        with torch.no_grad():
            flat, transposed = run(x)
            before = x.clone()
            x.add_(1.0)
            flat.mul_(2.0)  # seen through the other view, as in torch
        np.testing.assert_array_equal(flat.cpu().numpy(), 2 * before.reshape(-1).cpu().numpy())
        np.testing.assert_array_equal(transposed.cpu().numpy(), 2 * before.t().cpu().numpy())


def _literal(x):
    return x * 2, torch.tensor([1.0, 2.0, 3.0]), x + torch.tensor([0.5, 0.25, 0.125], device=x.device)


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_a_tensor_made_in_the_function_is_a_constant_of_the_graph_and_new_at_each_call(options):
    """`torch.tensor(...)` inside a compiled function is a constant of its graph (real, where AOTAutograd compiles
    under fake tensors), and each call returns a tensor of its own, as eager torch makes a new one each call."""
    run = torch.compile(_literal, backend="ember", options=options)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(3, generator=generator).to(DEVICE)
        got, want = run(x), _literal(x)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.cpu().numpy(), w.cpu().numpy(), rtol=1e-6)
        got[1].add_(10)  # must not reach the next call's result


def test_a_loss_kept_until_the_next_step_still_lends_results():
    """`loss = step(...)` in a loop keeps the last step's loss alive during the next call: the forward's replay then
    writes its second set of result buffers, and keeps lending both sets (no copies) from then on."""
    net = block()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    forward = torch.compile(lambda x, y: F.cross_entropy(net(x), y), backend="ember", options=OPTIONS)
    before = set(ember.frontends.dynamo._replayed)
    x, y = batch(0)
    loss = None
    for _ in range(6):
        loss = forward(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    jitted = [f for n, f in ember.frontends.dynamo._replayed.items() if n not in before]
    programs = [e.program for f in jitted for e in f._entries.values() if e.program is not None]
    assert programs and all(p.lends for p in programs)
    assert max(len(p.results) for p in programs) == 2  # the forward's two sets alternate


def aten_graphs(model, x, y) -> dict:
    """The forward and backward ATen graphs AOTAutograd hands the ember backend for a training step's loss."""
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return gm
        return compiler

    def capture(gm, example_inputs):
        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            decompositions=core_aten_decompositions())(gm, example_inputs)

    torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend=capture)(x, y).backward()
    return graphs


def planned(gm) -> ember.explain.Plan:
    """The plan ember would run for an ATen graph on the cuda device, on inputs of its recorded shapes."""
    from ember.device import as_device
    from ember.frontends.aten_graph import AtenGraph

    rng = np.random.default_rng(0)
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta["val"]
            data = rng.standard_normal(tuple(value.shape)) if value.is_floating_point() else np.zeros(
                tuple(value.shape))
            inputs.append(ember.tensor(data, dtype=str(value.dtype).removeprefix("torch."), device="cuda"))
    outputs = AtenGraph(gm.graph)(*inputs, attributes=lambda name: None, device=as_device("cuda"))
    return ember.explain.plan(*[o for o in outputs if isinstance(o, ember.Tensor)])


def test_the_backends_forward_and_backward_plans_run_the_convolutions_and_kernels_of_embers_own_training_step():
    """A conv-bn-relu block's forward and backward, as AOTAutograd's two ATen graphs, against the same step of
    ember.from_torch's module: every convolution and matmul (and each gradient) is one vendor call in both, and
    torch's decomposed batch norm fuses about as ember's own does. What the backend runs besides: the running
    statistics' update as a kernel of its own, the values saved for the backward stored where the forward ends,
    and cross entropy's gradient through a scatter (measured at 32 kernels against 27)."""
    net = block().cpu()
    x, y = (t.cpu() for t in batch(0))
    graphs = aten_graphs(copy.deepcopy(net), x, y)
    backend = [planned(graphs[kind]) for kind in ("forward", "backward")]

    imported = ember.from_torch(net).to("cuda")
    loss = ember.nn.functional.cross_entropy(imported(ember.from_dlpack(x).to("cuda")),
                                             ember.from_dlpack(y).to("cuda"))
    loss.backward()
    own = ember.explain.plan(loss, *[p.grad for p in imported.parameters()])

    def vendor(plans):
        return sorted(str(k.kind) for p in plans for k in p.kernels if str(k.kind) in ("conv2d", "matmul"))
    assert vendor(backend) == vendor([own]) == ["conv2d"] * 5 + ["matmul"] * 3
    assert sum(len(p.kernels) for p in backend) <= len(own.kernels) + 5
