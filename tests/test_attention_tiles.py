"""The attention kernels' tiles: each launch's one source serves every candidate configuration, each candidate
computes what the reference computes, and on a GPU the launch is timed under each on its first run, the fastest
kept on disk for later plans and processes (here with a fake timer: the interpreter times nothing)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import ember
from ember.compiler.fused import KernelKind
from ember.compiler.patterns import attention as pattern
from ember.explain import plan
from ember.ir import Op
from ember.runtime import autotune, launcher, plan_cache, triton_launch
from ember.tensor import apply

pytestmark = pytest.mark.usefixtures("cuda_backend")

LENGTH, KEYS = 77, 80  # crossing tiles of every candidate's block size, with tails


def inputs(width: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """q, k, v and the output's cotangent of two heads, in `dtype`."""
    rng = np.random.default_rng(seed)
    shapes = [(2, LENGTH, width), (2, KEYS, width), (2, KEYS, width), (2, LENGTH, width)]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    return [rng.standard_normal(s).astype(np_dtype) for s in shapes]


def attention(arrays: list[np.ndarray], causal: bool, device: str) -> list[ember.Tensor]:
    """The attention's output, its rows' log-sum-exp and the gradients to q, k and v, pending on `device`."""
    q, k, v = (ember.tensor(a, device=device).requires_grad_() for a in arrays[:3])
    attributes = dict(scale=arrays[0].shape[-1] ** -0.5, causal=causal, mask=None, safe=True, dropout=0.0)
    out = apply(Op.ATTENTION, q, k, v, result="out", **attributes)
    lse = apply(Op.ATTENTION, q, k, v, result="lse", **attributes)
    return [out, lse, *ember.grad(out, [q, k, v], ember.tensor(arrays[3], device=device))]


def results(arrays: list[np.ndarray], causal: bool, device: str) -> list[np.ndarray]:
    """Those values computed in one realization (one forward kernel, one backward kernel), as float32 arrays."""
    tensors = attention(arrays, causal, device)
    ember.realize(*tensors)
    return [t.numpy().astype(np.float32) for t in tensors]


def attention_plan(arrays: list[np.ndarray], causal: bool = True):
    """The plan computing `results` on the cuda device, as explain shows it."""
    return plan(*attention(arrays, causal, "cuda"))


def attention_sources(arrays: list[np.ndarray], causal: bool) -> list:
    """The attention kernels' sources in that plan: the forward's, the backward's."""
    p = attention_plan(arrays, causal)
    return [p.sources[id(k)] for k in p.kernels if k.kind is KernelKind.ATTENTION]


def attention_launches(arrays: list[np.ndarray], causal: bool) -> list:
    """The launches of those sources: the forward's, the dK/dV launch, the dQ launch."""
    return [launch for source in attention_sources(arrays, causal) for launch in source.launches]


@pytest.mark.parametrize("width", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_candidate_configuration_computes_what_the_reference_computes(width, dtype, causal, monkeypatch):
    arrays = inputs(width, dtype)
    launches = attention_launches(arrays, causal)
    assert [launch.function.rsplit("_", 1)[-1] for launch in launches][1:] == ["dkv", "dq"]
    assert all(len(launch.alternatives) > 1 for launch in launches)
    launched = set()  # (function, grid, options) of each launch run
    run = triton_launch.Launch.__call__

    def recorded(self, args):
        o = self.options
        launched.add((self.fn.__name__, self.grid, o.get("BLOCK_M"), o.get("BLOCK_N"), o["num_warps"],
                      o.get("num_stages")))
        return run(self, args)

    monkeypatch.setattr(triton_launch.Launch, "__call__", recorded)
    expected = results(arrays, causal, "cpu")
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    for index in range(max(len(launch.alternatives) for launch in launches)):
        with launcher.alternative(index):
            computed = results(arrays, causal, "cuda")
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), computed, expected):
            np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance, err_msg=f"{name}, configuration {index}")
    assert launched >= {(launch.function, (c.grid,), c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps,
                         c.num_stages) for launch in launches for c in launch.alternatives}  # each one ran


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_source_serves_every_candidate_whichever_is_the_default(causal, dtype, monkeypatch):
    """The source's text does not depend on which candidate is the default (each in turn), and each launch's grid
    is its candidate's: a block of held positions per program, for every head."""
    arrays = inputs(64, dtype)
    candidates = {launch: dict(classes) for launch, classes in pattern.CANDIDATES.items()}
    texts, seen = set(), 0
    for turn in range(max(len(c[64]) for c in candidates.values())):
        rotated = {launch: {width: listed[turn % len(listed):] + listed[:turn % len(listed)]
                            for width, listed in classes.items()} for launch, classes in candidates.items()}
        monkeypatch.setattr(pattern, "CANDIDATES", rotated)
        launches = attention_launches(arrays, causal)
        texts.add(tuple(launch.function for launch in launches))
        for launch in launches:
            held = "BLOCK_N" if launch.function.endswith("_dkv") else "BLOCK_M"
            size = KEYS if launch.function.endswith("_dkv") else LENGTH
            default = launch.alternatives[0]
            assert (launch.constexprs, launch.grid, launch.num_warps, launch.num_stages) == (
                default.constexprs, default.grid, default.num_warps, default.num_stages)
            for config in launch.alternatives:
                assert config.grid == -(-size // config.constexprs[held]) * 2
            seen += len(launch.alternatives)
    assert len(texts) == 1  # a function's name holds a digest of its source's text
    assert seen > 3 * len(texts)


def test_a_mask_is_emitted_where_any_candidate_block_does_not_divide_the_size():
    forward, backward = attention_sources(inputs(64, "bfloat16"), causal=False)
    assert "rows_ok = rows < 77" in forward.text and "keys_ok = keys < 80" in forward.text  # 80: 16 divides, 32 not
    assert "programs = (77 + BLOCK_M - 1) // BLOCK_M" in forward.text
    assert "programs = (80 + BLOCK_N - 1) // BLOCK_N" in backward.text
    for launch in forward.launches + backward.launches:
        assert "num_stages" not in forward.text + backward.text  # the launch's option, not the source's
        assert launch.num_stages == launch.alternatives[0].num_stages
    arrays = inputs(64, "float32")
    arrays[1:3] = [np.concatenate([a, a[:, :16]], axis=1) for a in arrays[1:3]]  # 96 keys: tiles of 32, not of 64
    forward, _ = attention_sources(arrays, causal=False)
    assert forward.launches[0].constexprs["BLOCK_N"] == 32 and "keys_ok = keys < 96" in forward.text


# -- tuning on a GPU, with a fake timer ---------------------------------------------------------------------

def fake_ms(options: dict) -> float:
    """A launch's time under a configuration (its launch options): the smallest blocks of queries, then of keys,
    are fastest (no default has them)."""
    return options["BLOCK_M"] + options["BLOCK_N"] / 1000


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Tuning on, as on a GPU, with an empty disk cache in `tmp_path` and a fresh plan cache; returns the timings
    made, as (function, BLOCK_M, BLOCK_N)."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_cache, "_plans", {})
    monkeypatch.setattr(autotune, "_entries", None)
    monkeypatch.setattr(autotune, "mode", lambda interpret: "1")
    monkeypatch.setattr(autotune, "_scope", lambda: "a GPU")
    monkeypatch.setattr(autotune, "SMALLEST_TUNED_LAUNCH", 0)
    timed = []

    def timer(run) -> float:
        run()
        timed.append((run.func.fn.__name__, run.func.options["BLOCK_M"], run.func.options["BLOCK_N"]))
        return fake_ms(run.func.options)

    monkeypatch.setattr(autotune, "time_ms", timer)
    return timed


def tuned_launches() -> list:
    """The launches with alternatives of the plans prepared in this thread."""
    return [launch for p in plan_cache._plans.values() for step in getattr(plan_cache.prepared(p), "steps", None) or []
            for launch in getattr(step, "launches", []) if isinstance(launch, launcher._TunedLaunch)]


def fastest(launch: launcher._TunedLaunch) -> int:
    """The index of the configuration the fake timer finds fastest."""
    times = [fake_ms(each.options) for each in launch.launches]
    return times.index(min(times))


def test_a_launch_is_timed_under_each_configuration_once_and_runs_the_fastest(tuning, tmp_path):
    arrays = inputs(64, "float32")
    expected = results(arrays, True, "cpu")
    computed = results(arrays, True, "cuda")
    for a, b in zip(computed, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    launches = tuned_launches()
    assert len(launches) == 3
    assert len(tuning) == sum(len(launch.launches) for launch in launches)  # each configuration timed once
    for launch in launches:
        assert launch.chosen == fastest(launch) != 0
        assert launch.choice["chosen"] == launch.names[launch.chosen] and len(launch.choice["ms"]) == len(launch.names)
    entries = json.loads((tmp_path / "autotune" / "gemm.json").read_text())
    assert {key: value["chosen"] for key, value in entries.items()} == {
        f"a GPU | tiles {launch.function}": launch.names[launch.chosen] for launch in launches}
    results(arrays, True, "cuda")
    assert len(tuning) == sum(len(launch.launches) for launch in launches)  # the plan's next run times nothing
    text = str(attention_plan(arrays))
    assert text.count("timed fastest of") == 3, text


def test_a_later_process_reads_the_choice_from_disk_instead_of_timing(tuning, monkeypatch):
    arrays = inputs(32, "bfloat16")
    results(arrays, False, "cuda")
    chosen = {launch.function: launch.chosen for launch in tuned_launches()}
    timings = len(tuning)
    monkeypatch.setattr(plan_cache, "_plans", {})  # as a new process starts: no plan, nothing read from disk yet
    monkeypatch.setattr(autotune, "_entries", None)
    results(arrays, False, "cuda")
    assert len(tuning) == timings
    assert {launch.function: launch.chosen for launch in tuned_launches()} == chosen


def test_nothing_is_timed_while_a_cuda_graph_is_captured_nor_below_the_threshold(tuning, monkeypatch):
    arrays = inputs(32, "float32")
    monkeypatch.setattr(launcher.this_thread, "capturing", True)
    results(arrays, False, "cuda")
    assert tuning == [] and all(launch.chosen is None for launch in tuned_launches())  # the default ran
    monkeypatch.setattr(launcher.this_thread, "capturing", False)
    results(arrays, False, "cuda")  # the next run outside a capture times them
    assert tuning and all(launch.chosen == fastest(launch) for launch in tuned_launches())

    monkeypatch.setattr(plan_cache, "_plans", {})
    monkeypatch.setattr(autotune, "SMALLEST_TUNED_LAUNCH", 2**28)
    tuning.clear()
    results(inputs(64, "float32"), False, "cuda")
    assert tuning == [] and all(launch.chosen == 0 for launch in tuned_launches())
    assert "the default of 5 candidates (too small to tune)" in str(attention_plan(inputs(64, "float32")))


def test_with_tuning_off_the_default_runs_and_explain_says_so(monkeypatch):
    monkeypatch.setattr(autotune, "time_ms", lambda run: pytest.fail("timed with tuning off"))
    arrays = inputs(64, "bfloat16")
    results(arrays, True, "cuda")
    text = str(attention_plan(arrays))
    assert text.count("(tuning off)") == 3 and "BLOCK_M=64 BLOCK_N=64" in text, text


def test_an_entry_timed_over_other_candidates_is_timed_again(tuning, tmp_path, monkeypatch):
    arrays = inputs(32, "float32")
    results(arrays, False, "cuda")
    timings = len(tuning)
    path = tmp_path / "autotune" / "gemm.json"
    entries = json.loads(path.read_text())
    for entry in entries.values():  # as an ember with another candidate list timed them
        entry["candidates"] = entry["candidates"][:-1]
    path.write_text(json.dumps(entries))
    monkeypatch.setattr(plan_cache, "_plans", {})
    monkeypatch.setattr(autotune, "_entries", None)
    results(arrays, False, "cuda")
    assert len(tuning) == 2 * timings


def test_a_configuration_that_fails_is_left_out_and_nothing_is_kept_where_none_runs(tuning, monkeypatch):
    def fails():
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(autotune, "time_ms", lambda run: run() or 1.0)

    entry = autotune.timed_tiling("kernel_dq", {"small": lambda: None, "large": fails}, "1")
    assert entry["chosen"] == "small" and list(entry["ms"]) == ["small"]
    assert autotune.cached_tiling("kernel_dq", ["small", "large"], "1") == entry
    assert autotune.timed_tiling("kernel_dkv", {"large": fails}, "1")["chosen"] is None
    assert autotune.cached_tiling("kernel_dkv", ["large"], "1") is None
