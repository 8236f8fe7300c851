"""Benchmark scripts run with bench/ first on sys.path (`python bench/NAME.py`), so a script named like an
installed package would replace it for every import in that process (transformers >= 5.25 imports the hub's
`kernels` distribution, which a `bench/kernels.py` shadowed)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_bench_scripts_do_not_shadow_installed_packages():
    scripts = {path.stem for path in BENCH.glob("*.py")}
    installed = importlib.metadata.packages_distributions()
    assert scripts, "no benchmark scripts found"
    assert not scripts & installed.keys(), {name: installed[name] for name in scripts & installed.keys()}
