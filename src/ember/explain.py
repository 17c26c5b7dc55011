"""`ember.explain(*tensors)`: the fused plan of the pending graph, in words.

It compiles exactly as the cuda backend would (`ember.compiler.compile` for the triton
target) but launches nothing, so it works on any device and leaves the tensors pending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

from ember.compiler import CompileContext, compile, signature
from ember.compiler.fused import VENDOR_KINDS, FusedKernel, KernelKind, summed_views
from ember.device import get_conv_memory_format, get_matmul_precision
from ember.ir import Kind, Node, Op
from ember.runtime import executor


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def _is_work(n: Node) -> bool:
    """Whether eager execution would spend a kernel on this node (views and constants are free)."""
    return n.op.kind not in (Kind.LEAF, Kind.MOVEMENT)


def _attrs(n: Node) -> str:
    a = n.attrs
    if n.op.kind is Kind.REDUCE:
        return f", axes={list(a['axes'])}"
    if n.op is Op.CONST:
        return f"{a['value']}" if "arg" not in a else f"arg{a['arg']}={a['value']:.4g}"
    if n.op is Op.RAND:
        return a["distribution"]
    if n.op is Op.CAST:
        return f", {a['dtype'].name}"
    if n.op is Op.PERMUTE:
        return f", {list(a['order'])}"
    if n.op in (Op.GATHER, Op.SCATTER_ADD):
        return f", axis={a['axis']}"
    if n.op is Op.CHECK_INDEX:
        return f", {a['op_name']}: dim {a['dim']} of size {a['size']}"
    if n.op is Op.CONV2D and "folded" in a:  # compiler/conv_folding.py: the ops after it, now its weight and bias
        into = "its rescaled weight and bias" if len(n.inputs) == 3 else "its rescaled weight"
        return f"; folded {', '.join(a['folded'])} per channel into {into}"
    return ""


def _context(order: list[Node]) -> CompileContext:
    """What the runtime would compile this graph under: the user's settings, and for a cuda graph the GPU's
    (its SMs, split-K), as `cuda.compile_context` gives them; on the default stream (several are used only
    when asked for, in graphs)."""
    if order and order[0].device.type == "cuda":
        from ember.runtime import cuda  # torch: only for a cuda graph

        return dataclasses.replace(cuda.compile_context(order[0].device), max_streams=1)
    return CompileContext(get_matmul_precision(), conv_memory_format=get_conv_memory_format())


class Plan:
    """A planned (not launched) graph: its fused kernels and their generated sources."""

    def __init__(self, order: list[Node], keep: set[int]):
        self.signature = signature(order, keep)
        compiled = compile(order, keep, "triton", _context(order), self.signature)
        self.lowered, self.stored, self.schedule = compiled.lowered, compiled.stored, compiled.schedule
        self.context = compiled.context
        self.kernels = [ck.kernel for ck in compiled.kernels]
        self.sources = {id(ck.kernel): ck.source for ck in compiled.kernels if ck.source is not None}
        self.unfused = sum(1 for n in order if _is_work(n))
        self.numbering = {id(n): i for i, n in enumerate(self.lowered.nodes)}

    @property
    def launches(self) -> int:
        return sum(len(s.launches) for s in self.sources.values()) + sum(
            1 for k in self.kernels if k.kind in VENDOR_KINDS and k.core is None)

    @property
    def gemm_choices(self) -> list[dict]:
        """Per generated GEMM: its kernel index, the form chosen ("triton" or "cublas") and both forms'
        times in ms where they were measured (on this GPU, found in the autotune cache)."""
        return [dict(self._gemm_choice(k), kernel=k.index) for k in self.kernels if k.core is not None]

    def _gemm_choice(self, k: FusedKernel) -> dict:
        """What the runtime chose (or would choose) for a GEMM kernel, without profiling anything."""
        source = self.sources[id(k)]
        choice = {"chosen": "triton", "triton_ms": None, "cublas_ms": None, "config": None}
        if k.core.device.type != "cuda":
            return choice
        from ember.runtime import autotune, cuda  # torch and triton: only for a cuda graph's GEMM

        tuning = autotune.mode(cuda.TARGET.interpret)
        problem = autotune.Problem.of(source.launches[0], k.core.dtype, source.launches[0].layout)
        ranked = autotune.cached_configs(problem, tuning)
        config = ranked[0] if ranked else autotune.default_config(problem)
        timed = autotune.cached_choice(source.name, problem, tuning)
        if timed and timed.get("config"):
            config = autotune.Config(**timed["config"])
        choice["config"] = str(config)
        if self.context.gemm_backend != "auto":
            return dict(choice, chosen=self.context.gemm_backend, forced=True)
        return dict(choice, **{key: timed[key] for key in ("chosen", "triton_ms", "cublas_ms")}) if timed else choice

    @property
    def tilings(self) -> list[dict]:
        """Per launch whose source serves several configurations (an attention kernel's): its kernel index, function
        name, the configuration it runs with and how that was chosen (see `_tiling`)."""
        return [dict(self._tiling(k, launch), kernel=k.index) for k in self.kernels if id(k) in self.sources
                for launch in self.sources[id(k)].launches if len(launch.alternatives) > 1]

    def _tiling(self, k: FusedKernel, launch) -> dict:
        """What the runtime runs (or would run) a launch with alternatives under, without timing anything: the
        choice the autotune cache holds for it on this GPU, else its default. "config": the configuration's text,
        "candidates": how many it has, "ms": each one's time where they were timed, "why": otherwise, why the
        default."""
        tiling = {"function": launch.function, "config": str(launch.alternatives[0]),
                  "candidates": len(launch.alternatives), "ms": None, "why": "tuning off"}
        if k.outputs[0].device.type != "cuda":
            return tiling
        from ember.runtime import autotune, cuda  # torch and triton: only for a cuda graph's kernel

        tuning = autotune.mode(cuda.TARGET.interpret)
        if not autotune.enabled(tuning):
            return tiling
        if not autotune.launch_worth_tuning(launch.work, tuning):
            return dict(tiling, why="too small to tune")
        timed = autotune.cached_tiling(launch.function, [str(c) for c in launch.alternatives], tuning)
        if timed is None:
            return dict(tiling, why="not yet timed")
        return dict(tiling, config=timed["chosen"], ms=timed["ms"], why=None)

    def name(self, n: Node) -> str:
        return f"%{self.numbering[id(n)]}"

    def ref(self, n: Node) -> str:
        """An argument as explain shows it: constants by value, views around the node they read."""
        if n.op is Op.CONST:
            return f"{n.attrs['value']:.4g}" if "arg" not in n.attrs else f"arg{n.attrs['arg']}"
        if n.op.kind is Kind.MOVEMENT:
            word = "broadcast" if n.op is Op.EXPAND else n.op.label
            base = n
            while base.op.kind is Kind.MOVEMENT and base.op is not Op.EXPAND or base is n:
                base = base.inputs[0]
                if base.op.kind is not Kind.MOVEMENT:
                    break
            return f"{word}({self.ref(base)})"
        return self.name(n)

    def line(self, n: Node, outputs: list[Node]) -> str:
        args = ", ".join(self.ref(i) for i in n.inputs)
        text = f"{self.name(n)} = {n.op.label}({args}{_attrs(n)})"
        if n in outputs:
            text = f"{text:<44} -> out[{outputs.index(n)}]"
        return text

    def describe(self, k: FusedKernel) -> list[str]:
        parts = k.segments or [k]
        dtype = k.outputs[0].dtype.name if k.outputs else ""
        shape = list(k.space) if not k.segments else f"{len(k.segments)} segments"
        how = ""
        if k.core is not None:
            how = self._gemm_how(k)
        elif id(k) in self.sources and any(len(launch.alternatives) > 1 for launch in self.sources[id(k)].launches):
            how = "(triton, each launch's tiles below)"
        elif id(k) in self.sources:  # a row kernel's last stage; an MLP kernel's layers (its first launch)
            launches = self.sources[id(k)].launches
            launch = launches[0] if k.kind is KernelKind.MLP else launches[-1]
            blocks = "x".join(str(v) for v in launch.constexprs.values())
            how = f"(triton, BLOCK {blocks}, {launch.num_warps} warps)"
        else:
            how = "(vendor: torch)"
        over = f" over axes {list(k.axes)}" if k.axes else ""
        lines = [f"kernel {k.index}  {k.kind}  {shape} {dtype}{over}   {how}"]
        if k.kind is KernelKind.COLLECTIVE:
            lines.append(self._beside(k))
        for part in parts:
            if k.segments:
                lines.append(f"  segment   {list(part.space)}")
            shown = {id(n) for n in part.covers if _is_work(n) or n.op is Op.RAND or n in part.outputs}
            mainloop = [n for n in part.covers if id(n) in shown and any(n in p for p in part.prologues)]
            epilogue = [n for n in part.epilogue if id(n) in shown]
            if part.kind is KernelKind.MLP:  # layer by layer: a core, then what its result goes through; each
                # gradient it sums, then its finishing epilogue
                sections = [(mainloop, "mainloop")]
                chain = part.payload
                gradients = {id(g.core): [g.core] for g in chain.absorbed}
                summed = {id(r): gradients[id(g.core)] for g in chain.absorbed for r in g.reductions}  # bias sums
                sums, stages = {}, {}  # each sum over its rows, and its first stage's (a staged sum's) with it
                for f in chain.summed:
                    (r,) = f.reductions
                    sums[id(r)] = []
                    first = summed_views(r)[2]
                    if first is not None:
                        stages[id(first)] = sums[id(r)]
                for n in part.covers:
                    if n in part.cores:
                        sections += [([n], f"layer {part.cores.index(n)}"), ([], "epilogue")]
                    elif id(n) in gradients:
                        sections += [(gradients[id(n)], "gradient"), ([], "finish")]
                    elif id(n) in stages:
                        stages[id(n)].append(n)
                    elif id(n) in sums:
                        sections += [(sums[id(n)] + [n], "sum"), ([], "finish")]
                    elif id(n) in summed:
                        summed[id(n)].append(n)  # with its gradient, wherever that is listed
                    elif n in epilogue and len(sections) > 1:
                        sections[-1][0].append(n)
            else:
                sections = ((mainloop, "mainloop" if part.cores else "ops"), (part.cores, "core"),
                            (epilogue, "epilogue" if part.cores else "ops"))
            for group, title in sections:
                for i, n in enumerate(group):
                    lines.append(f"  {title if i == 0 else '':<9} {self.line(n, part.outputs)}")
        for decision in k.decisions:
            lines.append(f"  decision  {decision}")
        if id(k) in self.sources:
            lines += [f"  tiles     {line}" for line in self._tiles_text(k)]
        read = sum(n.numel * n.dtype.itemsize for n in k.reads)
        written = sum(n.numel * n.dtype.itemsize for n in k.outputs)
        replaced = sum(1 for n in k.covers if _is_work(n))
        lines.append(f"  reads {_mib(read)}  writes {_mib(written)}  replaces {replaced} unfused kernels")
        return lines

    def _tiles_text(self, k: FusedKernel) -> list[str]:
        """A line per launch with alternatives: its function, the configuration it runs with, and how chosen."""
        lines = []
        for launch in self.sources[id(k)].launches:
            if len(launch.alternatives) < 2:
                continue
            tiling = self._tiling(k, launch)
            of = f"of {tiling['candidates']} candidates"
            if tiling["ms"] is None:
                how = f"the default {of} ({tiling['why']})"
            else:
                times = ", ".join(f"{ms:.3f}" for ms in sorted(tiling["ms"].values()))
                how = f"timed fastest {of}: {tiling['ms'].get(tiling['config'], math.nan):.3f} ms (all: {times} ms)"
            lines.append(f"{launch.function}: {tiling['config']}; {how}")
        return lines

    def _beside(self, k: FusedKernel) -> str:
        """What a collective overlaps on the GPU: the launches between it and the first that waits for it."""
        position = next(p for p, other in enumerate(self.kernels) if other is k)
        join = next(q for q, waits in self.schedule.joins.items() if position in waits)
        beside = [str(other.index) for other in self.kernels[position + 1:join]
                  if other.kind is not KernelKind.COLLECTIVE]  # the collectives after it queue behind it
        waits = f"kernel {self.kernels[join].index} waits for it" if join < len(self.kernels) else \
            "the plan's end waits for it"
        return f"  stream    communication, beside {'kernels ' + ', '.join(beside) if beside else 'no kernel'}; {waits}"

    def _gemm_how(self, k: FusedKernel) -> str:
        choice = self._gemm_choice(k)
        config = choice["config"] or "BLOCK sizes tuned on the GPU"
        parts = len(k.payload.kernels) - 1  # the split form's kernels besides the vendor call
        split = f"cuBLAS + {parts} kernel{'s' if parts != 1 else ''}"
        if choice.get("forced"):
            timing = f"forced: {'the generated kernel' if choice['chosen'] == 'triton' else split}"
        elif choice["triton_ms"] is None and choice["chosen"] == "cublas":
            timing = f"{split}: the generated kernel does not fit this GPU"
        elif choice["triton_ms"] is None:
            timing = f"or {split}, not yet timed"
        else:
            timing = (f"triton {choice['triton_ms']:.3f} ms vs {split} {choice['cublas_ms']:.3f} ms -> "
                      f"{choice['chosen']}")
        splits = self.sources[id(k)].launches[0].splits if id(k) in self.sources else 1
        if splits > 1:
            config = f"{config}, K split over {splits} programs per tile"
        return f"(triton GEMM, {config}; {timing})"

    def __str__(self) -> str:
        lines = []
        for k in self.kernels:
            lines += self.describe(k)
        lines.append(f"{len(self.kernels)} fused kernels ({self.launches} launches) for {self.unfused} unfused "
                     f"kernels; {len(self.lowered.nodes)} nodes after passes")
        sched = self.schedule
        if sched.slots:
            lines.append(f"memory: {len(sched.slots)} intermediates of {_mib(sched.intermediate_bytes)} share an "
                         f"arena of {_mib(sched.arena_bytes)} (reused by lifetime)")
        return "\n".join(lines)


def plan(*tensors) -> Plan:
    """The fused plan that computing these tensors (and what they need) would run. Values the graph
    copies from another device are moved first, as the runtime moves them before it plans."""
    nodes = [t._node for t in tensors if not t._node.realized]
    order = executor.pending_on_one_device(nodes)
    return Plan(order, {id(n) for n in nodes} | {id(n) for n in order if n.is_held()})


def explain(*tensors, file=None) -> Plan:
    """Print the fused plan that computing these tensors would run; return it for inspection."""
    p = plan(*tensors)
    print(p, file=file)
    return p


@contextlib.contextmanager
def capture():
    """Plan every realization inside the block, e.g. a whole `optimizer.step()`:

        with ember.explain.capture() as plans:
            optimizer.step()
        print(plans[0])
    """
    plans: list[Plan] = []

    def observe(order, keep):
        plans.append(Plan(order, keep))

    executor.this_thread.observers.append(observe)
    try:
        yield plans
    finally:
        executor.this_thread.observers.remove(observe)


# `ember.explain` is this function; its helpers hang on it so `ember.explain.plan(...)` reads naturally
explain.plan = plan
explain.capture = capture


__all__ = ["Plan", "explain", "plan"]
