"""User-facing ops, one module per family, and their binding as Tensor methods."""

from __future__ import annotations

from ember.ops import activations, contraction, index, movement, pointwise, random, reduce, sorting
from ember.ops.activations import (
    elu,
    gelu,
    hardtanh,
    leaky_relu,
    mish,
    prelu,
    relu,
    relu6,
    sigmoid,
    silu,
    softplus,
)
from ember.ops.contraction import bmm, conv2d, conv_transpose2d, dot, einsum, linear, matmul, mm, outer
from ember.ops.conv3d import conv3d, conv_transpose3d
from ember.ops.creation import (
    arange,
    empty,
    empty_like,
    eye,
    from_dlpack,
    from_numpy,
    full,
    full_like,
    linspace,
    logspace,
    ones,
    ones_like,
    tensor,
    zeros,
    zeros_like,
)
from ember.ops.index import embedding, gather, index_select, one_hot, scatter_add, take_along_dim
from ember.ops.movement import (
    broadcast_to,
    cat,
    chunk,
    clone,
    concat,
    concatenate,
    contiguous,
    expand,
    flatten,
    flip,
    fliplr,
    flipud,
    hstack,
    narrow,
    pad,
    permute,
    pixel_shuffle,
    pixel_unshuffle,
    repeat,
    repeat_interleave,
    reshape,
    roll,
    split,
    squeeze,
    stack,
    swapaxes,
    t,
    tile,
    transpose,
    tril,
    triu,
    unbind,
    unflatten,
    unsqueeze,
    view,
    vstack,
)
from ember.ops.pointwise import (
    abs,
    add,
    addcdiv,
    addcmul,
    bitwise_and,
    bitwise_not,
    bitwise_or,
    bitwise_xor,
    broadcast_shapes,
    ceil,
    clamp,
    clip,
    cos,
    div,
    divide,
    eq,
    erf,
    exp,
    exp2,
    expm1,
    floor,
    floor_divide,
    fmod,
    ge,
    gt,
    isfinite,
    isinf,
    isnan,
    le,
    lerp,
    log,
    log1p,
    log2,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    lt,
    masked_fill,
    maximum,
    minimum,
    mul,
    nan_to_num,
    ne,
    neg,
    pow,
    reciprocal,
    remainder,
    round,
    rsqrt,
    sign,
    sin,
    sqrt,
    square,
    sub,
    tanh,
    true_divide,
    trunc,
    where,
)
from ember.ops.pooling import (
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool2d,
    adaptive_max_pool3d,
    avg_pool2d,
    avg_pool3d,
    max_pool2d,
    max_pool3d,
)
from ember.ops.random import (
    bernoulli,
    dropout,
    initial_seed,
    manual_seed,
    multinomial,
    rand,
    rand_like,
    randint,
    randint_like,
    randn,
    randn_like,
    randperm,
)
from ember.ops.reduce import (
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    cosine_similarity,
    count_nonzero,
    cumsum,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    norm,
    prod,
    softmax,
    std,
    std_mean,
    sum,
    var,
    var_mean,
)
from ember.ops.sorting import argsort, sort, topk
from ember.tensor import Tensor

# Tensor methods that are the function of the same name with the tensor first.
_METHODS = """
exp log log1p sqrt rsqrt sin cos tanh erf reciprocal neg abs sign floor ceil round trunc sigmoid relu
exp2 log2 expm1 logical_not logical_and logical_or logical_xor add sub mul div floor_divide remainder fmod
pow maximum minimum eq ne lt le gt ge masked_fill clamp clip lerp isnan isinf isfinite nan_to_num square
addcmul addcdiv softmax log_softmax sum mean prod max min amax amin argmax argmin var std logsumexp all any
norm cumsum count_nonzero reshape view permute transpose t expand expand_as squeeze unsqueeze flatten
unflatten contiguous clone flip repeat tile split chunk unbind narrow roll tril triu repeat_interleave
matmul mm bmm dot gather scatter_add index_select broadcast_to sort argsort topk multinomial
""".split()
_MODULES = (pointwise, activations, reduce, movement, contraction, index, sorting, random)


def _lookup(name: str):
    for module in _MODULES:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


def _inplace(fn):
    def method(self, *args, **kwargs):
        return self.assign(fn(self, *args, **kwargs))
    method.__name__ = fn.__name__ + "_"
    return method


def _swap(fn):
    return lambda self, other: fn(other, self)


def _uniform_(self, a: float = 0.0, b: float = 1.0):
    return self.assign(rand(self.shape, device=self.device) * (b - a) + a)


def _normal_(self, mean: float = 0.0, std: float = 1.0):  # noqa: F811 - torch's argument names
    return self.assign(randn(self.shape, device=self.device) * std + mean)


def _bind() -> None:
    for name in _METHODS:
        setattr(Tensor, name, _lookup(name))
    for name in ("add sub mul div pow clamp clip masked_fill neg abs exp log sqrt relu sigmoid tanh "
                 "floor ceil round fmod remainder maximum minimum lerp addcmul addcdiv").split():
        setattr(Tensor, name + "_", _inplace(_lookup(name)))
    Tensor.uniform_ = _uniform_
    Tensor.normal_ = _normal_
    Tensor.where = lambda self, condition, other: where(condition, self, other)
    Tensor.view_as = movement.view_as
    Tensor.reshape_as = movement.reshape_as
    Tensor.T = property(movement.T)
    Tensor.mT = property(movement.mT)
    Tensor.__getitem__ = index.getitem
    Tensor.__setitem__ = index.setitem
    operators = {
        "add": add, "sub": sub, "mul": mul, "truediv": div, "floordiv": floor_divide, "mod": remainder,
        "pow": pow, "matmul": matmul, "and": bitwise_and, "or": bitwise_or, "xor": bitwise_xor,
    }
    for name, fn in operators.items():
        setattr(Tensor, f"__{name}__", fn)
        setattr(Tensor, f"__r{name}__", _swap(fn))
        setattr(Tensor, f"__i{name}__", _inplace(fn))
    comparisons = {"eq": eq, "ne": ne, "lt": lt, "le": le, "gt": gt, "ge": ge}
    for name, fn in comparisons.items():
        setattr(Tensor, f"__{name}__", fn)
    Tensor.__neg__ = neg
    Tensor.__pos__ = lambda self: self
    Tensor.__abs__ = abs
    Tensor.__invert__ = bitwise_not


_bind()


__all__ = [
    "abs", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d", "add",
    "addcdiv", "addcmul", "all", "amax", "amin", "any", "arange", "argmax", "argmin", "argsort", "avg_pool2d",
    "avg_pool3d", "bernoulli", "bitwise_and", "bitwise_not", "bitwise_or",
    "bitwise_xor", "bmm", "broadcast_shapes", "broadcast_to", "cat", "ceil", "chunk", "clamp", "clip", "clone",
    "concat", "concatenate", "contiguous", "conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d",
    "cos", "count_nonzero", "cumsum", "div", "divide", "dot", "dropout", "einsum",
    "elu", "embedding", "empty", "empty_like", "eq", "erf", "exp", "exp2", "expand", "expm1", "eye",
    "flatten", "flip", "fliplr", "flipud", "floor", "floor_divide", "fmod", "from_dlpack", "from_numpy", "full",
    "full_like", "gather", "ge", "gelu", "gt", "hardtanh", "hstack", "index_select", "initial_seed", "isfinite",
    "isinf", "isnan", "le", "leaky_relu", "lerp", "linear", "linspace", "log", "log1p", "log2", "log_softmax",
    "logical_and", "logical_not", "logical_or", "logical_xor", "logspace", "logsumexp", "lt", "manual_seed",
    "masked_fill", "matmul", "max", "max_pool2d", "max_pool3d", "maximum", "mean", "min", "minimum", "mish", "mm",
    "mul",
    "multinomial", "nan_to_num", "narrow", "ne", "neg", "norm", "one_hot", "ones", "ones_like", "outer", "pad",
    "permute", "pixel_shuffle", "pixel_unshuffle", "pow", "prelu", "cosine_similarity",
    "prod", "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "randperm", "reciprocal",
    "relu", "relu6", "remainder", "repeat", "repeat_interleave", "reshape", "roll", "round", "rsqrt",
    "scatter_add", "sigmoid", "sign", "silu", "sin", "softmax", "softplus", "sort", "split", "sqrt", "square",
    "squeeze", "stack", "std", "std_mean", "sub", "sum", "swapaxes", "t", "take_along_dim", "tanh", "tensor", "tile",
    "topk", "transpose", "tril", "triu", "true_divide", "trunc", "unbind", "unflatten", "unsqueeze", "var", "var_mean",
    "view", "vstack", "where", "zeros", "zeros_like",
]
