"""ember.nn: modules, layers, losses, initialisation and `functional`, with PyTorch's names."""

from ember.nn import functional, init, parallel, utils
from ember.nn.attention import MultiheadAttention
from ember.nn.containers import ModuleDict, ModuleList, Sequential
from ember.nn.layers import (
    GELU,
    AdaptiveAvgPool2d,
    AvgPool2d,
    Conv2d,
    ConvTranspose2d,
    Dropout,
    Embedding,
    Flatten,
    Identity,
    LeakyReLU,
    Linear,
    LogSoftmax,
    MaxPool2d,
    ReLU,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    Tanh,
)
from ember.nn.losses import BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, NLLLoss, SmoothL1Loss
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
