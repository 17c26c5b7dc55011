"""The compile context: every setting that changes what the compiler makes of a graph.

The runtime and `ember.explain` build one from the user's settings and pass it down to the planner
and the code generator, which read nothing else; it is part of the plan cache's key, so a changed
setting finds (or makes) its own plan instead of reusing one made under another.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember import dtypes
from ember.dtypes import DType


@dataclass(frozen=True)
class CompileContext:
    matmul_precision: str = "highest"  # as torch.set_float32_matmul_precision: "highest" is IEEE float32
    gemm_backend: str = "auto"  # "auto" (timed on the first run), "triton" or "cublas"
    max_streams: int = 1  # streams a captured plan's independent small kernels may spread over
    multiprocessors: int = 0  # the GPU's SMs, which tell a kernel too small to fill it (0: unknown)
    # "channels_last": half-precision convolutions, and the ops between them, on (N, H, W, C) memory
    conv_memory_format: str = "contiguous"
    # GEMMs with few output tiles and a long K split it over several programs per tile (see patterns.gemm.gemm_splits;
    # EMBER_SPLIT_K=0 turns it off)
    split_k: bool = True
    shared_memory: int = 0  # bytes of shared memory one block may use on the GPU (0: unknown, an H100's assumed)

    def dot_precision(self, dtype: DType) -> str:
        """How a dot multiplies tiles of `dtype`: "tf32" for float32 unless the precision is "highest"."""
        return "ieee" if dtype is not dtypes.float32 or self.matmul_precision == "highest" else "tf32"
