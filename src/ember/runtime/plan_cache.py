"""The plan cache: compiled plans by the pending graph's structure and the compile context, in memory
and as plan files on disk, so a repeated training step costs a key, and a second process starts from
the plans the first one compiled.

A new plan, and now and then a cached one, also settles Python's cyclic garbage collector (`collector`).

Threads share the cache: one compiles (or loads) a plan while another asking for the same waits for it.
Processes share the files: each is written whole under a name of its own and renamed into place, and one
that does not load (cut off, corrupt, from another ember) is compiled again, never trusted.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import threading
from pathlib import Path

import torch
import triton

from ember.compiler import CompileContext, Plan, Signature, compile, signature
from ember.ir import Node
from ember.runtime import collector, cuda, disk, targets

_plans: dict[tuple, Plan] = {}
_compiling = threading.RLock()  # held while a plan is compiled or loaded into _plans


def plan_for(order: list[Node], keep: set[int]) -> tuple[Plan, Signature]:
    """The plan of a pending graph on a cuda device (compiled, loaded or cached), for its device type's runtime
    target, and the graph's signature."""
    sig = signature(order, keep)
    device = order[0].device
    context = cuda.compile_context(device)
    plan = _plans.get((sig.key, context))
    if plan is not None:
        cuda.stats["plan_hits"] += 1
        collector.after_step()
        return plan, sig
    with _compiling:
        plan = _plans.get((sig.key, context))  # another thread may have made it meanwhile
        if plan is None:
            target = targets.for_device(device.type)
            plan = _load_plan(sig.key, context, target)
            if plan is None:
                plan = compile(order, keep, target.name, context, sig)
                cuda.stats["plans_compiled"] += 1
                _save_plan(sig.key, context, plan, target)
            _plans[sig.key, context] = plan
    collector.after_new_plan()
    return plan, sig


def clear() -> None:
    """Forget the plans compiled in this process (their files stay), as a new process starts, and what was prepared
    from them."""
    _plans.clear()
    _prepared.clear()


# What the runtime prepares from each plan it runs, per thread (launch recipes, runtime.steady's states): kept here,
# beside the plans and never on them, and dropped with them. An entry holds its plan, so no other plan takes its id
# while it lasts.
_prepared: dict[int, tuple[Plan, threading.local]] = {}


def prepared(plan: Plan) -> threading.local:
    """What is prepared from `plan` to run it, as this thread sees it: its `steps` (launcher) and steady states."""
    entry = _prepared.get(id(plan))
    if entry is None:
        with _compiling:  # one entry per plan, whichever thread asks first
            entry = _prepared.setdefault(id(plan), (plan, threading.local()))
    return entry[1]


def prepared_states() -> list[threading.local]:
    """What is prepared from each plan, for this thread (runtime.steady.release drops its recycled sets)."""
    return [local for _, local in list(_prepared.values())]


def _plan_path(key: tuple, context: CompileContext, target: targets.RuntimeTarget) -> Path:
    """A plan's file: the graph's structure plus what the plan was made with (target, device, ember's own source,
    library versions, settings)."""
    gpu = "interpreter" if target.interpret else torch.cuda.get_device_name()
    identity = repr((key, target.name, gpu, context, _code_digest(),
                     torch.__version__, triton.__version__))
    return disk.cache_dir("plans") / (hashlib.sha256(identity.encode()).hexdigest()[:32] + ".pkl")


@functools.cache
def _code_digest() -> str:
    """ember's own source: a plan stored by another build of the compiler is not this one's."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _save_plan(key: tuple, context: CompileContext, plan: Plan, target: targets.RuntimeTarget) -> None:
    """Write a plan atomically; launch recipes are not stored (sources are, and are re-imported). What the
    plan holds by node id (arena slots, stored nodes) is written by position in the lowered graph."""
    position = {id(n): i for i, n in enumerate(plan.lowered.nodes)}
    slots, stored = plan.schedule.slots, plan.stored
    try:
        plan.schedule.slots = {position[k]: v for k, v in slots.items()}
        plan.stored = {position[k] for k in stored if k in position}
        payload = pickle.dumps((key, plan), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError, KeyError):
        return  # a plan that cannot be stored is still used in this process
    finally:
        plan.schedule.slots, plan.stored = slots, stored
    disk.write_atomically(_plan_path(key, context, target), payload)


def _load_plan(key: tuple, context: CompileContext, target: targets.RuntimeTarget) -> Plan | None:
    """A plan from disk, or None; an entry that does not load or is not this graph's is rebuilt."""
    path = _plan_path(key, context, target)
    if not path.exists():
        return None
    try:
        stored_key, plan = pickle.loads(path.read_bytes())
        if stored_key != key:
            return None
        nodes = plan.lowered.nodes
        plan.schedule.slots = {id(nodes[i]): v for i, v in plan.schedule.slots.items()}
        plan.stored = {id(nodes[i]) for i in plan.stored}
        for ck in plan.kernels:
            for c in (ck, *ck.split):
                if c.source is not None:
                    disk.load_source(c.source, target.interpret)
    except Exception:  # corrupt, truncated or from an incompatible ember: never trusted
        return None
    cuda.stats["plans_loaded"] += 1
    return plan
