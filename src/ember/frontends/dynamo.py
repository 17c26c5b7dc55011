"""`torch.compile(model, backend="ember")`: torch's training and inference code, run on ember's kernels.

Registered under torch's backend entry point (`torch_dynamo_backends`), so `backend="ember"` works once ember is
installed. TorchDynamo captures the Python; AOTAutograd splits each captured graph into a forward and a backward
graph of core ATen operators (torch's decompositions applied to the rest) and functionalizes them; each graph is
run by `ember.frontends.aten_graph.AtenGraph` on ember tensors that share the memory of torch's (DLPack, no
copies), built from its template after the first call and realized as one ember plan per call: its operators fused
by ember's compiler, its plans cached, and on a GPU each graph's calls replayed as CUDA graphs (ember.jit; the
results torch keeps get buffers of their own). What dynamo cannot capture runs in torch between the graphs (graph
breaks), as with any backend; an optimizer step dynamo captures is one more graph.

Options (`torch.compile(..., backend="ember", options={...})`): none yet.
"""

from __future__ import annotations

from ember.frontends.aten import _NotComputed
from ember.frontends.aten_graph import AtenGraph
from ember.jit import jit
from ember.tensor import Tensor, realize


def backend(gm, example_inputs, **options):
    """The TorchDynamo backend: AOTAutograd with ember running the forward, backward and inference graphs."""
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_compile, bw_compiler=_compile, inference_compiler=_compile,
                        decompositions=core_aten_decompositions())(gm, example_inputs)


def _compile(gm, example_inputs):
    """A boxed callable running the ATen graph `gm` on ember (AOTAutograd passes the inputs as one list)."""
    import torch

    graph = AtenGraph(gm.graph, "graph torch.compile captured")
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    constants = {name: _to_ember(getattr(gm, name)) for name in graph.attribute_names}  # the graph's own tensors

    def step(*inputs):
        return graph(*inputs, attributes=constants.__getitem__)

    # on a GPU, recorded and replayed as CUDA graphs, one per binding of its inputs' buffers (ember.jit): a plan
    # whose inputs are torch's tensors is no steady chain of the lazy path, which would run it launch by launch
    step = jit(step) if device.type == "cuda" else step

    def run(args: list) -> list:
        inputs = [_to_ember(a) for a in args]
        args.clear()  # AOTAutograd's boxed convention: the inputs can be freed as soon as they are read
        return _to_torch(step(*inputs), device)

    run._boxed_call = True
    return run


def _to_ember(value):
    import torch

    if isinstance(value, torch.Tensor):
        from ember.ops.creation import from_dlpack

        return from_dlpack(value.detach())
    return value


def _to_torch(outputs, device) -> list:
    import torch

    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    realize(*[o for o in outputs if isinstance(o, Tensor)])
    result = []
    for o in outputs:
        if isinstance(o, Tensor):
            result.append(torch.from_dlpack(o))
        elif isinstance(o, _NotComputed):  # read by no one but the backward ember derives for itself
            result.append(torch.empty(o.shape, device=device))
        else:
            result.append(o)
    return result


def _register() -> None:
    """`backend="ember"` without the installed entry point (ember on the path but not installed): registered when
    this module is imported."""
    try:
        from torch._dynamo import list_backends, register_backend
    except ImportError:
        return
    if "ember" not in list_backends(exclude_tags=()):
        register_backend(name="ember")(backend)


_register()
