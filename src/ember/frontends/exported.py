"""`from_torch` through torch.export: a torch module run from the core ATen graph torch.export captures of it.

torch.export (TorchDynamo) captures the forward whole, whatever Python it is written in: library helpers,
`torch._assert`, `**kwargs` forwards, branches on shapes (specialized). The program is decomposed to core ATen
and run by `ember.frontends.aten.AtenGraph` on ember tensors, so it needs no per-layer mapping. The imported module
holds the torch module's parameters and buffers (shared, at the same dotted names, in submodules of the same tree),
so `state_dict()`, `parameters()`, training and `load_state_dict` work as for the layer-by-layer import.

A program is captured at the first call in each training mode (the modes of the ember submodules are copied onto
the torch ones first), with the first dimension of every tensor argument dynamic where torch.export allows, so
other batch sizes run the same program; where it does not (a first call of batch 1, a model whose batch size is
fixed, a program ember runs at static shapes only: an as_strided of symbolic layout), the program serves those
shapes and others are captured again. Buffers the program updates (batch norm's running statistics) take their new
values, computed with the step that follows.
"""

from __future__ import annotations

from ember.frontends.aten_graph import AtenGraph
from ember.nn.module import Module
from ember.tensor import Tensor


class Exported(Module):
    """A torch module imported through torch.export; `problems`: why the layer-by-layer import could not take
    it (said again if the export fails too)."""

    def __init__(self, module, importer, problems: list[str] = ()) -> None:
        from ember.frontends.torch import Part

        super().__init__()
        object.__setattr__(self, "_torch", module)
        self._problems = list(problems)
        self._programs: dict[tuple, tuple] = {}
        parts = {"": self}
        for path, sub in module.named_modules(remove_duplicate=False):
            if path and path not in parts:
                part = Part(type(sub).__name__)
                object.__setattr__(part, "training", sub.training)
                owner, _, name = path.rpartition(".")
                parts[owner].add_module(name, part)
                parts[path] = part
            owner = parts[path]
            for name, p in sub._parameters.items():
                if p is not None and name not in owner._parameters:
                    owner.register_parameter(name, importer.shared(p))
            for name, b in sub._buffers.items():
                if b is not None and name not in owner._buffers:
                    owner.register_buffer(name, importer.shared(b),
                                          persistent=name not in sub._non_persistent_buffers_set)
        object.__setattr__(self, "training", module.training)

    def forward(self, *args, **kwargs):
        import torch.utils._pytree as pytree

        modes = tuple(m.training for m in self.modules())
        flat = pytree.tree_flatten((args, kwargs))[0]
        shapes = tuple(v.shape if isinstance(v, Tensor) else v for v in flat)
        program = self._programs.get(modes) or self._programs.get((modes, shapes))
        if program is None:
            program = self._export(args, kwargs)
            self._programs[modes if program[3] else (modes, shapes)] = program
        graph, specs, out_spec, _ = program
        leaves = iter(flat)
        named = self._tensors()
        inputs = []
        for spec in specs.input_specs:
            kind = spec.kind.name
            if kind in ("PARAMETER", "BUFFER"):
                inputs.append(named[spec.target])
            elif kind == "USER_INPUT":
                inputs.append(next(leaves))
            else:  # a constant tensor the program holds
                inputs.append(self._constants[spec.target])
        device = next((t.device for t in named.values()), None)
        if device is not None:  # the module may have moved since the capture
            inputs = [t.to(device) if isinstance(t, Tensor) and t.device != device and spec.kind.name != "USER_INPUT"
                      else t for t, spec in zip(inputs, specs.input_specs)]
        outputs = graph(*inputs, device=device)
        results = []
        for spec, value in zip(specs.output_specs, outputs):
            kind = spec.kind.name
            if kind == "BUFFER_MUTATION":
                self._update(named[spec.target], value)
            elif kind == "USER_OUTPUT":
                results.append(value)
            else:
                raise NotImplementedError(f"from_torch: an exported program's {kind} output is not supported")
        return pytree.tree_unflatten(results, out_spec)

    def _tensors(self) -> dict[str, Tensor]:
        """Every parameter and buffer by its dotted name, a tied one under each of its names (the program may
        name it by any)."""
        named = {}
        for path, m in self.named_modules():
            for name, t in (*m._parameters.items(), *m._buffers.items()):
                if t is not None:
                    named[f"{path}.{name}" if path else name] = t
        return named

    def _export(self, args, kwargs):
        import torch
        from torch.export import Dim

        from ember.frontends.dynamo import _to_ember

        mine = dict(self.named_modules())
        for path, theirs in self._torch.named_modules():
            if path in mine:
                theirs.training = mine[path].training
        example = torch.utils._pytree.tree_map(lambda v: torch.from_dlpack(v) if isinstance(v, Tensor) else v,
                                               (args, kwargs))
        spec = lambda v: {0: Dim.AUTO} if isinstance(v, torch.Tensor) and v.ndim else None  # noqa: E731
        dynamic = tuple(torch.utils._pytree.tree_map(spec, v) for v in (*example[0], *example[1].values()))
        what = f"{type(self._torch).__name__} exported"
        try:
            try:
                program = torch.export.export(self._torch, example[0], example[1],
                                              dynamic_shapes=dynamic).run_decompositions(_decompositions())
                graph = AtenGraph(program.graph_module.graph, what)
            except Exception:  # a first dimension that cannot vary, in torch or in ember: one program for this shape
                program = torch.export.export(self._torch, example[0], example[1]).run_decompositions(
                    _decompositions())
                graph = AtenGraph(program.graph_module.graph, what)
        except Exception as error:
            before = f" (imported layer by layer it was refused: {'; '.join(self._problems)})" if self._problems else ""
            raise TypeError(f"from_torch: cannot import {type(self._torch).__name__} through torch.export{before}: "
                            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
        constants = program.constants
        object.__setattr__(self, "_constants", dict(zip(constants, _to_ember(list(constants.values()), None))))
        return graph, program.graph_signature, program.call_spec.out_spec, _batch_is_dynamic(program)

    @staticmethod
    def _update(buffer: Tensor, value: Tensor) -> None:
        """A buffer the program updated takes the new value, computed with the next realization (the optimizer's
        step), so updates do not chain from step to step."""
        from ember.autograd import no_grad
        from ember.runtime.executor import realize_with_next

        with no_grad():
            buffer._show(value.detach()._node)
        realize_with_next(buffer._node)


def _batch_is_dynamic(program) -> bool:
    """Whether every tensor argument's first dimension is symbolic in the exported program."""
    import torch

    names = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    values = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder" and n.name in names]
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.ndim]
    return bool(tensors) and all(not isinstance(v.shape[0], int) for v in tensors)


def _decompositions() -> dict:
    """torch.export's core ATen decompositions, less those ember runs as one operator of its own: attention
    (`scaled_dot_product_attention` is ember's fused attention; torch's decomposition of it re-traced on the cpu
    gives an output of other strides than the export recorded, and a `view` of it that the model makes fails)."""
    import torch

    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
    return table
