"""Movement ops against torch: views, basic indexing, concatenation, splitting, padding, flips, repeats.

Every case runs on every dtype (contiguous inputs) and on float32 inputs reached through a
transposed or strided view; gradients are compared with torch and with finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, TORCH, check_against_torch, check_finite_differences, random_array

import ember

pytestmark = pytest.mark.usefixtures("device")

# name: (function of the library and the inputs, input shapes)
MOVEMENT = {
    "reshape": (lambda m, x: x.reshape(4, 3), [(3, 4)]),
    "reshape-infer": (lambda m, x: m.reshape(x, (2, -1)), [(3, 4)]),
    "reshape-to-0d": (lambda m, x: x.reshape(()), [(1,)]),
    "reshape-from-0d": (lambda m, x: x.reshape(1, 1), [()]),
    "reshape-empty": (lambda m, x: x.reshape(3, 0), [(0, 3)]),
    "reshape_as": (lambda m, x: x.reshape_as(m.zeros(6, 2)), [(3, 4)]),
    "permute": (lambda m, x: x.permute(2, 0, 1), [(2, 3, 4)]),
    "permute-negative": (lambda m, x: m.permute(x, (-1, 0, 1)), [(2, 3, 4)]),
    "transpose": (lambda m, x: x.transpose(0, 2), [(2, 3, 4)]),
    "transpose-negative": (lambda m, x: m.transpose(x, -1, -2), [(2, 3, 4)]),
    "T": (lambda m, x: x.T, [(3, 4)]),
    "mT": (lambda m, x: x.mT, [(2, 3, 4)]),
    "expand": (lambda m, x: x.expand(3, 4), [(3, 1)]),
    "expand-new-dims": (lambda m, x: x.expand(2, 3, 4), [(3, 1)]),
    "expand-minus-one": (lambda m, x: x.expand(2, -1, 4), [(3, 1)]),
    "expand-empty": (lambda m, x: x.expand(0, 3), [(1, 3)]),
    "expand_as": (lambda m, x: x.expand_as(m.zeros(2, 3, 4)), [(3, 1)]),
    "broadcast_to": (lambda m, x: m.broadcast_to(x, (2, 3, 4)), [(4,)]),
    "squeeze": (lambda m, x: x.squeeze(), [(1, 3, 1)]),
    "squeeze-dim": (lambda m, x: x.squeeze(0), [(1, 3, 1)]),
    "squeeze-dims": (lambda m, x: m.squeeze(x, (0, 2)), [(1, 3, 1)]),
    "squeeze-not-one": (lambda m, x: x.squeeze(1), [(1, 3, 1)]),
    "unsqueeze-front": (lambda m, x: x.unsqueeze(0), [(3, 4)]),
    "unsqueeze-back": (lambda m, x: m.unsqueeze(x, -1), [(3, 4)]),
    "unsqueeze-0d": (lambda m, x: x.unsqueeze(0), [()]),
    "flatten": (lambda m, x: x.flatten(), [(2, 3, 4)]),
    "flatten-from": (lambda m, x: m.flatten(x, 1), [(2, 3, 2, 2)]),
    "flatten-middle": (lambda m, x: m.flatten(x, 1, 2), [(2, 3, 2, 2)]),
    "flatten-0d": (lambda m, x: x.flatten(), [()]),
    "contiguous": (lambda m, x: x.contiguous(), [(3, 4)]),
    "getitem-int": (lambda m, x: x[1], [(3, 4)]),
    "getitem-negative-int": (lambda m, x: x[-1], [(3, 4)]),
    "getitem-ints": (lambda m, x: x[1, -2], [(3, 4)]),
    "getitem-slice": (lambda m, x: x[1:3], [(4, 3)]),
    "getitem-step": (lambda m, x: x[::2], [(5, 3)]),
    "getitem-steps": (lambda m, x: x[1::2, 1:4:2], [(5, 6)]),
    "getitem-negative-bounds": (lambda m, x: x[-3:-1, :-1], [(4, 3)]),
    "getitem-clipped": (lambda m, x: x[2:100], [(4, 3)]),
    "getitem-empty-slice": (lambda m, x: x[3:1], [(4, 3)]),
    "getitem-none": (lambda m, x: x[None], [(3, 4)]),
    "getitem-none-middle": (lambda m, x: x[:, None, 1:], [(3, 4)]),
    "getitem-ellipsis": (lambda m, x: x[..., 0], [(2, 3, 4)]),
    "getitem-ellipsis-none": (lambda m, x: x[..., None], [(2, 3)]),
    "getitem-ellipsis-middle": (lambda m, x: x[1, ..., 2], [(2, 3, 4)]),
    "getitem-mixed": (lambda m, x: x[0, 1:, None, ::2], [(2, 3, 4)]),
    "getitem-0d": (lambda m, x: x[()], [()]),
    "getitem-0d-none": (lambda m, x: x[None, ...], [()]),
    "cat": (lambda m, x, y: m.cat([x, y], 0), [(2, 3), (4, 3)]),
    "cat-dim1": (lambda m, x, y, z: m.cat([x, y, z], 1), [(2, 3), (2, 1), (2, 2)]),
    "cat-negative-dim": (lambda m, x, y: m.cat((x, y), -1), [(2, 3), (2, 2)]),
    "cat-empty-piece": (lambda m, x, y: m.cat([x, y]), [(0, 3), (2, 3)]),
    "cat-legacy-empty": (lambda m, x, y: m.cat([x, y]), [(0,), (2, 3)]),
    "cat-single": (lambda m, x: m.cat([x], 0), [(2, 3)]),
    "stack": (lambda m, x, y: m.stack([x, y]), [(2, 3), (2, 3)]),
    "stack-middle": (lambda m, x, y, z: m.stack([x, y, z], 1), [(2, 3), (2, 3), (2, 3)]),
    "stack-last": (lambda m, x, y: m.stack([x, y], -1), [(2, 3), (2, 3)]),
    "stack-0d": (lambda m, x, y: m.stack([x, y]), [(), ()]),
    "split": (lambda m, x: m.split(x, 2), [(5, 3)]),
    "split-sections": (lambda m, x: m.split(x, [1, 3, 1], 0), [(5, 3)]),
    "split-dim1": (lambda m, x: x.split(2, dim=1), [(2, 5)]),
    "chunk": (lambda m, x: m.chunk(x, 3), [(5, 3)]),
    "chunk-dim1": (lambda m, x: x.chunk(2, 1), [(2, 5)]),
    "chunk-more-than-size": (lambda m, x: x.chunk(4), [(2, 3)]),
    "pad": (lambda m, x: m.pad(x, (1, 2)), [(2, 3)]),
    "pad-two-dims": (lambda m, x: m.pad(x, (1, 1, 2, 0)), [(2, 3)]),
    "pad-value": (lambda m, x: m.pad(x, (1, 1), value=3), [(2, 3)]),
    "pad-negative": (lambda m, x: m.pad(x, (-1, 2)), [(2, 4)]),
    "pad-reflect": (lambda m, x: m.pad(x, (2, 1), mode="reflect"), [(2, 3, 5)]),
    "pad-replicate": (lambda m, x: m.pad(x, (2, 1, 1, 0), mode="replicate"), [(1, 2, 3, 4)]),
    "pad-circular": (lambda m, x: m.pad(x, (2, 1), mode="circular"), [(2, 3, 5)]),
    "flip": (lambda m, x: x.flip(0), [(3, 4)]),
    "flip-dims": (lambda m, x: m.flip(x, (0, 1)), [(3, 4)]),
    "flip-negative": (lambda m, x: x.flip(-1), [(2, 3, 4)]),
    "repeat": (lambda m, x: x.repeat(2, 1), [(2, 3)]),
    "repeat-new-dims": (lambda m, x: x.repeat(2, 1, 3), [(2, 3)]),
    "repeat-zero": (lambda m, x: x.repeat(0, 2), [(2, 3)]),
    "tril": (lambda m, x: m.tril(x), [(3, 4)]),
    "tril-diagonal": (lambda m, x: x.tril(1), [(2, 3, 4)]),
    "triu": (lambda m, x: m.triu(x), [(4, 3)]),
    "triu-negative-diagonal": (lambda m, x: x.triu(-1), [(2, 4, 3)]),
}

# torch's .view needs compatible strides; ember's views never do, so only these compare on contiguous input
CONTIGUOUS_ONLY = {
    "view": (lambda m, x: x.view(2, 6), [(3, 4)]),
    "view-infer": (lambda m, x: x.view(-1), [(2, 3, 2)]),
    "view_as": (lambda m, x: x.view_as(m.zeros(4, 3)), [(3, 4)]),
}
# torch pads only floating-point tensors in the reflect, replicate and circular modes
FLOAT_ONLY = {"pad-reflect", "pad-replicate", "pad-circular"}


def _params():
    params = []
    for name in {**MOVEMENT, **CONTIGUOUS_ONLY}:
        for dtype in DTYPES:
            if name in FLOAT_ONLY and dtype not in ("float32", "float64", "float16", "bfloat16"):
                continue
            params.append(pytest.param(name, dtype, "contiguous", id=f"{name}-{dtype}"))
        if name in MOVEMENT:
            params += [pytest.param(name, "float32", layout, id=f"{name}-float32-{layout}")
                       for layout in ("transposed", "strided")]
    return params


@pytest.mark.filterwarnings("ignore:The use of `x.T` on tensors:UserWarning")
@pytest.mark.parametrize("name, dtype, layout", _params())
def test_movement_matches_torch(name, dtype, layout, rng):
    fn, shapes = {**MOVEMENT, **CONTIGUOUS_ONLY}[name]
    inputs = [random_array(rng, shape, dtype, -5, 5) for shape in shapes]
    check_against_torch(fn, *inputs, layout=layout)


@pytest.mark.parametrize("name", MOVEMENT)
def test_movement_gradient_matches_finite_differences(name, rng):
    fn, shapes = MOVEMENT[name]
    check_finite_differences(fn, *[random_array(rng, shape, "float64") for shape in shapes])


def test_T_reverses_all_dims_like_torch(rng):
    x = random_array(rng, (2, 3, 4), "float32")
    check_against_torch(lambda m, t: t.permute(*reversed(range(t.ndim))), x)
    assert ember.tensor(x).T.shape == (4, 3, 2)


@pytest.mark.parametrize("dtypes", [("int32", "float16"), ("bool", "uint8"), ("int8", "int64", "bfloat16")],
                         ids=lambda d: "-".join(d))
def test_cat_promotes_mixed_dtypes_like_torch(dtypes, rng):
    inputs = [random_array(rng, (2, 3), d) for d in dtypes]
    check_against_torch(lambda m, *xs: m.cat(xs, 1), *inputs)


def test_split_pieces_are_views_with_gradients(rng):
    x = random_array(rng, (6, 2), "float32")
    check_against_torch(lambda m, t: [p * (i + 1) for i, p in enumerate(t.split(2))], x)


MISUSES = {
    "reshape-size": lambda m: m.zeros(3, 4).reshape(5, -1),
    "reshape-two-inferred": lambda m: m.zeros(3, 4).reshape(-1, -1),
    "expand-non-one": lambda m: m.zeros(3, 2).expand(3, 4),
    "expand-fewer-dims": lambda m: m.zeros(2, 3).expand(3),
    "permute-count": lambda m: m.zeros(2, 3).permute(0),
    "permute-repeat": lambda m: m.zeros(2, 3).permute(0, 0),
    "squeeze-range": lambda m: m.zeros(2, 3).squeeze(2),
    "cat-shapes": lambda m: m.cat([m.zeros(2, 3), m.zeros(2, 4)], 0),
    "cat-0d": lambda m: m.cat([m.zeros(()), m.zeros(())]),
    "stack-shapes": lambda m: m.stack([m.zeros(2), m.zeros(3)]),
    "index-range": lambda m: m.zeros(2, 3)[2],
    "index-too-many": lambda m: m.zeros(2, 3)[0, 0, 0],
    "split-sections-sum": lambda m: m.zeros(5).split([2, 2]),
    "pad-odd-length": lambda m: m.pad(m.zeros(2, 3), (1,)),
}


@pytest.mark.parametrize("name", MISUSES)
def test_movement_misuse_raises_like_torch(name):
    fn = MISUSES[name]
    with pytest.raises((RuntimeError, IndexError, ValueError, TypeError)):
        fn(TORCH)
    with pytest.raises((ember.EmberError, IndexError, ValueError, TypeError)):
        fn(ember)


def test_a_causal_mask_from_tril_stays_bool_so_it_inverts(rng):
    # the first lines of a hand-written causal attention
    scores = random_array(rng, (2, 4, 4), "float32")

    def attend(m, s):
        mask = m.tril(m.ones(4, 4, dtype=m.bool))
        return s.masked_fill(~mask, float("-inf")).softmax(-1)

    check_against_torch(attend, scores)
    assert ember.triu(ember.ones(3, 3, dtype=ember.bool), 1).dtype is ember.bool


def test_views_of_views_compose(rng):
    x = random_array(rng, (4, 6), "float32")
    check_against_torch(lambda m, t: t.T[1:, ::2].reshape(-1)[None].expand(2, -1).flip(-1), x)
    check_against_torch(lambda m, t: t.unsqueeze(1).transpose(0, 2)[:, 0, 1:3], x, layout="strided")
    assert np.array_equal(ember.tensor(x).mT.mT.numpy(), x)
