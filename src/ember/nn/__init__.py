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
