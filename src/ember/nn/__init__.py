"""ember.nn: modules, layers, losses, initialisation and `functional`, with PyTorch's names."""

from ember.nn import functional, init, parallel, utils
from ember.nn.attention import MultiheadAttention
from ember.nn.containers import ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential
from ember.nn.layers import (
    ELU,
    GELU,
    GLU,
    AdaptiveAvgPool2d,
    AvgPool2d,
    Conv2d,
    ConvTranspose2d,
    CosineSimilarity,
    Dropout,
    Dropout2d,
    Embedding,
    Flatten,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    LeakyReLU,
    Linear,
    LogSoftmax,
    MaxPool2d,
    Mish,
    PixelShuffle,
    PixelUnshuffle,
    PReLU,
    ReLU,
    ReLU6,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    Tanh,
    Unflatten,
    ZeroPad2d,
)
from ember.nn.losses import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HuberLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)
from ember.nn.module import Module, Parameter
from ember.nn.normalization import BatchNorm1d, BatchNorm2d, LayerNorm, RMSNorm
from ember.nn.transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "AdaptiveAvgPool2d", "AvgPool2d", "BCELoss", "BCEWithLogitsLoss", "BatchNorm1d", "BatchNorm2d", "Conv2d",
    "ConvTranspose2d", "CrossEntropyLoss", "Dropout", "Embedding", "Flatten", "GELU", "Identity", "L1Loss",
    "LayerNorm", "LeakyReLU", "Linear", "LogSoftmax", "MSELoss", "MaxPool2d", "Module", "ModuleDict", "ModuleList",
    "MultiheadAttention", "NLLLoss", "Parameter", "RMSNorm", "ReLU", "SiLU", "Sequential", "Sigmoid", "SmoothL1Loss",
    "Softmax", "Softplus", "Tanh", "Transformer", "TransformerDecoder", "TransformerDecoderLayer",
    "TransformerEncoder", "TransformerEncoderLayer", "functional", "init", "parallel", "utils",
]

# group and instance normalisation, 1-d convolution and pooling, adaptive max pooling, resampling
from ember.nn.layers import (  # noqa: E402
    AdaptiveAvgPool1d,
    AdaptiveMaxPool1d,
    AdaptiveMaxPool2d,
    AvgPool1d,
    Conv1d,
    MaxPool1d,
    Upsample,
    UpsamplingBilinear2d,
    UpsamplingNearest2d,
)
from ember.nn.normalization import GroupNorm, InstanceNorm1d, InstanceNorm2d  # noqa: E402

__all__ += [
    "AdaptiveAvgPool1d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AvgPool1d", "Conv1d", "GroupNorm",
    "InstanceNorm1d", "InstanceNorm2d", "MaxPool1d", "Upsample", "UpsamplingBilinear2d", "UpsamplingNearest2d",
]
__all__ += [
    "CosineSimilarity", "Dropout2d", "ELU", "GLU", "Hardsigmoid", "Hardswish", "Hardtanh", "HuberLoss", "KLDivLoss",
    "Mish", "PReLU", "ParameterDict", "ParameterList", "PixelShuffle", "PixelUnshuffle", "ReLU6", "Unflatten",
    "ZeroPad2d",
]
