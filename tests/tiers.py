"""The suite's tiers: `--tier quick` (the default, the README's test command), `full`, and `rest` (full less quick).

The quick tier runs every test function, but of a parametrized one only a covering sample: enough of its
cases that every value of every parameter (every op, dtype, shape, layout...) runs at least once on each device
of the op suite (the reference backend and the interpreter), chosen the same way on every run and in every
xdist worker. Property-based tests (hypothesis) run there with a tenth of their examples, and tests marked
`slow` (interpreter runs of large kernels, whole examples on the interpreted cuda device) not at all. The full tier runs
every case at full example counts; `rest` is what `full` adds to `quick`, so that CI runs the quick tier (the
README's command) and then `rest` without running anything twice. Tests of the GPU suite (marked `gpu`) and
cases named explicitly on the command line are always kept.
"""

from __future__ import annotations

import zlib

TIERS = ("quick", "full", "rest")
_tier = "quick"


def add_option(parser) -> None:
    parser.addoption("--tier", choices=TIERS, default="quick",
                     help="quick: a covering sample of each parametrized test (default); full: every case; "
                          "rest: the cases full adds to quick")


def configure(config) -> None:
    """The tier of this run: the GPU suite (`-m gpu`) always runs its property-based tests in full."""
    global _tier
    marks = config.getoption("markexpr") or ""
    _tier = "full" if "gpu" in marks and "not gpu" not in marks else config.getoption("--tier")


def examples(n: int) -> int:
    """A property-based test's example count in this tier: a tenth (at least 10) in the quick one."""
    return n if _tier != "quick" else max(10, n // 10)


def select(config, items) -> None:
    """Deselect what this tier does not run (reported by pytest as deselected)."""
    if _tier == "full":
        return
    named = {arg for arg in config.args if "::" in arg}
    quick = _covering_sample([item for item in items if _sampled(item, named) and not _slow(item, named)])
    keep, dropped = [], []
    for item in items:
        in_quick = item in quick or not _sampled(item, named) and not _slow(item, named)
        wanted = in_quick if _tier == "quick" else not in_quick or _is_property_based(item)
        (keep if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _sampled(item, named: set[str]) -> bool:
    """Whether the item is one case among others that the quick tier may leave out."""
    return (getattr(item, "callspec", None) is not None and item.get_closest_marker("gpu") is None
            and item.nodeid not in named)


def _slow(item, named: set[str]) -> bool:
    """A test marked `slow` (an interpreter run of a large kernel or of a whole example) is in the full tier
    only, unless it is in the GPU suite or named on the command line."""
    return (item.get_closest_marker("slow") is not None and item.get_closest_marker("gpu") is None
            and item.nodeid not in named)


def _is_property_based(item) -> bool:
    return getattr(getattr(item, "obj", None), "is_hypothesis_test", False)


def _covering_sample(items) -> set:
    """Per test function, cases in a fixed pseudo-random order, each kept while it adds a parameter value not
    yet covered (on its device, for the op suite's device dimension)."""
    by_function: dict[str, list] = {}
    for item in items:
        by_function.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    kept = set()
    for cases in by_function.values():
        covered: set = set()
        for item in sorted(cases, key=lambda it: zlib.crc32(it.nodeid.encode())):
            features = _features(item.callspec)
            if not features <= covered:
                covered |= features
                kept.add(item)
    return kept


def _features(callspec) -> set:
    params = callspec.params
    device = params.get("device")
    values = {(name, _key(value, callspec.indices.get(name))) for name, value in params.items()}
    return values | {(device, *value) for value in values} if device is not None else values


def _key(value, index: int | None) -> str:
    """A name for a parameter's value that is the same in every process (no addresses). Where the value alone
    names it ambiguously (lambdas, objects shown by address), its place in its parametrize list is added: for a
    parametrize of several names that place is the tuple's, so each such tuple counts as a value of its own."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_key(v, index) for v in value) + ")"
    name = getattr(value, "name", None)
    if isinstance(name, str) and not hasattr(value, "__code__"):
        return f"{type(value).__qualname__}:{name}"
    text = repr(value)
    return f"{type(value).__qualname__}#{index}" if " at 0x" in text or hasattr(value, "__code__") else text
