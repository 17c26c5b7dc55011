"""The MLP pattern's planner steps: chains of narrow GEMM kernels become one kernel (`chain_mlps`), which then
takes the weight-gradient GEMMs summing over its rows (`absorb_gradients`) and the sums over its rows of values
its layers compute (`absorb_sums`)."""

from __future__ import annotations

from ember.compiler.emit import padded_width
from ember.compiler.fused import (
    FULL,
    ROW,
    FusedKernel,
    KernelKind,
    mib,
    summed_operand,
    summed_output,
    summed_views,
)
from ember.compiler.kernel_graph import closes_cycle
from ember.compiler.patterns.mlp.chain import (
    MLP_GRADIENT_ELEMENTS,
    MLP_MAX_SUMS,
    MLP_MAX_WIDTH,
    MlpChain,
    mlp_blocks,
    mlp_widths,
    written_intermediates,
)
from ember.compiler.planner import Planner
from ember.ir import Kind, Node, Op


def chain_mlps(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """GEMM kernels that feed each other, each one's outputs read by the next through its first
    operand (its mainloop, pointwise ops only), with the same rows, dtype and every width at most
    MLP_MAX_WIDTH, become one kernel: each program takes a tile of rows through all the layers, the
    activations between them kept on chip. An intermediate that other kernels read too (a training
    step's backward reads the forward's) is also written by the layer that computes it, from registers.
    A wider layer keeps per-layer GEMMs."""
    gemms = [k for k in kernels if _chainable(planner, k)]
    if len(gemms) < 2:
        return kernels
    refs = {id(k): planner.references(k) for k in kernels}
    deps = planner.dependencies(kernels, refs)
    feeds: dict[int, FusedKernel] = {}  # id(kernel) -> the kernel it feeds
    fed: set[int] = set()
    for k in gemms:
        for nxt in gemms:
            if nxt is not k and id(nxt) not in fed and _feeds(planner, k, nxt):
                feeds[id(k)] = nxt
                fed.add(id(nxt))
                break
    chains = []
    starts = [k for k in gemms if id(k) not in fed and id(k) in feeds]
    for k in starts:
        chain = [k]
        while id(chain[-1]) in feeds:
            nxt = feeds[id(chain[-1])]
            if not _extends(planner, chain, nxt, refs, deps):  # it starts a chain of its own
                if id(nxt) in feeds:
                    starts.append(nxt)
                break
            chain.append(nxt)
        if len(chain) > 1:
            chains.append(chain)
    parts = []  # (the layers of one MLP kernel, what it says)
    for chain in chains:
        widths = [chain[0].core.inputs[0].shape[-1]] + [k.core.shape[-1] for k in chain]
        text = "-".join(map(str, widths))
        runs = _narrow_runs(widths)
        if not runs:  # no two narrow layers side by side: the whole chain is GEMMs
            wide = next(w for w in widths if w > MLP_MAX_WIDTH)
            for k in chain:
                k.decisions.append(f"per-layer GEMMs: a chain of {len(chain)} layers, widths {text}; width {wide} "
                                   f"is over {MLP_MAX_WIDTH}, more than fits on chip")
            continue
        for i, k in enumerate(chain):
            if not any(start <= i < stop for start, stop in runs):
                wide = max(widths[i], widths[i + 1])
                why = (f"width {wide} is over {MLP_MAX_WIDTH}, more than fits on chip" if wide > MLP_MAX_WIDTH
                       else "no narrow layer beside it to share a kernel with")
                k.decisions.append(f"per-layer GEMM for layer {i + 1} of a chain of {len(chain)} layers, widths "
                                   f"{text}: {why}")
        for start, stop in runs:
            said = f"one kernel: {stop - start} layers, widths {'-'.join(map(str, widths[start:stop + 1]))}"
            if stop - start < len(chain):
                said += f" (layers {start + 1}-{stop} of a chain of {len(chain)}, widths {text})"
            parts.append((chain[start:stop], said))
    for chain, said in parts:
        last = chain[-1]
        members = {id(k) for k in chain}
        mlp = FusedKernel(KernelKind.MLP, last.space, (), [], {}, payload=MlpChain())
        sums = []
        for layer, k in enumerate(chain):
            sums += _column_sums(planner, k)
            for o in k.outputs:
                if summed_output(k, o) is not None:
                    continue
                read_elsewhere = any(id(o) in r for key, r in refs.items() if key not in members)
                if k is last or read_elsewhere or id(o) in planner.output_ids:
                    mlp.outputs.append(o)
                    mlp.levels[id(o)] = FULL
                    mlp.payload.layers[id(o)] = layer
                else:
                    planner.stored.discard(id(o))
        mlp.cores = [k.core for k in chain]
        mlp.decisions = [said]
        for f in sums:  # described now that the chain's values stay on chip
            _take_sum(planner, mlp, f, "adding each row tile's sums atomically")
        note_written(mlp)
        at = kernels.index(last)
        kernels[at] = mlp
        for k in chain[:-1]:
            kernels.remove(k)
    if not parts:
        return kernels
    # an intermediate's readers may have come before the last layer: launch in dependency order again
    return planner.kernel_order(kernels, {id(k): planner.references(k) for k in kernels})


def _chainable(planner: Planner, k: FusedKernel) -> bool:
    """A 2-d GEMM kernel whose outputs are its epilogue's values, or sums of them over its rows (each column's,
    which a chain takes per program: see `_column_sums`)."""
    core = k.core
    if k.kind is not KernelKind.MATMUL or core is None or len(core.shape) != 2 or core.shape[0] == 0:
        return False
    sums = _column_sums(planner, k)
    return sums is not None and len(sums) <= MLP_MAX_SUMS and all(
        o.shape == core.shape or summed_output(k, o) is not None for o in k.outputs)


def _column_sums(planner: Planner, k: FusedKernel) -> list[FusedKernel] | None:
    """A GEMM kernel's epilogue sums over its rows (one per column, which it would add across its row tiles
    atomically), each as a row kernel of its own that an MLP kernel takes per program (`absorb_sums`); None
    if it has other reductions."""
    found = []
    for r in k.reductions:
        if r.op is not Op.SUM or tuple(r.attrs["axes"]) != (0,) or not r.dtype.is_floating_point or (
                r.inputs[0].shape != k.core.shape or summed_operand(k.core, r) is not None):
            return None
        outputs = [o for o in k.outputs if summed_output(k, o) is r]
        found.append(FusedKernel(KernelKind.REDUCE, k.core.shape, (0,), outputs, {id(o): ROW for o in outputs},
                                 [r]))
    return found


def _feeds(planner: Planner, k: FusedKernel, nxt: FusedKernel) -> bool:
    """Whether `nxt`'s first operand is computed from `k`'s outputs, element for element (pointwise ops
    only, so each program has the rows it needs in registers), with the same rows and element type, and
    its weight is not."""
    if nxt.core.dtype is not k.core.dtype or nxt.core.shape[0] != k.core.shape[0]:
        return False
    outputs = {id(o) for o in k.outputs}
    if outputs & planner.given:
        return False
    operand, weight = nxt.core.inputs
    if id(weight) in outputs or any(id(r) in outputs for r in planner.inside(weight)[1]):
        return False
    if id(operand) in outputs:
        return True
    inside, reads = planner.inside(operand)
    if not any(id(r) in outputs for r in reads):
        return False
    # every op between the operand and k's outputs is elementwise over the same [rows, width] positions
    return all(n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) and n.shape == operand.shape
               for n in inside if planner.cone_reaches(n, outputs))


def _extends(planner: Planner, chain: list[FusedKernel], nxt: FusedKernel, refs: dict, deps: dict) -> bool:
    """Whether `nxt` can join the chain as its next layer: of the chain's outputs it reads only those of
    the layer before it (the registers it was fed from), and nothing it reads waits on the chain."""
    members = {id(k) for k in chain} | {id(nxt)}
    earlier = {id(o) for k in chain[:-1] for o in k.outputs}
    if earlier & set(refs[id(nxt)]):
        return False
    fed = {id(o) for o in chain[-1].outputs}
    stack, seen = [o for o in nxt.outputs if o is not nxt.core], set()
    while stack:  # the epilogue (above the accumulator) reads what fed the operand: not in registers there
        n = stack.pop()
        if id(n) in seen or n is nxt.core:
            continue
        seen.add(id(n))
        if id(n) in fed:
            return False
        if id(n) not in planner.stored or n in nxt.outputs:
            stack.extend(n.inputs)
    seen, frontier = set(), [d for d in deps[id(nxt)] if d not in members]
    while frontier:
        d = frontier.pop()
        if d in members:
            return False  # a kernel outside the chain between two of its layers: a cycle
        if d not in seen:
            seen.add(d)
            frontier.extend(deps[d])
    return True


def absorb_gradients(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """A GEMM summing over an MLP kernel's rows, dot(P^T, Q) with P and Q [rows, w] (a layer's weight
    gradient: P the gradient at the layer's output, Q its input), joins the MLP kernel whose row tiles
    compute or load most of its operands' bytes: each of its programs adds its row tiles' products (and
    the operands' sums along the rows, a bias gradient) to an accumulator in registers and stores one
    partial; a second function adds the partials and runs the GEMM's epilogue (an optimizer update).
    Operands the MLP kernel computes are then not written, and none is read again by a GEMM. Each MLP
    kernel takes gradients up to MLP_GRADIENT_ELEMENTS accumulator elements, the largest savings first."""
    mlps = [k for k in kernels if k.kind is KernelKind.MLP]
    candidates = [k for k in kernels if _gradient_operands(planner, k) is not None]
    if not mlps or not candidates:
        return kernels
    room = {id(k): MLP_GRADIENT_ELEMENTS for k in mlps}
    # the largest savings first; among equal ones, the gradient summed latest in a chain first: the kernel then
    # writes, for the GEMMs left, the values of its earlier layers (H100, a 64-wide training step's backward
    # kernel: 94 us summing its second and third layers' gradients, 115 us summing its first and second)
    for g in sorted(candidates, key=lambda g: (-_operand_bytes(planner, g), -_chain_layer(planner, g.core.inputs[0],
                                                                                            mlps))):
        refs = {id(k): planner.references(k) for k in kernels}
        scored = [(_absorb_score(planner, mlp, g, kernels, refs, room[id(mlp)]), mlp) for mlp in mlps]
        scored = [(score, mlp) for score, mlp in scored if score]
        if not scored:
            continue
        _, mlp = max(scored, key=lambda s: s[0])
        p, q = _gradient_operands(planner, g)
        room[id(mlp)] -= padded_width(p.shape[1]) * padded_width(q.shape[1])
        planner.describe(g)  # its epilogue, as planned alone: the finishing function's
        mlp.payload.absorbed.append(g)
        for o in g.outputs:
            mlp.outputs.append(o)
            mlp.levels[id(o)] = g.levels[id(o)]
        mlp.reductions += g.reductions
        kernels.remove(g)
        mlp.decisions.append(
            f"sums the weight gradient {list(g.core.shape)} over its {p.shape[0]} rows (each program its row "
            f"tiles, one partial each) from values its tiles hold, instead of a GEMM reading "
            f"{mib(_operand_bytes(planner, g))}; a second launch adds the partials")
        _unstore_intermediates(planner, mlp, kernels)
    return planner.kernel_order(kernels, {id(k): planner.references(k) for k in kernels})


def _chain_layer(planner: Planner, x: Node, mlps: list[FusedKernel], through_outputs: bool = False) -> int:
    """The latest layer of the MLP kernels `mlps` whose result computing `x` reads, not through a stored value
    (but through the values they write, with `through_outputs`); -1 for none."""
    layers = {id(c): i for mlp in mlps for i, c in enumerate(mlp.cores)}
    computed = {id(o) for mlp in mlps for o in mlp.outputs} if through_outputs else set()
    latest, stack, seen = -1, [x], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if id(n) in layers:
            latest = max(latest, layers[id(n)])
            continue
        if n.op is Op.BUFFER or (id(n) in planner.stored and id(n) not in computed):
            continue
        stack.extend(n.inputs)
    return latest


def _gradient_operands(planner: Planner, g: FusedKernel) -> tuple[Node, Node] | None:
    """(P, Q) of a 2-d GEMM kernel computing dot(P^T, Q), P and Q of widths an MLP kernel can hold,
    whose reductions all sum an operand along K; None for any other kernel."""
    core = g.core
    if g.kind is not KernelKind.MATMUL or core is None or len(core.shape) != 2:
        return None
    a, q = core.inputs
    if a.op is not Op.PERMUTE or tuple(a.attrs["order"]) != (1, 0) or id(a) in planner.stored:
        return None
    p = a.inputs[0]
    if len(p.shape) != 2 or p.shape[0] != q.shape[0] or max(p.shape[1], q.shape[1]) > MLP_MAX_WIDTH:
        return None
    if any(summed_operand(core, r) is None for r in g.reductions):
        return None
    return p, q


def _operand_bytes(planner: Planner, g: FusedKernel) -> int:
    """What a weight-gradient GEMM kernel's operands load: their stored inputs' bytes."""
    return sum(n.numel * n.dtype.itemsize for n in _operand_reads(planner, g))


def _operand_reads(planner: Planner, g: FusedKernel) -> list[Node]:
    """The stored values and inputs a GEMM kernel's operands load (an operand stored itself included)."""
    reads: dict[int, Node] = {}
    for operand in g.core.inputs:
        if id(operand) in planner.stored or operand.op is Op.BUFFER:
            reads[id(operand)] = operand
        else:
            reads.update((id(n), n) for n in planner.inside(operand)[1])
    return list(reads.values())


def _absorb_score(planner: Planner, mlp: FusedKernel, g: FusedKernel, kernels: list[FusedKernel], refs: dict,
                  room: int) -> int:
    """The bytes of `g`'s operand reads that `mlp` computes (counted twice: their stores may go too) or loads
    anyway; 0 where `g` cannot join it: other rows or dtype, a width no layer has, no accumulator room left,
    weights that would no longer fit on chip, an operand needing a layer's value other than elementwise,
    `mlp` reading what `g` writes (its finishing launch runs after the layers), `g` and a gradient `mlp`
    already sums reading each other's results (one launch finishes both), or a cycle through a third
    kernel."""
    p, q = _gradient_operands(planner, g)
    core = mlp.cores[0]
    widths = mlp_widths(mlp)
    if p.shape[0] != core.shape[0] or g.core.dtype is not core.dtype or not {p.shape[1], q.shape[1]} <= set(widths):
        return 0
    if padded_width(p.shape[1]) * padded_width(q.shape[1]) > room:
        return 0
    # its programs walk row tiles holding the weights on chip, beside the gradient's two operand tiles
    written = written_intermediates(mlp) + 2 * (len(mlp.payload.absorbed) + 1)
    if not mlp_blocks(widths, core.dtype.itemsize, planner.context.shared_memory, written)[3]:
        return 0
    computed = {id(o) for o in mlp.outputs}
    loaded = set(refs[id(mlp)])
    reads = _operand_reads(planner, g)
    score = sum((2 if id(n) in computed else 1 if id(n) in loaded else 0) * n.numel * n.dtype.itemsize
                for n in reads)
    if not score or not all(_elementwise_over_layers(planner, mlp, x) for x in (p, q)):
        return 0
    if id(g) in planner.dependencies(kernels, refs)[id(mlp)]:
        return 0
    finished = {id(o) for a in mlp.parts() for o in a.outputs}
    if {id(n) for n in reads} & finished or _epilogue_reads(planner, g) & finished:
        return 0
    if any({id(o) for o in g.outputs} & _epilogue_reads(planner, a) for a in mlp.payload.absorbed):
        return 0
    return score if planner.acyclic(mlp, g, kernels, refs) else 0


def _elementwise_over_layers(planner: Planner, mlp: FusedKernel, x: Node) -> bool:
    """Whether every layer result of `mlp` that computing `x` inside it needs is reached through
    elementwise ops of x's own shape only (an MLP kernel has a layer's result only at its own element)."""
    cores = {id(c) for c in mlp.cores}
    outputs = {id(o) for o in mlp.outputs}
    stack, seen = [(x, True)], set()
    while stack:
        n, in_order = stack.pop()
        if (id(n), in_order) in seen:
            continue
        seen.add((id(n), in_order))
        if id(n) in cores:
            if not in_order or n.shape != x.shape:
                return False
            continue
        if n.op is Op.BUFFER or (id(n) in planner.stored and id(n) not in outputs):
            continue
        keeps = in_order and n.op.kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY) and n.shape == x.shape
        stack.extend((i, keeps) for i in n.inputs)
    return True


def _unstore_intermediates(planner: Planner, mlp: FusedKernel, kernels: list[FusedKernel]) -> None:
    """An MLP kernel's layer values that only its absorbed gradients and sums read (through their operands,
    the values summed) stay in registers: no longer written."""
    readers = set()
    for k in kernels:
        if k is not mlp:
            readers |= set(planner.references(k))
    for g in mlp.parts():
        readers |= _epilogue_reads(planner, g)
    for o in list(mlp.outputs):
        if id(o) in mlp.payload.layers and id(o) not in readers and id(o) not in planner.output_ids:
            mlp.outputs.remove(o)
            del mlp.payload.layers[id(o)], mlp.levels[id(o)]
            planner.stored.discard(id(o))
            if id(o) in planner.shared:
                planner.shared[id(o)] = (f"{o.op.label} {list(o.shape)} {o.dtype.name}, read by "
                                      f"{len(planner.users[id(o)])} ops, kept in registers: only this kernel reads it")
    note_written(mlp)


def _epilogue_reads(planner: Planner, g: FusedKernel) -> set[int]:
    """Stored nodes a GEMM kernel's epilogue reads (not through its operands)."""
    reads, seen = set(), set()
    stack = [o for o in g.outputs if o is not g.core and summed_output(g, o) is None]
    while stack:
        n = stack.pop()
        if id(n) in seen or n is g.core or n in g.reductions:  # the accumulator and the operand sums
            continue
        seen.add(id(n))
        if n not in g.outputs and (id(n) in planner.stored or n.op is Op.BUFFER):
            reads.add(id(n))
            continue
        stack.extend(n.inputs)
    return reads


def absorb_sums(planner: Planner, kernels: list[FusedKernel]) -> list[FusedKernel]:
    """A row kernel whose one reduction sums, over an MLP kernel's rows (all of its elements, or each
    column), a value the MLP kernel's tiles compute elementwise from its layers (a mean squared error of
    its output) joins that kernel: each program adds its row tiles' values into a partial in registers, the
    finishing launch adds the partials and runs the row kernel's epilogue. The value is then neither
    computed again nor, where nothing else reads them, are the layer results it came from written. A sum
    staged in two kernels (`passes`' split of a long reduction) joins with both."""
    mlps = [k for k in kernels if k.kind is KernelKind.MLP]
    if not mlps:
        return kernels
    refs = {id(k): planner.references(k) for k in kernels}
    for f in [k for k in kernels if k.kind is KernelKind.REDUCE]:
        if f not in kernels:  # a first stage taken with its second
            continue
        found = _row_sum(planner, f, kernels, refs)
        if found is None:
            continue
        value, first = found
        group = [f] + ([first] if first is not None else [])
        mlp = next((m for m in mlps if _sums_inside(planner, m, f, value, group, kernels, refs)), None)
        if mlp is None:
            continue
        if first is not None:  # its partials are the MLP kernel's own now
            kernels.remove(first)
            planner.stored.discard(id(first.outputs[0]))
        kernels.remove(f)
        _take_sum(planner, mlp, f, f"{len(group)} reduction kernel{'s' if len(group) > 1 else ''}")
        _unstore_intermediates(planner, mlp, kernels)
        refs = {id(k): planner.references(k) for k in kernels}
    return planner.kernel_order(kernels, refs)


def _take_sum(planner: Planner, mlp: FusedKernel, f: FusedKernel, instead: str) -> None:
    """MLP kernel `mlp` takes row kernel `f`'s sum over its rows: its outputs and reduction become the kernel's,
    finished by its second launch; explain says what it replaces (`instead`)."""
    planner.describe(f)  # what its epilogue reads, as the finishing launch computes it
    mlp.payload.summed.append(f)
    mlp.reductions += f.reductions
    for o in f.outputs:
        mlp.outputs.append(o)
        mlp.levels[id(o)] = f.levels[id(o)]
    (r,) = f.reductions
    value = summed_views(r)[0]
    mlp.decisions.append(
        f"sums {list(value.shape)} into {list(r.shape)} over its {value.shape[0]} rows (each program its row "
        f"tiles, one partial each) from values its tiles hold, instead of {instead}; its second launch adds the "
        "partials")


def _row_sum(planner: Planner, f: FusedKernel, kernels: list[FusedKernel], refs: dict
             ) -> tuple[Node, FusedKernel | None] | None:
    """(V, the first stage's kernel or None) when row kernel `f` computes, with its one reduction, the sum of
    a 2-d value V over every element, or over its rows for each column, and writes only values of one per
    output of that sum (ROW level); None otherwise. The sum may be staged: `f` sums the partial sums that
    another row kernel (only `f` reads them) took of V reshaped or zero-padded (each column kept apart, for
    a sum per column). Summing V's elements in another grouping gives the same sum."""
    if f.segments or len(f.reductions) != 1 or any(f.levels[id(o)] != ROW for o in f.outputs):
        return None
    r = f.reductions[0]
    if r.op is not Op.SUM or not r.dtype.is_floating_point:
        return None
    value, views, s = summed_views(r)
    first = None
    if s is not None:
        first = next((k for k in kernels if k.outputs == [s]), None)
        readers = [k for k in kernels if id(s) in refs[id(k)]]
        if (first is None or first.kind is not KernelKind.REDUCE or first.reductions != [s] or readers != [f]
                or id(s) in planner.output_ids):
            return None
    if any(v.op is Op.PAD and v.attrs["value"] != 0 for v in views):
        return None
    if len(value.shape) != 2 or value.op.kind is Kind.LEAF:
        return None
    if r.numel == 1:
        return value, first
    # a sum per column: each view keeps the column as its last axis, unpadded, and no sum reduces it
    width = value.shape[1]
    kept = all(v.shape[-1] == width for v in views) and all(
        v.attrs["pads"][-1] == (0, 0) for v in views if v.op is Op.PAD)
    sums = [r] + ([s] if s is not None else [])
    summed_last = any(n.inputs[0].shape[-1] != width or len(n.shape) - 1 in n.attrs["axes"] for n in sums)
    if r.numel != width or not kept or summed_last:
        return None
    return value, first


def _sums_inside(planner: Planner, mlp: FusedKernel, f: FusedKernel, value: Node, group: list[FusedKernel],
                 kernels: list[FusedKernel], refs: dict) -> bool:
    """Whether `mlp` can take the sum of `value` that row kernel `f` (with the rest of `group`) computes: the
    same rows, a width one of its layers has, `value` computed elementwise from its layers' results (at least
    one; if it is stored, `mlp` writes it), `mlp` not reading what the group writes, the group not reading
    what `mlp`'s finishing launch writes nor that launch's other parts reading what `f` writes (it finishes
    all at once), and no cycle through another kernel."""
    core = mlp.cores[0]
    widths = mlp_widths(mlp)
    if value.shape[0] != core.shape[0] or value.shape[1] not in widths or len(mlp.payload.summed) >= MLP_MAX_SUMS:
        return False
    if id(value) in planner.stored and value not in mlp.outputs:  # another kernel computes it
        return False
    if _chain_layer(planner, value, [mlp], through_outputs=True) < 0 or \
            not _elementwise_over_layers(planner, mlp, value):
        return False
    written = {id(o) for k in group for o in k.outputs}
    if written & set(refs[id(mlp)]):
        return False
    finished = {id(o) for g in mlp.parts() for o in g.outputs}
    reads = set().union(*(refs[id(k)] for k in group))
    if reads & finished or any(written & _epilogue_reads(planner, g) for g in mlp.parts()):
        return False
    return _group_acyclic(planner, [mlp] + group, kernels, refs)


def _group_acyclic(planner: Planner, group: list[FusedKernel], kernels: list[FusedKernel], refs: dict) -> bool:
    """Whether the kernels of `group`, made one, leave the kernel graph acyclic: nothing they need waits on
    a kernel that needs one of them."""
    return not closes_cycle(planner.dependencies(kernels, refs), group)


def _narrow_runs(widths: list[int]) -> list[tuple[int, int]]:
    """The runs of two or more consecutive layers (start, stop) of a chain with these widths whose inputs and
    outputs are all at most MLP_MAX_WIDTH wide (layer i reads widths[i], writes widths[i + 1]): the parts of the
    chain that fit on chip."""
    fits = [max(a, b) <= MLP_MAX_WIDTH for a, b in zip(widths, widths[1:])]
    runs, start = [], 0
    for i, narrow in enumerate([*fits, False]):
        if not narrow:
            if i - start > 1:
                runs.append((start, i))
            start = i + 1
    return runs


def note_written(mlp: FusedKernel) -> None:
    """The decision saying which intermediates an MLP kernel writes, kept second, after the chain's own."""
    mlp.decisions = [d for d in mlp.decisions if not d.startswith("also writes")]
    written = written_intermediates(mlp)
    if written:
        mlp.decisions.insert(1, f"also writes {written} intermediate{'s' if written > 1 else ''} that other kernels "
                                "read, from registers")
