"""Rewrites of a kernel's statements after they are emitted: loads moved up so they are in flight together
(hoist_loads, loads_first), loads a loop does not change moved before it (hoist_invariant_loads), and values no
statement reads dropped (drop_unread)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ember.compiler.emit import flat_exprs, flat_statements, read_names, reads_memory
from ember.compiler.kernel import Assign, Branch, Effect, Loop


def hoist_loads(block: list) -> list:
    """The statements of `block` with every load that follows its first store moved above it, where its
    address and mask are computed before: the loads are then in flight together. The target's compiler may
    not move a load above a store itself (it cannot tell the pointers apart), but in a kernel of one element
    per position no load reads what a store wrote: outputs are new values, and an input updated in place is
    read at the element its store writes, by the same thread, which a hoisted load reads first anyway."""
    first = next((i for i, s in enumerate(block) if isinstance(s, Effect)), None)
    # an index check's record writes only its flag, which no load reads
    if first is None or any(isinstance(s, Effect) and s.value.fn not in ("store", "record_index") for s in block) \
            or any(isinstance(s, (Loop, Branch)) for s in block):
        return block
    assigned = Counter(t.name for s in block[first:] if isinstance(s, Assign) for t in s.targets)
    later = set(assigned)
    moved, rest = [], []
    touched: set[str] = set()  # names the statements left in place read or assign, so far
    for s in block[first:]:
        targets = {t.name for t in s.targets} if isinstance(s, Assign) else set()
        if (isinstance(s, Assign) and reads_memory(s.value) and not read_names(s.value) & later
                and not targets & touched and all(assigned[t] == 1 for t in targets)):
            moved.append(s)
            later -= targets  # what reads it may move up too
        else:
            rest.append(s)
            touched |= targets | read_names(s.value)
    return block[:first] + moved + rest


def loads_first(block: list) -> list:
    """The statements of a straight-line `block` with each load moved up to just after the statements that
    compute what its address and mask read (and after the loads before it): a row kernel's loads are then in
    flight together, before the reductions between them wait on each other. As in hoist_loads, moving a load
    above a store is safe in a kernel of one element per position."""
    if any(isinstance(s, (Loop, Branch)) for s in block) or \
            any(isinstance(s, Effect) and s.value.fn not in ("store", "record_index") for s in block):
        return block
    assigned = Counter(t.name for s in block if isinstance(s, Assign) for t in s.targets)
    out: list = []
    for s in block:
        if isinstance(s, Assign) and reads_memory(s.value) and all(assigned[t.name] == 1 for t in s.targets):
            needs = read_names(s.value)
            at = len(out)
            while at and isinstance(out[at - 1], Effect | Assign) and not _is_load(out[at - 1]) and \
                    not (isinstance(out[at - 1], Assign) and {t.name for t in out[at - 1].targets} & needs):
                at -= 1
            out.insert(at, s)
        else:
            out.append(s)
    return out


def _is_load(s) -> bool:
    return isinstance(s, Assign) and reads_memory(s.value)


def hoist_invariant_loads(loop: Loop, fits: Callable[[list[Assign]], bool]) -> None:
    """Move the loads in `loop`'s body that read the same elements on every iteration (a bias, a per-column
    scale: nothing they read is assigned in the loop) into its prelude. The target's compiler leaves them in
    place (it cannot tell them from the elements the loop stores), so every iteration would wait on each
    again; in an MLP kernel that is a load's latency per layer and row tile, on the chain's critical path.
    Such a load reads no element the loop writes: the loop's stores are at its tiles' rows, and an output
    written in place over an input is one read at the element each store writes, never a row-independent
    view of it. `fits`: whether the registers can hold the values that would move, all of them; else none
    move."""
    assigned = Counter(t.name for s in flat_statements(loop.body) if isinstance(s, Assign) for t in s.targets)
    variant = set(assigned) | {loop.var.name}
    moved, kept = [], []
    touched: set[str] = set()  # the names the statements left in the loop read or assign, so far
    for s in loop.body:
        targets = {t.name for t in s.targets} if isinstance(s, Assign) else set()
        if (isinstance(s, Assign) and reads_memory(s.value) and not read_names(s.value) & variant
                and all(assigned[t] == 1 for t in targets) and not targets & touched):
            moved.append(s)
            variant -= targets  # what reads it alone may move too
        else:
            kept.append(s)
            touched |= targets | set().union(*map(read_names, flat_exprs(s)))
    if moved and fits(moved):
        loop.prelude += moved
        loop.body[:] = kept


def drop_unread(block: list) -> None:
    """Remove from `block` (and the loops and branches in it) every assignment of values nothing reads."""
    while True:
        read = set().union(*(read_names(e) for s in block for e in flat_exprs(s)))
        if not _prune(block, read):
            return


def _prune(block: list, read: set[str]) -> bool:
    kept = [s for s in block if not isinstance(s, Assign) or any(t.name in read for t in s.targets)]
    pruned = len(kept) < len(block)
    block[:] = kept
    for s in block:
        inner = (s.prelude, s.body) if isinstance(s, Loop) else (s.body, s.orelse) if isinstance(s, Branch) else ()
        pruned = any([_prune(b, read) for b in inner]) or pruned
    return pruned
