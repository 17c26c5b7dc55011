"""The fusion patterns, one module (or package) each: what a pattern claims in the graph (its planner steps), its
kernels' kinds, its payload and how its kernels lower to the kernel IR, on the generic planner
(compiler/planner.py) and the shared emitter (compiler/emit.py). PATTERNS is the order their steps run in
within a stage; adding a pattern is one module here and one entry below.
"""

from ember.compiler.patterns import attention, gemm, mlp, pointwise, rows

PATTERNS = (pointwise.PATTERN, rows.PATTERN, gemm.PATTERN, mlp.PATTERN, attention.PATTERN)
