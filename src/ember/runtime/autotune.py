"""GEMM tuning: profile the bare GEMM, then run the fused kernel with what won; and the tiles of a launch whose
source serves several configurations (an attention kernel's), timed on its first run.

A generated GEMM takes its tile sizes, warps and pipeline stages as launch-time
constants, so one source serves every configuration. For each *problem* (GPU,
dtype, operand layouts, M/N/K rounded up to powers of two, batched or not) the
candidate configurations are timed on a bare GEMM of that problem with random
operands, and the fastest few are kept on disk. A fused kernel then runs with one of
those, whatever its prologue and epilogue: the one that runs it fastest, timed on its
first run below.

A second choice is made per fused kernel, on its first run with real buffers: the
generated kernel (under each of those configurations) against its split form (cuBLAS through torch.matmul, with the
prologue and epilogue in kernels of their own). Both times and the winner are kept
on disk too, and `ember.explain` shows them.

How much is searched is bounded by `EMBER_AUTOTUNE`, read (`mode`) once where a plan's steps are prepared
(launcher.RunSettings), which pass it to the functions here:
- `1` (the default): a short list (`SHORT_LIST` candidates whose tiles fit the problem, the
  size-based default among them), compiled in parallel before any is timed, and the fused kernel
  tried under the best `RANKED_SHORT` of them: seconds for a first training step;
- `max`: every candidate, the fused kernel under the best `RANKED` (minutes for a first step);
- `0`: nothing profiled: a size-based default configuration and the generated kernel.
Under the interpreter the mode is `0` (no GPU to time), and nothing is profiled for a problem too small for
tuning to matter (`SMALLEST_TUNED`). A tuned problem is tuned once: the disk cache answers
every later process, whatever the mode. Threads tune one problem at a time; a process storing
an entry adds it to the file as it is on disk then, so entries other processes stored stay.

A launch with alternatives (Launch.alternatives: one source, its block sizes, programs, warps and stages given at
launch) is timed under each on its first run with real buffers, where tuning is on and its work is at least
`SMALLEST_TUNED_LAUNCH`; the fastest is kept in the same file, keyed by the launch's function name (which holds a
digest of its source) and the GPU (`timed_tiling`, `cached_tiling`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton

from ember import dtypes
from ember.compiler import CompileContext, ParamKind, compile
from ember.device import as_device
from ember.ir import Node, Op, toposort
from ember.runtime import compiling, cuda, disk

if TYPE_CHECKING:
    from ember.compiler import Launch

WARMUP, REPS = 2, 10  # launches before and inside a timing


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def launch_options(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "GROUP_M": self.group_m, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def grid(self, batch: int, m: int, n: int, splits: int = 1) -> tuple[int, int]:
        """Programs: one per output tile along axis 0; along axis 1, one per batch entry or K split."""
        return (-(-m // self.block_m)) * (-(-n // self.block_n)), batch * splits

    def __str__(self) -> str:
        return (f"BLOCK {self.block_m}x{self.block_n}x{self.block_k}, {self.num_warps} warps, "
                f"{self.num_stages} stages")


# Candidates for 2-byte inputs, written for Hopper's shared memory (228 KiB per SM); float32 tiles
# take half the K depth. Configurations a GPU cannot run fail to compile and are skipped.
CANDIDATES = [
    Config(128, 256, 64, 8, 8, 3), Config(256, 128, 64, 8, 8, 3), Config(128, 256, 64, 8, 8, 4),
    Config(128, 128, 64, 8, 8, 4), Config(128, 128, 64, 8, 4, 4), Config(128, 128, 128, 8, 8, 3),
    Config(64, 256, 64, 8, 4, 4), Config(128, 64, 64, 8, 4, 4), Config(64, 128, 64, 8, 4, 4),
    Config(64, 64, 64, 8, 4, 4),
]


@dataclass(frozen=True)
class Problem:
    """What a GEMM configuration is tuned for."""

    dtype: str
    layout: str  # per operand, "n" (K contiguous in A, N in B) or "t" (transposed); a prologue counts as "n"
    m: int
    n: int
    k: int
    batched: bool
    precision: str

    @staticmethod
    def of(launch: Launch, dtype: dtypes.DType, layout: str) -> Problem:
        batch, m, n, k = launch.gemm
        return Problem(dtype.name, layout.replace("p", "n"), _bucket(m), _bucket(n), _bucket(k), batch > 1,
                       launch.precision)

    @property
    def key(self) -> str:
        return (f"{self.dtype} {self.layout} {self.m}x{self.n}x{self.k}{' batched' if self.batched else ''} "
                f"{self.precision}")


def _bucket(size: int) -> int:
    return max(16, 1 << max(size - 1, 0).bit_length())


def default_config(problem: Problem) -> Config:
    """A configuration chosen from the sizes alone: large tiles for large problems."""
    depth = 64 if problem.dtype != "float32" else 32
    block_m = min(128, problem.m)
    block_n = min(128, problem.n)
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return Config(block_m, block_n, min(depth, problem.k), 8, warps, 3)


def mode(interpret: bool) -> str:
    """EMBER_AUTOTUNE: "0" (nothing profiled), "1" (a short list, the default) or "max" (every candidate); "0"
    wherever no GPU runs the kernels (`interpret`: the runtime target's)."""
    value = os.environ.get("EMBER_AUTOTUNE", "1").strip().lower()
    if interpret or not torch.cuda.is_available() or value in ("0", "", "off", "false"):
        return "0"
    return "max" if value == "max" else "1"


def enabled(mode: str) -> bool:
    """Whether the search mode (see `mode`) profiles anything."""
    return mode != "0"


SHORT_LIST = 4  # candidates timed under EMBER_AUTOTUNE=1
RANKED_SHORT = 2  # of which the fused kernel tries the best


def candidates(problem: Problem, mode: str) -> list[Config]:
    """The configurations timed on the bare GEMM: every candidate under EMBER_AUTOTUNE=max; else the
    size-based default and the first candidates whose tiles the problem fills."""
    depth = 1 if problem.dtype != "float32" else 2  # float32 tiles take half the K depth
    every = [Config(c.block_m, c.block_n, c.block_k // depth, c.group_m, c.num_warps, c.num_stages)
             for c in CANDIDATES]
    if mode == "max":
        return every
    short = [default_config(problem)]
    for c in every:
        if len(short) < SHORT_LIST and c not in short and c.block_m <= problem.m and c.block_n <= problem.n:
            short.append(c)
    return short


# Below this many multiply-adds (512^3, rounded sizes) a GEMM runs in about a microsecond, less than a
# launch: profiling it (seconds of compiling candidates) could win nothing that matters, so it takes the
# size-based configuration and its fused kernel (fewer launches than cuBLAS plus separate kernels).
SMALLEST_TUNED = 2**27


def worth_tuning(problem: Problem, mode: str) -> bool:
    return enabled(mode) and problem.m * problem.n * problem.k >= SMALLEST_TUNED


# -- the disk cache ----------------------------------------------------------------------------

_entries: dict[str, dict] | None = None
_tuning = threading.RLock()  # held while this process profiles, reads or stores entries


def _path() -> Path:
    return disk.cache_dir("autotune") / "gemm.json"


def _scope() -> str:
    """Entries hold for one GPU model and one set of library versions."""

    return f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"


def _load() -> dict[str, dict]:
    global _entries
    if _entries is None:
        with _tuning:
            if _entries is None:
                _entries = _read()
    return _entries


def _read() -> dict[str, dict]:
    try:
        data = json.loads(_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # missing or corrupt: rebuilt, never trusted
        return {}


def _store(key: str, value: dict) -> None:
    global _entries
    with _tuning:
        entries = {**_load(), **_read(), key: value}  # with what other processes stored meanwhile
        disk.write_atomically(_path(), json.dumps(entries, indent=1, sort_keys=True))
        _entries = entries


def cached(key: str, mode: str) -> dict | None:
    if not enabled(mode):
        return None
    return _load().get(f"{_scope()} | {key}")


def _remember(key: str, value: dict) -> None:
    _store(f"{_scope()} | {key}", value)


# -- profiling ---------------------------------------------------------------------------------

RANKED = 3  # the bare GEMM's fastest configurations, each tried with the fused kernel's epilogue (max)


def configs_for(problem: Problem, mode: str) -> list[Config]:
    """The problem's fastest configurations on the bare GEMM, best first: from the disk cache, or
    profiled now (with a progress bar). Without profiling, or for a small problem, the size-based
    default alone."""
    if not worth_tuning(problem, mode):
        return [default_config(problem)]
    known = cached_configs(problem, mode)
    if not known:
        with _tuning:  # a thread asking for a problem another is profiling waits for its result
            known = cached_configs(problem, mode)
            if not known:
                ranked = _profile_bare(problem, mode)
                _remember(f"config {problem.key}", {"ranked": [asdict(c) for c, _ in ranked],
                                                    "ms": [ms for _, ms in ranked]})
                known = [c for c, _ in ranked]
    # the size-based default last: the fastest bare tiles may not fit beside a fused epilogue's registers and
    # shared memory, and the default's moderate tiles do
    default = default_config(problem)
    return known if default in known else [*known, default]


def needs_profiling(problem: Problem, mode: str) -> bool:
    return worth_tuning(problem, mode) and not cached_configs(problem, mode)


def compile_jobs(problem: Problem, mode: str) -> list:
    """Calls that compile the problem's bare GEMM under each candidate (without running it), for a
    pool to run before `configs_for` times them."""
    bare = _bare(problem)
    return [functools.partial(compiling.compile_and_load, bare.fn, bare.args,
                              config.grid(1, problem.m, problem.n, bare.splits), config.launch_options())
            for config in candidates(problem, mode)]


def cached_configs(problem: Problem, mode: str) -> list[Config]:
    """The problem's ranked configurations from the disk cache, or none."""
    entry = cached(f"config {problem.key}", mode)
    try:
        return [Config(**c) for c in entry["ranked"]] if entry else []
    except (KeyError, TypeError):  # an entry of another shape: profiled again
        return []


def cached_choice(kernel_name: str, problem: Problem, mode: str) -> dict | None:
    """A fused kernel's timed choice (see timed_choice) from the disk cache, or None."""
    entry = cached(f"choice {kernel_name} {problem.key}", mode)
    return entry if entry is not None and entry.get("chosen") in ("triton", "cublas") and "cublas_ms" in entry \
        else None


@dataclass
class _Bare:
    """A problem's bare GEMM: its kernel and arguments (random operands), for compiling and timing."""

    fn: object
    args: list
    splits: int


_bares: dict[Problem, _Bare] = {}


def _bare(problem: Problem) -> _Bare:
    with _tuning:  # made once, whichever thread asks first
        if problem not in _bares:
            dtype = dtypes.to_torch(dtypes.as_dtype(problem.dtype))
            a_shape = (problem.m, problem.k) if problem.layout[0] != "t" else (problem.k, problem.m)
            b_shape = (problem.k, problem.n) if problem.layout[1] != "t" else (problem.n, problem.k)
            a = torch.randn(a_shape, device="cuda").to(dtype)
            b = torch.randn(b_shape, device="cuda").to(dtype)
            source = _bare_gemm(problem, a, b)
            launch = source.launches[0]
            out = torch.empty((problem.m, problem.n), device="cuda", dtype=dtype)
            given = {ParamKind.READ: iter([a, b]), ParamKind.WRITE: iter([out])}
            args = [next(given[arg.kind]) if arg.kind in given else cuda.scratch(arg.value, out.device)
                    if arg.kind is ParamKind.SCRATCH else arg.value for arg in launch.args]
            module = disk.load_source(source, cuda.TARGET.interpret)
            _bares[problem] = _Bare(getattr(module, launch.function), args, launch.splits)
        return _bares[problem]


def _profile_bare(problem: Problem, mode: str) -> list[tuple[Config, float]]:
    from tqdm import tqdm  # a progress bar only while profiling

    bare = _bare(problem)
    timed = []
    bar = tqdm(candidates(problem, mode), desc=f"ember: tuning GEMM {problem.key}", leave=False, file=sys.stderr,
               disable=None)
    for config in bar:
        grid, options = config.grid(1, problem.m, problem.n, bare.splits), config.launch_options()
        try:
            ms = time_ms(lambda grid=grid, options=options: bare.fn.run(*bare.args, grid=grid, warmup=False,
                                                                         **options))
        except Exception:  # e.g. more shared memory than this GPU has: not a candidate here
            continue
        timed.append((config, ms))
    bar.close()
    _bares.pop(problem, None)  # its operands are not needed again
    timed.sort(key=lambda pair: pair[1])
    return timed[:RANKED if mode == "max" else RANKED_SHORT] or [(default_config(problem), math.inf)]


def _bare_gemm(problem: Problem, a: torch.Tensor, b: torch.Tensor):
    """The generated source of a GEMM with nothing fused: `a @ b` in the problem's layouts (an operand
    stored transposed is read through a permute)."""
    dtype = dtypes.as_dtype(problem.dtype)
    device = as_device("cuda")
    operands = []
    for layout, buffer in zip(problem.layout, (a, b)):
        leaf = Node.from_buffer(buffer, dtype, device)
        operands.append(Node.make(Op.PERMUTE, (leaf,), order=(1, 0)) if layout == "t" else leaf)
    core = Node.make(Op.MATMUL, tuple(operands))
    context = CompileContext(matmul_precision="highest" if problem.precision == "ieee" else "high",
                             multiprocessors=cuda.multiprocessors(device), split_k=cuda.split_k())  # as the real one
    plan = compile(toposort([core]), {id(core)}, cuda.TARGET.name, context)
    return plan.kernels[0].source


def time_ms(run) -> float:
    """The GPU's milliseconds per call of `run` on the current stream: warm-up calls, then REPS between events,
    queued while the GPU is held busy, so that the host's work per call is not counted. A plan's steps replay as
    CUDA graphs, where that work is not done. Timed as the host issued them, the split forms of GPT-2's forward GEMMs
    (torch.matmul, then a kernel of ember's) measured 0.23-0.31 ms each on an H200, where cuBLAS alone takes
    0.02-0.06 ms, and the generated kernel was chosen every time."""
    for _ in range(WARMUP):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    issue_ms = (time.perf_counter() - start) * 1e3  # the host's time to issue a call (its GPU work not waited on)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold_gpu(min(2 * REPS * issue_ms + HOLD_MARGIN_MS, HOLD_MOST_MS))
    begin.record()
    for _ in range(REPS):
        run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / REPS


HOLD_MARGIN_MS, HOLD_MOST_MS = 0.05, 50.0  # the GPU held while timed calls are queued: twice their issue, within these

_spin_rate: dict[int, float] = {}  # device -> cycles of torch.cuda._sleep per millisecond


def hold_gpu(ms: float) -> None:
    """Keep the current stream's GPU busy for about `ms` milliseconds (a spinning kernel), so that work queued
    behind it starts only once the host has queued all of it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return
    device = torch.cuda.current_device()
    if device not in _spin_rate:  # measured once: a million cycles, timed
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep(1000)
        begin.record()
        sleep(1_000_000)
        end.record()
        end.synchronize()
        _spin_rate[device] = 1_000_000 / max(begin.elapsed_time(end), 1e-3)
    sleep(int(_spin_rate[device] * ms))


def timed_choice(kernel_name: str, problem: Problem, fused: dict[Config, object], split, mode: str) -> dict:
    """Time a fused kernel under each of its configurations (callables) against its split form, keep
    the fastest, remember the times: "chosen" ("triton" or "cublas"), "config", "triton_ms", "cublas_ms"."""
    with _tuning:  # the same kernel in several threads is timed once
        return cached_choice(kernel_name, problem, mode) or _timed_choice(kernel_name, problem, fused, split)


def _timed_choice(kernel_name: str, problem: Problem, fused: dict[Config, object], split) -> dict:
    key = f"{kernel_name} {problem.key}"
    start = time.perf_counter()
    times = {}
    for config, run in fused.items():
        try:
            times[config] = time_ms(run)
        except Exception:  # the epilogue needs more shared memory than the bare GEMM: not a candidate here
            continue
    cublas_ms = time_ms(split)
    if not times:
        entry = {"chosen": "cublas", "config": None, "triton_ms": None, "cublas_ms": cublas_ms,
                 "seconds": time.perf_counter() - start}
        _remember(f"choice {key}", entry)
        return entry
    config = min(times, key=times.get)
    entry = {"chosen": "triton" if times[config] <= cublas_ms else "cublas", "config": asdict(config),
             "triton_ms": times[config], "cublas_ms": cublas_ms, "seconds": time.perf_counter() - start}
    _remember(f"choice {key}", entry)
    return entry


# -- launches whose one source serves several configurations (Launch.alternatives) ----------------------------

# Below this much work (multiply-adds of one of a launch's dots: heads x queries x keys x head dim for attention,
# e.g. 8 heads of 512 positions and 128 dims) a launch runs in microseconds: its default configuration is kept, and
# nothing is compiled or timed for it.
SMALLEST_TUNED_LAUNCH = 2**28


def launch_worth_tuning(work: int, mode: str) -> bool:
    return enabled(mode) and work >= SMALLEST_TUNED_LAUNCH


def cached_tiling(function: str, names: list[str], mode: str) -> dict | None:
    """A launch's timed choice (see timed_tiling) from the disk cache, or None. `function`: the launch's function
    name, its source's digest and the function's suffix, so one entry serves every plan running that source;
    `names`: its configurations, as timed (an entry timed over another list, by another ember, is timed again)."""
    entry = cached(f"tiles {function}", mode)
    if not isinstance(entry, dict) or entry.get("candidates") != names or entry.get("chosen") not in names \
            or not isinstance(entry.get("ms"), dict):
        return None
    return entry


def timed_tiling(function: str, runs: dict[str, Callable[[], object]], mode: str) -> dict:
    """Time a launch under each of its configurations (callables, by name), keep the fastest and remember it on
    disk: "chosen" (its name), "ms" (each configuration's time; one that fails to run, e.g. out of shared memory,
    is left out), "candidates" (the names timed), "seconds" spent. Nothing is remembered where none ran: "chosen"
    is then None."""
    names = list(runs)
    with _tuning:  # the same launch in several threads is timed once
        known = cached_tiling(function, names, mode)
        if known is not None:
            return known
        start = time.perf_counter()
        times = {}
        for name, run in runs.items():
            try:
                times[name] = time_ms(run)
            except Exception:  # more registers or shared memory than this GPU has: not a candidate here
                continue
        if not times:
            return {"chosen": None, "ms": {}, "candidates": names}
        entry = {"chosen": min(times, key=times.get), "ms": times, "candidates": names,
                 "seconds": time.perf_counter() - start}
        _remember(f"tiles {function}", entry)
        return entry
