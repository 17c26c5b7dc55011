"""Every primitive declares its rules in one place (the rules table, `ember.ir.ops.RULES`): a shape and
dtype rule, a VJP (or that it has none), a reference implementation and a lowering per code generator.
A primitive missing a rule fails here, not at run time."""

from __future__ import annotations

import numpy as np
import pytest

import ember  # importing ember declares the rules
from ember.compiler import emit
from ember.compiler.targets import reference
from ember.ir import Kind, Node, Op
from ember.ir.ops import NOT_DIFFERENTIABLE, RULES, TARGETS, infer

POINTWISE = [op for op in Op if op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY)]
REDUCTIONS = [op for op in Op if op.kind is Kind.REDUCE]


PRIMITIVES = [op for op in Op if op.kind is not Kind.COMPOSITE]
COMPOSITES = [op for op in Op if op.kind is Kind.COMPOSITE]


@pytest.mark.parametrize("op", PRIMITIVES, ids=lambda op: op.label)
def test_every_primitive_declares_its_shape_vjp_and_reference_rules(op):
    rules = RULES[op]
    assert callable(rules.shape), f"{op}: no shape rule"
    assert callable(rules.vjp) or rules.vjp == NOT_DIFFERENTIABLE, f"{op}: no VJP, nor a statement that it has none"
    assert callable(rules.reference), f"{op}: no reference implementation"


@pytest.mark.parametrize("op", COMPOSITES, ids=lambda op: op.label)
def test_every_composite_declares_its_shape_rule_vjp_and_expansion_and_nothing_a_primitive_has(op):
    rules = RULES[op]
    assert callable(rules.shape) and callable(rules.expand), f"{op}: a rule is missing"
    assert callable(rules.vjp) or rules.vjp == NOT_DIFFERENTIABLE, f"{op}: no VJP, nor a statement that it has none"
    assert rules.reference is None and not rules.lowerings, f"{op}: the compiler expands it before it runs"


@pytest.mark.parametrize("op", PRIMITIVES, ids=lambda op: op.label)
def test_every_primitive_has_a_lowering_for_every_target(op):
    """A pointwise primitive declares its expression per code generator and is rendered from the kernel IR
    as a Prim, unless the lowering computes it itself (an index check, which also records what it finds);
    every other primitive is lowered into the kernel IR by compiler/lower.py (folded into an index, reduced,
    a GEMM core, a vendor call), which says how for each."""
    if op in POINTWISE and op not in emit.STRUCTURAL:
        for target in TARGETS:
            assert callable(RULES[op].lowerings.get(target)), f"{op}: no {target} lowering"
    else:
        assert emit.STRUCTURAL.get(op), f"{op}: the kernel IR has no lowering for it"


@pytest.mark.parametrize("dtype", [ember.float32, ember.float16, ember.int32, ember.int8, ember.bool],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("op", REDUCTIONS, ids=lambda op: op.label)
def test_every_reduction_declares_its_identity_and_reducing_it_with_a_value_gives_that_value(op, dtype):
    identity = RULES[op].identity(dtype)
    for value in [not identity] if dtype is ember.bool else [-3, 3]:
        pair = Node.from_buffer(np.array([identity, value], dtype=dtype.np), dtype, ember.device("cpu").device)
        reduced = Node.make(op, (pair,), axes=(0,))
        result = reference.evaluate(reduced, [pair.buffer]).item()
        assert result == (1 if op in (Op.ARGMAX, Op.ARGMIN) else value)  # the index of the value, or the value


def constant(shape) -> Node:
    return Node(Op.CONST, (), {}, shape, ember.float32, ember.device("cpu").device)


@pytest.mark.parametrize("op", [op for op in POINTWISE if RULES[op].vjp == NOT_DIFFERENTIABLE],
                         ids=lambda op: op.label)
def test_only_a_bool_valued_primitive_states_it_has_no_derivative(op):
    operands = (constant((2,)),) * (1 if op.kind is Kind.UNARY else 2)
    assert infer(op, operands, {})[1] is ember.bool


@pytest.mark.parametrize("op", [op for op in POINTWISE if op.kind is Kind.BINARY], ids=lambda op: op.label)
def test_binary_shape_rules_refuse_operands_of_different_shapes(op):
    a, b = constant((2, 3)), constant((3, 2))
    with pytest.raises(ember.ShapeError, match=op.label):
        infer(op, (a, b), {})
    assert infer(op, (a, a), {})[0] == (2, 3)
