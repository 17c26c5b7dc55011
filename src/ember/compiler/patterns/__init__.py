"""Fusion patterns, one module each: what a kind of kernel computes and how it is lowered to the kernel IR
(pointwise and scatter-add, rows, gemm, mlp), on the shared emitter (compiler/emit.py)."""
