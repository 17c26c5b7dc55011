"""Warm launches skip Triton's per-call binding: one compiled kernel kept per specialization class, the
launcher called with the arguments Triton's `run` would pass. Checked with a stand-in kernel function (the
real ones run under `pytest -m gpu`)."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from ember.runtime import triton_launch  # noqa: E402


class _Param:
    def __init__(self, name: str, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Kernel:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log: list, number: int):
        self.log, self.number = log, number

    def run(self, *args):
        self.log.append(("direct", self.number, args))


class _Fn:
    """Stands in for a Triton JITFunction: `run` compiles (a new kernel per call) and launches."""

    params = [_Param("x"), _Param("out"), _Param("n"), _Param("scale"), _Param("BLOCK"), _Param("FLAG", 3)]
    __name__ = "stand_in"

    def __init__(self):
        self.log: list = []
        self.compiled = 0

    def run(self, *args, grid, warmup, **options):
        self.compiled += 1
        self.log.append(("run", args, grid, options))
        return _Kernel(self.log, self.compiled)


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def test_warm_launches_call_the_kept_kernel_with_runs_arguments(direct):
    fn = _Fn()
    launch = triton_launch.Launch(fn, (5, 2), [(0, "x"), (0, "out"), (1, 4096), (2, 0)],
                                  {"BLOCK": 1024, "num_warps": 4}, interpret=False)
    x, out = torch.empty(64), torch.empty(64)
    for scale in (0.5, 0.25, 2.0):
        launch(launch.arguments({"x": x, "out": out}, [scale]))
    assert fn.compiled == 1  # floats are not specialized on: one kernel
    assert fn.log[0] == ("run", (x, out, 4096, 0.5), (5, 2), {"BLOCK": 1024, "num_warps": 4})
    # what Triton's run passes its launcher: grid (padded to 3), stream, function, metadata, no launch
    # metadata or hooks, then every parameter's value, constexprs and defaults included
    assert fn.log[1] == ("direct", 1, (5, 2, 1, 1234, "function", "metadata", None, None, None,
                                       x, out, 4096, 0.25, 1024, 3))
    assert fn.log[2][2][12] == 2.0


def test_each_specialization_class_gets_its_own_kernel(direct):
    fn = _Fn()
    launch = triton_launch.Launch(fn, (1,), [(0, "x"), (0, "out"), (1, 7), (2, 0)], {"BLOCK": 16, "FLAG": 1},
                                  interpret=False)
    base = torch.empty(100)
    cases = [(base[:64], 8), (base[1:65], 8), (base[:64], 1), (base[:64], 32), (base[:64], 2**40),
             (base[4:68], 8), (base[:64], 9), (base[2:66], 5)]
    for x, n in cases:
        launch(launch.arguments({"x": x, "out": base[:64]}, [n]))
    # aligned/unaligned x crossed with n's class (other, 1, multiple of 16, 64-bit): base[4:] is 16-byte
    # aligned like base[:64], base[2:] unaligned like base[1:], and 8 and 9 share a class
    assert fn.compiled == 5
    assert [entry[0] for entry in fn.log] == ["run", "run", "run", "run", "run", "direct", "direct", "direct"]
    assert fn.log[-1][2][-2:] == (16, 1)  # the constexprs given override the default


def test_the_interpreter_launches_through_run_every_time(direct):
    fn = _Fn()
    fn.params = fn.params[:1]
    args = [torch.empty(8)]
    direct_launch = triton_launch.Launch(fn, (1,), [(0, "x")], {}, interpret=False)
    direct_launch(args)
    direct_launch(args)
    assert fn.compiled == 1
    interpreted = triton_launch.Launch(fn, (1,), [(0, "x")], {}, interpret=True)
    interpreted(args)
    interpreted(args)
    assert fn.compiled == 3


def test_hooks_count_only_when_a_chain_has_calls():
    class Chain:
        calls: list = []
    assert not triton_launch._hooked(None) and not triton_launch._hooked(Chain())
    chain = Chain()
    chain.calls = [print]
    assert triton_launch._hooked(chain) and triton_launch._hooked(print)
