"""from_torch through torch.export: models the layer-by-layer import refuses (functions and layers ember has no
mapping for, `**kwargs` forwards, dictionaries out, shape checks and branches) run from their core ATen program,
forward and training, against torch on the same weights."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import ember

torch = pytest.importorskip("torch")
tnn, TF = torch.nn, torch.nn.functional


class Inverted(tnn.Module):  # layers and functions the layer-by-layer import lacks: SELU, Softsign, celu
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = tnn.Sequential(tnn.Sequential(tnn.Conv2d(c, c, 1), tnn.SELU()), tnn.Conv2d(c, c, 1))
        self.bn = tnn.BatchNorm2d(c)
        self.act = tnn.Softsign()

    def forward(self, x):
        return x + TF.celu(self.act(self.bn(self.conv(x))))


class Mobile(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = tnn.Sequential(tnn.Sequential(tnn.Conv2d(3, 4, 3, padding=1), tnn.SELU()), Inverted(4),
                                       Inverted(4))
        self.head = tnn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class Encoder(tnn.Module):
    """A transformers-style encoder: keyword arguments through **kwargs, an attention mask, a shape check, a
    branch on a shape, a dictionary out."""

    def __init__(self, vocab: int = 30, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embeddings = tnn.Embedding(vocab, d)
        self.norm = tnn.LayerNorm(d)
        self.qkv, self.out = tnn.Linear(d, 3 * d), tnn.Linear(d, d)
        self.classifier = tnn.Linear(d, 3)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        torch._assert(input_ids.dim() == 2, "input_ids must be (batch, length)")
        h = self.norm(self.embeddings(input_ids))
        b, t, d = h.shape
        q, k, v = self.qkv(h).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        h = h + self.out(TF.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))
        pooled = h[:, 0] if t > 1 else h.squeeze(1)
        return {"logits": self.classifier(TF.softsign(pooled)), "hidden_states": h}


def torch_step(model, args, target):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(*args)
    loss = TF.cross_entropy(out["logits"] if isinstance(out, dict) else out, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def ember_step(model, args, target):
    opt = ember.optim.SGD(model.parameters(), lr=0.1)
    out = model(*args)
    loss = ember.nn.functional.cross_entropy(out["logits"] if isinstance(out, dict) else out, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def close_states(em, model, rtol=1e-4):
    mine = em.state_dict()
    assert list(mine) == list(model.state_dict())
    for k, v in model.state_dict().items():
        expected = v.detach().numpy().astype(np.float64)
        np.testing.assert_allclose(mine[k].numpy(), expected, rtol=rtol, atol=rtol * max(np.abs(expected).max(), 1),
                                   err_msg=k)


def test_a_model_the_layer_by_layer_import_refuses_runs_through_torch_export_forward_and_training():
    torch.manual_seed(0)
    model = Mobile()
    em = ember.from_torch(copy.deepcopy(model))
    assert type(em).__name__ == "Exported"
    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 5, (4,))
    for _ in range(2):  # two training steps: losses, updated parameters, running statistics
        expected = torch_step(model, (x,), y)
        assert ember_step(em, (ember.tensor(x.numpy()),), ember.tensor(y.numpy())) == pytest.approx(expected,
                                                                                                   rel=1e-5)
    close_states(em, model)
    model.eval()
    em.eval()
    assert not dict(em.named_modules())["features.1.bn"].training
    with torch.no_grad():
        np.testing.assert_allclose(em(ember.tensor(x.numpy())).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    assert len(em._programs) == 2  # one program per training mode


def test_keyword_arguments_a_mask_and_a_dictionary_out_at_several_batch_sizes_from_one_program():
    torch.manual_seed(1)
    model = Encoder().eval()
    em = ember.from_torch(model)
    rng = np.random.default_rng(2)
    for batch in (3, 5, 2):
        ids = rng.integers(0, 30, size=(batch, 6))
        mask = np.ones((batch, 6), np.int64)
        mask[0, 4:] = 0
        with torch.no_grad():
            expected = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
        got = em(ember.tensor(ids), attention_mask=ember.tensor(mask))
        assert set(got) == {"logits", "hidden_states"}
        for k in got:
            np.testing.assert_allclose(got[k].numpy(), expected[k].numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    assert len(em._programs) == 1  # the batch dimension is dynamic in the exported program


def test_training_the_exported_encoder_matches_torch():
    torch.manual_seed(3)
    model = Encoder()
    em = ember.from_torch(copy.deepcopy(model), via="export")
    ids = torch.randint(0, 30, (4, 5))
    target = torch.randint(0, 3, (4,))
    expected = torch_step(model, (ids,), target)
    assert ember_step(em, (ember.tensor(ids.numpy()),), ember.tensor(target.numpy())) == pytest.approx(expected,
                                                                                                      rel=1e-5)
    close_states(em, model)


def test_example_inputs_export_at_import_and_the_state_goes_back_to_torch():
    torch.manual_seed(4)
    model = Mobile().eval()
    em = ember.from_torch(model, example_inputs=(ember.randn(2, 3, 8, 8),))
    assert len(em._programs) == 1
    other = Mobile().eval()
    other.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in em.state_dict().items()})
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        np.testing.assert_allclose(other(x).numpy(), model(x).numpy(), rtol=1e-6)


def test_a_model_both_paths_take_gives_the_same_values():
    torch.manual_seed(5)
    model = tnn.Sequential(tnn.Linear(6, 8), tnn.GELU(), tnn.LayerNorm(8), tnn.Linear(8, 3))
    x = ember.randn(4, 6)
    np.testing.assert_allclose(ember.from_torch(model, via="export")(x).numpy(),
                               ember.from_torch(model)(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_first_call_of_batch_one_fixes_that_program_and_other_batches_get_their_own():
    torch.manual_seed(6)
    model = tnn.Sequential(tnn.Linear(6, 8), tnn.SELU(), tnn.Linear(8, 3))
    em = ember.from_torch(model)
    for batch in (1, 4, 4, 1):
        x = torch.randn(batch, 6)
        with torch.no_grad():
            np.testing.assert_allclose(em(ember.tensor(x.numpy())).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert len(em._programs) <= 2


def test_an_import_moved_to_another_device_makes_its_new_tensors_there():
    """A program captured on the cpu, run after .to("cuda"): the positions it creates (arange) and the constants
    it holds follow the module (the cuda device runs through the interpreter without a GPU)."""
    from ember.runtime import cuda

    if not cuda.is_available():
        pytest.skip("the cuda backend needs a GPU or EMBER_INTERPRET=1")
    class Positions(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = tnn.Embedding(30, 8), tnn.Embedding(16, 8)
            self.register_buffer("scale", torch.tensor(0.5), persistent=False)

        def forward(self, ids, **kwargs):
            where = torch.arange(ids.shape[1], device=ids.device)
            return {"logits": (self.tokens(ids) + self.positions(where)) * self.scale}

    torch.manual_seed(7)
    model = Positions().eval()
    ids = np.random.default_rng(8).integers(0, 30, size=(2, 4))
    em = ember.from_torch(model, example_inputs=(ember.tensor(ids),), via="export").to("cuda")
    with torch.no_grad():
        expected = model(torch.from_numpy(ids))["logits"].numpy()
    got = em(ember.tensor(ids, device="cuda"))["logits"]
    assert got.device == ember.Device("cuda", 0)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)


class HandWrittenAttention(tnn.Module):
    """Attention as transformers' "eager" implementations write it: the heads flattened into one batch dim for
    `bmm` (which torch.export records with clones and reshapes around it), a scale, an added mask, a float32
    softmax."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, tnn.Linear(d, 3 * d), tnn.Linear(d, 5)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        weights = TF.softmax(scores + mask, dim=-1, dtype=torch.float32).to(v.dtype)
        return self.out(torch.matmul(weights, v).transpose(1, 2).reshape(b, t, d)).mean(1)


def test_attention_written_by_hand_imports_as_one_attention_kernel_forward_and_backward():
    torch.manual_seed(0)
    model = HandWrittenAttention()
    x = torch.randn(3, 7, 16)
    mask = torch.where(torch.rand(3, 1, 7, 7) < 0.3, torch.finfo(torch.float32).min, 0.0)
    target = torch.randint(0, 5, (3,))
    em = ember.from_torch(copy.deepcopy(model), via="export")
    ex, emask = ember.from_dlpack(x), ember.from_dlpack(mask)
    loss = ember.nn.functional.cross_entropy(em(ex, emask), ember.from_dlpack(target))
    loss.backward()
    plan = str(ember.explain.plan(loss, *[p.grad for p in em.parameters()]))
    assert plan.count(" attention ") == 2, plan  # the forward's kernel and the backward's
    expected = torch_step(model, (x, mask), target)
    assert abs(ember_step(em, (ex, emask), ember.from_dlpack(target)) - expected) < 1e-5 * abs(expected)
    close_states(em, model)


class Put(tnn.Module):
    def forward(self, x, rows, cols):
        y = torch.ops.aten.index_put.default(x, [None, cols], torch.full((4, 3), 2.0))  # a slice, then an index
        return y.index_put((rows, cols), torch.ones(rows.shape), accumulate=True)  # two indices, a repeated pair


def test_index_put_takes_a_slice_before_an_index_and_several_indices_that_accumulate():
    x, rows, cols = torch.randn(4, 5), torch.tensor([0, 3, 0]), torch.tensor([1, 4, 1])
    got = ember.from_torch(Put(), via="export")(*(ember.tensor(t.numpy()) for t in (x, rows, cols)))
    np.testing.assert_allclose(got.numpy(), Put()(x, rows, cols).numpy(), rtol=1e-6)


class SliceAssignments(tnn.Module):
    """Assignments into slices and a column of a new tensor (torch.export records slice_scatter for the slices)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = tnn.Linear(6, 10)

    def forward(self, x):
        h = self.proj(x)
        out = torch.zeros_like(h)
        out[:, 1:9:3] = h[:, :3].tanh()
        out[:, 0] = h[:, 5]
        out[:, -1:] = h[:, -1:] * 2
        return out


def test_assignments_into_slices_import_forward_and_training():
    torch.manual_seed(0)
    model = SliceAssignments()
    x = torch.randn(4, 6)
    em = ember.from_torch(copy.deepcopy(model), via="export")
    program = torch.export.export(model, (x,)).run_decompositions()
    targets = {str(n.target) for n in program.graph.nodes}
    assert "aten.slice_scatter.default" in targets
    np.testing.assert_allclose(em(ember.from_dlpack(x)).numpy(), model(x).detach().numpy(), rtol=1e-6, atol=1e-7)
    target = torch.randint(0, 10, (4,))
    expected = torch_step(model, (x,), target)
    assert abs(ember_step(em, (ember.from_dlpack(x),), ember.from_dlpack(target)) - expected) < 1e-5 * abs(expected)
    close_states(em, model)


@pytest.mark.parametrize("dim, start, end, step", [(0, None, None, 1), (1, 1, None, 2), (1, -3, -1, 1), (2, 0, 4, 3)])
def test_slice_scatter_and_select_scatter_match_torch(dim, start, end, step):
    from ember.frontends.aten_graph import lookup

    x = torch.randn(3, 5, 4, dtype=torch.float64)
    src = torch.randn_like(x[(slice(None),) * dim + (slice(start, end, step),)])
    expected = torch.ops.aten.slice_scatter(x, src, dim, start, end, step)
    got = lookup(torch.ops.aten.slice_scatter.default)(ember.from_dlpack(x), ember.from_dlpack(src), dim, start,
                                                       end, step)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    row = torch.randn_like(x.select(dim, -1))
    got = lookup(torch.ops.aten.select_scatter.default)(ember.from_dlpack(x), ember.from_dlpack(row), dim, -1)
    np.testing.assert_array_equal(got.numpy(), torch.ops.aten.select_scatter(x, row, dim, -1).numpy())


@pytest.mark.parametrize("shape, dim, index_shape", [((6, 9), 1, (6, 1)), ((4, 3, 2), 0, (1, 3, 2)),
                                                     ((4, 3, 2), -1, (4, 3, 1)), ((0, 5), 1, (0, 1)),
                                                     ((1, 1), 1, (1, 1)), ((6, 9), 1, (6, 3)), ((6, 9), 0, (2, 9))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_scatter_of_a_value_and_of_a_source_matches_torch(shape, dim, index_shape, dtype):
    """aten.scatter (nll_loss's backward scatters into zeros): one position per row is a select; positions
    named once each elsewhere (torch leaves repeats undefined)."""
    from ember.frontends.aten_graph import lookup

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(dtype)
    axis = dim % len(shape)
    # distinct positions along the axis for each line of the index
    order = torch.rand(*index_shape[:axis], shape[axis], *index_shape[axis + 1:], generator=generator).argsort(axis)
    index = order.narrow(axis, 0, index_shape[axis])
    src = torch.randn(index_shape, generator=generator).to(dtype)
    value = -1.3 if dtype is not torch.bool else True
    for op, operand in ((torch.ops.aten.scatter.value, value), (torch.ops.aten.scatter.src, src)):
        expected = op(x, dim, index, operand)
        given = ember.from_dlpack(operand) if isinstance(operand, torch.Tensor) else operand
        got = lookup(op)(ember.from_dlpack(x), dim, ember.from_dlpack(index), given)
        np.testing.assert_array_equal(got.numpy().astype("float32"), expected.float().numpy())
    if index.numel():
        with pytest.raises(IndexError, match="scatter"):
            lookup(torch.ops.aten.scatter.value)(ember.from_dlpack(x), dim, ember.from_dlpack(index + shape[axis]),
                                                 value).numpy()


@pytest.mark.parametrize("ord, dim, keepdim", [(2, None, False), (2, [-1], True), (1, [0, 2], False),
                                               (math.inf, [1], False), (-math.inf, [1], True), (3, None, True)])
def test_linalg_vector_norm_matches_torch(ord, dim, keepdim):  # (F.normalize in Swin V2's cosine attention)
    from ember.frontends.aten_graph import lookup

    x = torch.randn(3, 5, 4, dtype=torch.float64)
    expected = torch.ops.aten.linalg_vector_norm(x, ord, dim, keepdim)
    got = lookup(torch.ops.aten.linalg_vector_norm.default)(ember.from_dlpack(x), ord, dim, keepdim)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12)
    wide = lookup(torch.ops.aten.linalg_vector_norm.default)(ember.from_dlpack(x.float()), ord, dim, keepdim,
                                                             dtype=torch.float64)
    assert wide.dtype == ember.float64


class Restrided(tnn.Module):
    """torch.as_strided on views: a transposed activation read at an offset, overlapping windows of it, a strided
    slice restrided over storage only its base holds as elements (torch's gradient reaches the slice's only), and
    a view at the input's storage offset with a size-1 dim."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = tnn.Linear(6, 8)

    def forward(self, x):
        h = self.proj(x)  # (4, 8)
        shifted = torch.as_strided(h.t(), (6, 3), (1, 8), 2)
        windows = torch.as_strided(h, (4, 3, 3), (8, 2, 1))  # each row's windows of three, overlapping
        around = torch.as_strided(h[:, ::3], (3, 5), (9, 1), 1)  # a slice, read where it skipped
        single = torch.as_strided(h[1:], (2, 1), (9, 100))  # a size-1 dim's stride moves nothing
        return torch.cat([shifted.sum(1), windows.square().sum((1, 2)), around.tanh().sum(1), single.sum(1)])


def test_as_strided_on_non_contiguous_views_imports_forward_and_training():
    torch.manual_seed(0)
    model = Restrided()
    x = torch.randn(4, 6)
    em = ember.from_torch(copy.deepcopy(model), via="export")
    np.testing.assert_allclose(em(ember.from_dlpack(x)).numpy(), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    target = torch.randint(0, 15, (1,))
    loss = lambda lib, out, t: lib.nn.functional.cross_entropy(out[None], t)  # noqa: E731
    expected = loss(torch, model(x), target)
    expected.backward()
    got = loss(ember, em(ember.from_dlpack(x)), ember.from_dlpack(target))
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    mine = dict(em.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(mine[name].grad.numpy(), p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_as_strided_reading_storage_no_tensor_of_the_graph_holds_is_an_error_naming_the_layouts():
    from ember.frontends.aten_graph import AtenGraph

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 3)[:, ::2]  # an input that is itself a view: its base is not in the graph
    restrided = graph.call_function(torch.ops.aten.as_strided.default, (x, [2, 2], [2, 1]))
    graph.output(restrided)
    with pytest.raises(NotImplementedError, match=r"aten.as_strided.default \(it reads size \(2, 2\), strides "
                                                  r"\(2, 1\), storage offset 0 from an input of shape \(4, 2\), "
                                                  r"strides \(3, 2\), storage offset 0"):
        AtenGraph(graph)


def test_an_embedding_with_a_padding_index_gives_its_row_no_gradient_through_export():
    """(BART's token embedding, tied to its output layer: the padding row learns from the output layer alone.)"""

    class Tied(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = tnn.Embedding(10, 4, padding_idx=1)
            self.out = tnn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(self.embed(ids).tanh()).mean(1)

    torch.manual_seed(0)
    model = Tied()
    em = ember.from_torch(copy.deepcopy(model), via="export")
    ids = torch.tensor([[1, 2, 1, 3], [4, 1, 5, 1]])
    target = torch.tensor([1, 7])
    expected = torch_step(model, (ids,), target)
    assert ember_step(em, (ember.from_dlpack(ids),), ember.from_dlpack(target)) == pytest.approx(expected, rel=1e-5)
    close_states(em, model)


def test_topk_and_sort_import_forward_and_training():
    """(A mixture of experts' router: the k best experts' weights, and their indices.)"""

    class Router(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = tnn.Linear(6, 5)

        def forward(self, x):
            scores = self.gate(x).softmax(-1)
            best, chosen = torch.topk(scores, 2, dim=-1)
            ranked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
            return best.sum(-1, keepdim=True) * ranked + chosen.sum(-1, keepdim=True) + order[:, :1]

    torch.manual_seed(0)
    model = Router()
    em = ember.from_torch(copy.deepcopy(model), via="export")
    x = torch.randn(4, 6)
    np.testing.assert_allclose(em(ember.from_dlpack(x)).numpy(), model(x).detach().numpy(), rtol=1e-6, atol=1e-6)
    target = torch.randint(0, 5, (4,))
    expected = torch_step(model, (x,), target)
    assert ember_step(em, (ember.from_dlpack(x),), ember.from_dlpack(target)) == pytest.approx(expected, rel=1e-5)
    close_states(em, model)


@pytest.mark.parametrize("low, high", [(0, 0), (-1.0, 1.5), (2.0, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64])
def test_histc_matches_torch(low, high, dtype):
    """Counts over [min, max] (the data's own range where they are equal), the maximum in the last bin, values
    outside and NaN not counted; an empty input and one of a single value too."""
    from ember.frontends.aten_graph import lookup

    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(50, generator=generator) * 2, torch.full((7,), 2.0), torch.zeros(0)]
    if dtype.is_floating_point and low != high:  # (torch refuses a range a NaN makes)
        data.append(torch.tensor([float("nan"), 0.5, 1.5, -1.0]))
    for x in data:
        x = x.to(dtype) if dtype.is_floating_point else (x * 3).round().to(dtype)
        want = torch.histc(x.double() if not dtype.is_floating_point else x, bins=6, min=low, max=high)
        got = lookup(torch.ops.aten.histc.default)(ember.from_dlpack(x), 6, low, high)
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_grouped_matmuls_match_torch_forward_and_backward():
    """A grouped matmul (mixture-of-experts layers): rows in consecutive groups by cumulative counts, an empty
    group among them and rows past the last group (zeros), against torch's `_grouped_mm` and transformers' loop;
    the backward operator's gradients against torch's autograd."""
    from ember.frontends.aten_graph import lookup, lookup_name

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=generator)  # (torch's kernel takes rows of 16-byte multiples)
    w = torch.randn(4, 8, 4, generator=generator)
    offs = torch.tensor([2, 2, 6, 8], dtype=torch.int32)  # group 1 is empty; row 8 belongs to none
    expected = torch.zeros(9, 4)
    start = 0
    for g, end in enumerate(offs.tolist()):
        expected[start:end] = x[start:end] @ w[g]
        start = end
    grouped = torch._grouped_mm(x, w, offs=offs)[:8]  # (torch's kernel leaves rows past the last group unwritten)
    np.testing.assert_allclose(grouped.numpy(), expected[:8].numpy(), rtol=1e-5, atol=1e-6)
    got = lookup(torch.ops.aten._grouped_mm.default)(ember.from_dlpack(x), ember.from_dlpack(w),
                                                     ember.from_dlpack(offs))
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    xg, wg = x.double().requires_grad_(), w.double().requires_grad_()
    grad = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    out = torch.zeros(9, 4, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out = out.index_add(0, torch.arange(start, end), xg[start:end] @ wg[g])
        start = end
    out.backward(grad)
    backward = lookup_name("transformers.grouped_mm_fallback_backward.default")
    grad_x, grad_w = backward(*[ember.from_dlpack(t.detach()) for t in (xg, wg, offs.long(), grad)])
    np.testing.assert_allclose(grad_x.numpy(), xg.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_w.numpy(), wg.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_the_attention_operator_takes_torchs_argument_order(masked):
    """aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, *, scale, enable_gqa), as an
    export that keeps attention whole records it: a mask in the fourth place, grouped keys and values."""
    from ember.frontends.aten_graph import lookup

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.randn(2, 1, 5, 6, generator=generator, dtype=torch.float64) if masked else None
    op = torch.ops.aten.scaled_dot_product_attention.default
    expected = op(q, k, v, mask, 0.0, not masked, scale=0.3, enable_gqa=True)
    got = lookup(op)(*[ember.from_dlpack(t) for t in (q, k, v)], None if mask is None else ember.from_dlpack(mask),
                     0.0, not masked, scale=0.3, enable_gqa=True)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-10, atol=1e-12)
