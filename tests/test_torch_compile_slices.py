"""torch.compile(..., backend="ember") on inputs that are strided slices of wider tensors: the query, key and value a
fused projection is split into (saved for the backward as views of the projection's output), column slices,
every other element. A replayed graph reads such an input as the dense box of memory around it and slices it in
its kernels: no copy of the input at each call, the values torch's. On ember's cpu device (the reference backend)
and its cuda device (through Triton's interpreter without a GPU)."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest
from conftest import ON_GPU

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import ember.frontends.dynamo  # noqa: E402  (registers the backend where the entry point is not installed)
from ember.frontends import layouts  # noqa: E402

pytestmark = [pytest.mark.usefixtures("cuda_backend", "fresh_dynamo"), *([pytest.mark.gpu] if ON_GPU else [])]
DEVICE = "cuda" if ON_GPU else "cpu"  # torch's device; ember's is cuda either way
OPTIONS = {"device": "cuda"}


@pytest.fixture
def copies(monkeypatch) -> dict:
    """What crossing into a graph cost: the inputs copied to contiguous memory ("contiguous", their shapes), the
    inputs read as boxes ("boxed"), and those of them the box does not fit or is no view of ("boxed amiss"). From no
    compiled graph (dynamo keeps them by code object, and guards on no storage offset)."""
    torch._dynamo.reset()
    seen = {"contiguous": [], "boxed": 0, "boxed amiss": 0}
    as_buffer, of = ember.frontends.dynamo._as_buffer, layouts.Box.of

    def spy_buffer(t):
        if not t.is_contiguous():
            seen["contiguous"].append(tuple(t.shape))
        return as_buffer(t)

    def spy_box(box, t):
        fits = box.fits(t)
        made = of(box, t)
        seen["boxed"] += 1
        seen["boxed amiss"] += not fits or made.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        return made
    monkeypatch.setattr(ember.frontends.dynamo, "_as_buffer", spy_buffer)
    monkeypatch.setattr(layouts.Box, "of", spy_box)
    return seen


class FusedAttention(nn.Module):
    """Self-attention as GPT-2 writes it: one projection to queries, keys and values, split, into heads."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c)) + x


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_queries_keys_and_values_saved_as_views_of_one_projection_reach_the_backward_uncopied(options, copies):
    """A training step of fused-projection attention: the forward hands its projection's output once, with the
    queries, keys and values torch makes again as views of it (no buffer of their own), and the backward reads
    those slices where they lie; losses and parameters as torch eager's."""
    torch.manual_seed(0)
    model = FusedAttention(16, 4).to(DEVICE)
    reference = copy.deepcopy(model)
    handed = []
    finish = ember.frontends.dynamo._finish

    def spy(*args):  # how many (batch, heads, tokens, head width) values a graph returns share a storage, at most
        results = finish(*args)
        handed.append(max(collections.Counter(t.untyped_storage().data_ptr() for t in results if isinstance(
            t, torch.Tensor) and tuple(t.shape) == (3, 4, 6, 4)).values(), default=0))
        return results
    ember.frontends.dynamo._finish, restore = spy, finish
    try:
        losses = {}
        for name, net, compiled in (("ember", model, True), ("torch", reference, False)):
            # (SGD: the keys' bias has no gradient but rounding's, which Adam's normalization would magnify)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

            def step(x, net=net, opt=opt):
                loss = (net(x) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                return loss
            run = torch.compile(step, backend="ember", options=options) if compiled else step
            generator = torch.Generator().manual_seed(1)
            losses[name] = [run(torch.randn(3, 6, 16, generator=generator).to(DEVICE)).item() for _ in range(4)]
    finally:
        ember.frontends.dynamo._finish = restore
    np.testing.assert_allclose(losses["ember"], losses["torch"], rtol=1e-4)
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        np.testing.assert_allclose(mine.cpu().numpy(), theirs.cpu().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    assert handed.count(3) == 4, handed  # each forward's queries, keys and values: one projection's memory
    assert copies["contiguous"] == [] and copies["boxed amiss"] == 0 and copies["boxed"] >= 3 * 3, copies


def _mixed(x, w):
    """Pointwise, a reduction along the slice's rows and a matrix product reading it as an operand."""
    return (x * 1.5).sin() + x.sum(-1, keepdim=True), x @ w


def _column_slice(big):
    return big[:, 1:4]


def _last_columns(big):  # the box must start before the slice to end inside the storage
    return big[:, 5:8]


def _every_other(big):  # innermost stride 2
    return big[:, ::2]


def _heads(big):  # a slice of each row, split into heads and transposed
    return big.view(6, 2, 4)[:, :, 1:4].transpose(0, 1)


def _single_row(big):  # sizes of 1
    return big.view(6, 2, 4)[:, :1, 1:3]


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
@pytest.mark.parametrize("make", [_column_slice, _last_columns, _every_other, _heads, _single_row])
def test_an_input_that_is_a_slice_of_a_wider_tensor_is_read_where_it_lies(options, make, copies):
    """Such inputs give torch's values and gradients, and no call copies them to contiguous memory."""
    run = torch.compile(_mixed, backend="ember", options=options)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        big = torch.randn(6, 8, generator=generator).to(DEVICE)
        x = make(big)
        assert not x.is_contiguous()
        w = torch.randn(x.shape[-1], 5, generator=generator).to(DEVICE)
        mine, theirs = (big.clone().requires_grad_() for _ in range(2))
        got, want = run(make(mine), w), _mixed(make(theirs), w)
        for g, e in zip(got, want):
            np.testing.assert_allclose(g.detach().cpu().numpy(), e.detach().cpu().numpy(), rtol=1e-5, atol=1e-5)
        for a, b in (got, want):
            (a.cos().sum() + (b * b).sum()).backward()
        np.testing.assert_allclose(mine.grad.cpu().numpy(), theirs.grad.cpu().numpy(), rtol=1e-5, atol=1e-5)
    assert copies["contiguous"] == [] and copies["boxed amiss"] == 0 and copies["boxed"] >= 3, copies


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_a_call_whose_slice_the_box_does_not_fit_runs_the_graph_reading_it_as_before(options, copies):
    """A call whose input has the compiled layout but not the memory around it the box needs (here, a storage that
    ends right after the slice's last element, and one starting at it) runs the graph compiled without boxes, which
    reads a contiguous copy as before: no box is copied into, the values stay torch's, and calls that fit go on
    reading boxes."""
    run = torch.compile(lambda x: (x * 2.5).exp() - x.mean(), backend="ember", options=options)
    generator = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 8, generator=generator).to(DEVICE)
    inputs = [wide[:, 1:4],  # compiled for: the box (6, 8) starts one element before the slice
              torch.randn(5 * 8 + 4, generator=generator).to(DEVICE)[1:].as_strided((6, 3), (8, 1)),
              torch.randn(5 * 8 + 3, generator=generator).to(DEVICE).as_strided((6, 3), (8, 1)),
              torch.randn(6, 8, generator=generator).to(DEVICE)[:, 1:4]]
    with torch.no_grad():
        for x in inputs:
            np.testing.assert_allclose(run(x).cpu().numpy(), ((x * 2.5).exp() - x.mean()).cpu().numpy(),
                                       rtol=1e-5, atol=1e-6)
    assert copies["boxed"] == 2 and copies["boxed amiss"] == 0, copies


def test_a_box_fits_views_of_its_layout_whatever_the_stride_of_a_dimension_of_size_one():
    """A box fits a view with its sizes, strides (but for dimensions of size 1) and memory around it, and no other:
    a backward's inputs are laid out by the forward, which dynamo's guards do not see."""
    big = torch.randn(6, 8)
    box, _ = layouts._box(big.view(6, 2, 4)[:, :1, 1:3])
    assert box.fits(big.view(6, 2, 4)[:, :1, 1:3]) and box.fits(big[:, None, 1:3])
    assert not box.fits(big.view(6, 2, 4)[:5, :1, 1:3])  # other sizes
    assert not box.fits(big[:, None, 1:3].contiguous())  # other strides
    assert not box.fits(torch.randn(47).as_strided((6, 1, 2), (8, 4, 1), 1))  # the box would leave the storage


def _matmul_sum(x, w):
    return (x @ w).sum()


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_a_backward_input_traced_as_a_slice_but_handed_dense_is_read_as_handed(options, copies):
    """The forward saves `x.t()` of an input that is a column slice of a wide tensor (for the weight's gradient),
    which AOTAutograd traces as a slice of the wide tensor's storage but ember's forward hands as a buffer of its
    own: the backward reads that buffer as it is (no copy into a box as wide as the traced storage), with torch's
    gradients."""
    run = torch.compile(_matmul_sum, backend="ember", options=options)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        big = torch.randn(16, 64, generator=generator).to(DEVICE)
        w = torch.randn(8, 5, generator=generator).to(DEVICE)
        mine, theirs = (w.clone().requires_grad_() for _ in range(2))
        run(big[:, :8], mine).backward()
        _matmul_sum(big[:, :8], theirs).backward()
        np.testing.assert_allclose(mine.grad.cpu().numpy(), theirs.grad.cpu().numpy(), rtol=1e-5, atol=1e-5)
    assert copies["boxed amiss"] == 0, copies


def _attention_of_a_slice(model, wide):
    return (model(wide[..., :16]) ** 2).mean()


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_a_box_that_does_not_fit_leaves_the_others_read_as_boxes(options, copies):
    """A backward holding both the queries, keys and values saved as views of one projection (their boxes fit every
    call) and an input traced as a slice that the forward hands dense (its box fits none): the calls run a graph
    reading the fitting ones as boxes (no copy of them), with torch's gradients."""
    torch.manual_seed(0)
    model = FusedAttention(16, 4).to(DEVICE)
    reference = copy.deepcopy(model)
    run = torch.compile(_attention_of_a_slice, backend="ember", options=options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        wide = torch.randn(3, 6, 32, generator=generator).to(DEVICE)
        run(model, wide).backward()
        _attention_of_a_slice(reference, wide).backward()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        np.testing.assert_allclose(mine.grad.cpu().numpy(), theirs.grad.cpu().numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    assert (3, 4, 6, 4) not in copies["contiguous"] and copies["boxed amiss"] == 0, copies
    assert copies["boxed"] >= 3 * 3, copies


def _addressing(x):
    return x.as_strided((5, 2), (8, 1), 9) * 2


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_a_graph_addressing_storage_by_as_strided_reads_no_box(options, copies):
    """`as_strided`'s offset addresses the input's storage as torch lays it out: a graph with one reads its strided
    inputs as before, with torch's values."""
    run = torch.compile(_addressing, backend="ember", options=options)
    generator = torch.Generator().manual_seed(8)
    for _ in range(3):
        x = torch.randn(7, 8, generator=generator).to(DEVICE)[1:, 1:4]
        np.testing.assert_array_equal(run(x).cpu().numpy(), _addressing(x).cpu().numpy())
    assert copies["boxed"] == 0, copies


def _row_clone(x):
    return x[1].clone(), x[1:].clone()


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
@pytest.mark.parametrize("make", [lambda big: big[:, 1:4], lambda big: big[:, :3].contiguous()],
                         ids=["slice", "contiguous"])
def test_a_clone_of_part_of_an_input_is_memory_of_its_own(options, make, copies):
    """`x[1].clone()` is x's own value to ember, which may hand it on x's memory (a view of the input, on the cpu
    device): torch's clone is memory of its own, so writing it leaves x as it was."""
    run = torch.compile(_row_clone, backend="ember", options=options)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        big = torch.randn(6, 8, generator=generator).to(DEVICE)
        before = big.clone()
        x = make(big)
        kept = x.clone()
        for out, want in zip(run(x), _row_clone(kept)):
            np.testing.assert_allclose(out.cpu().numpy(), want.cpu().numpy(), rtol=1e-6)
            out.add_(100.0)
        np.testing.assert_array_equal(x.cpu().numpy(), kept.cpu().numpy())
        np.testing.assert_array_equal(big.cpu().numpy(), before.cpu().numpy())


@pytest.mark.parametrize("options", [None, OPTIONS], ids=["cpu", "cuda"])
def test_inputs_no_box_holds_are_copied_as_before(options, copies):
    """A broadcast input (a stride of 0) and elements that overlap are no slice of a box: read as before, with
    torch's values."""
    run = torch.compile(lambda x: x.sin() * 3.0, backend="ember", options=options)
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(8, generator=generator).to(DEVICE)
    for x in (base[:4].expand(3, 4), base.as_strided((3, 4), (2, 1))):
        with torch.no_grad():
            np.testing.assert_allclose(run(x).cpu().numpy(), (x.sin() * 3.0).cpu().numpy(), rtol=1e-5, atol=1e-6)
    assert copies["boxed"] == 0, copies
