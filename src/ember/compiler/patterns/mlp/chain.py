"""What the MLP pattern's planning and lowering share: its payload (`MlpChain`), its limits and the blocks
an MLP kernel's programs use."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.compiler.emit import padded_width
from ember.compiler.fused import FusedKernel, Payload

MLP_MAX_WIDTH = 128  # widths of a chained MLP's layers (padded to powers of two) whose tiles stay on chip
# float32 elements of the weight-gradient accumulators one MLP kernel's programs keep in registers across their
# row tiles: two 64 x 64 gradients and a 16-wide output's (H100, a 5-layer 64-wide MLP's training step at 2^18
# rows, GPU time: 0.271 ms with two, 0.284 with three, 0.509 with all four (the backward kernel's registers
# spill); 8 warps instead of 4 did worse with two or three)
MLP_GRADIENT_ELEMENTS = 2 * 64 * 64 + 64 * 16
# Weights a persistent MLP program keeps on chip across its row tiles: up to the first size with 128-row
# tiles, up to the second with 64-row tiles, measured on H100/H200, whose blocks may use NOMINAL_SHARED_MEMORY;
# on a GPU with more or less (CompileContext.shared_memory, read from the device), in proportion
MLP_RESIDENT_BYTES = (48 * 1024, 144 * 1024)
NOMINAL_SHARED_MEMORY = 227 * 1024
MLP_MAX_SUMS = 8  # sums over its rows (see planning.absorb_sums) an MLP kernel takes at most


@dataclass(eq=False)
class MlpChain(Payload):
    """An MLP kernel's own: the layer computing each value it writes (id(output) -> layer), the weight-gradient
    GEMMs it sums per program beside its layers (dot(P^T, Q) over its rows, finished by a function of their own:
    partials added, epilogue run), its sums over its rows of values its layers compute (row kernels whose single
    sum it takes per program; its finishing launch adds the partials and runs their epilogues), and whether this
    is the form that holds no weights on chip (the runtime's fallback on a GPU with less shared memory)."""

    layers: dict[int, int] = field(default_factory=dict)
    absorbed: list[FusedKernel] = field(default_factory=list)
    summed: list[FusedKernel] = field(default_factory=list)
    streamed: bool = False

    def parts(self) -> list[FusedKernel]:
        return self.absorbed + self.summed


def mlp_widths(kernel: FusedKernel) -> list[int]:
    """An MLP kernel's widths: its input's, then each layer's output's."""
    return [kernel.cores[0].inputs[0].shape[-1]] + [c.shape[-1] for c in kernel.cores]


def written_intermediates(kernel: FusedKernel) -> int:
    """How many values other than the last layer's result an MLP kernel writes (for other kernels to read)."""
    last = len(kernel.cores) - 1
    return sum(1 for o in kernel.outputs if kernel.payload.layers.get(id(o), last) < last)


def mlp_blocks(widths: list[int], itemsize: int, shared_memory: int, written: int = 0, streamed: bool = False
               ) -> tuple[list[int], int, int, bool]:
    """An MLP kernel's widths padded for the matrix units (powers of two, at least 16), its rows per tile, its
    warps, and whether its programs are persistent (each loads the weights once and walks row tiles).
    `shared_memory`: what a block may use on the GPU (0: unknown, NOMINAL_SHARED_MEMORY assumed).
    `written`: the intermediate tiles it also stores, each of which may take a tile of shared memory to lay
    out for its store; `streamed`: hold no weights (the form that fits any GPU; the runtime falls back on it
    when a GPU cannot hold them)."""
    padded = [padded_width(w) for w in widths]
    weight_bytes = sum(a * b for a, b in zip(padded, padded[1:])) * itemsize
    if streamed:
        return padded, 128, 4, False
    share = (shared_memory or NOMINAL_SHARED_MEMORY) / NOMINAL_SHARED_MEMORY
    for rows, budget in ((128, MLP_RESIDENT_BYTES[0]), (64, MLP_RESIDENT_BYTES[1])):
        if weight_bytes + written * rows * max(padded) * itemsize <= int(budget * share):
            return padded, rows, 4, True
    return padded, 128, 4, False
