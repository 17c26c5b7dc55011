"""The MLP pattern: GEMM kernels that feed each other through narrow activations (every width at most
MLP_MAX_WIDTH, each layer's outputs read by the next through its first operand, pointwise ops only) become one
kernel whose programs take a tile of rows through all the layers, the activations between them kept on chip,
writing only the values other kernels read; a GEMM summing over such a kernel's rows (a weight gradient) joins
it, its products summed per program as the rows pass, and so does a sum over its rows of values its layers
compute (a loss). Planning in planning.py, lowering in lowering.py, what both use (the payload `MlpChain`) in
chain.py.
"""

from __future__ import annotations

import dataclasses

from ember.compiler.fused import FusedKernel, KernelKind, Pattern, Stage
from ember.compiler.patterns.mlp.lowering import lower_mlp
from ember.compiler.patterns.mlp.planning import absorb_gradients, absorb_sums, chain_mlps


def streamed(kernel: FusedKernel) -> FusedKernel:
    """The MLP kernel's form holding no weights on chip, which fits any GPU (the runtime's fallback)."""
    return dataclasses.replace(kernel, payload=dataclasses.replace(kernel.payload, streamed=True))


PATTERN = Pattern("mlp", ((Stage.CHAIN, chain_mlps), (Stage.CHAIN, absorb_gradients), (Stage.CHAIN, absorb_sums)),
                  lowers=lambda k: k.kind is KernelKind.MLP, lower=lower_mlp, fallback=streamed)
