"""Kernel settings from a benchmark's command line: `MODULE.NAME=EXPRESSION`, MODULE one of
`ninfer_offload.kernels`' modules, EXPRESSION evaluated with those modules in scope (e.g.
`moe.GEMV_TILES=quant_linear.GemvTiles(8,2048,4,3)`, `quant_linear.TILED_SCALE_ORDER=False`)."""

from __future__ import annotations

import importlib

MODULES = ("attention", "dense_linear", "gdn", "launch", "moe", "norm", "quant_linear", "router", "rowsplit", "shared_expert")


def kernel_modules() -> dict:
    """The modules a setting may name, by their short name."""
    return {name: importlib.import_module(f"ninfer_offload.kernels.{name}") for name in MODULES}


def parse_setting(text: str, scope: dict) -> tuple[object, str, object]:
    """(module, attribute, value) of `MODULE.NAME=EXPRESSION`."""
    target, _, expression = text.partition("=")
    module_name, _, name = target.strip().partition(".")
    if module_name not in scope or not name or not expression or not hasattr(scope[module_name], name):
        raise SystemExit(f"{text!r}: give MODULE.NAME=EXPRESSION with MODULE one of {', '.join(MODULES)} and an existing NAME")
    return scope[module_name], name, eval(expression, dict(scope))  # a benchmark's own command line


def describe(settings: list[tuple[object, str, object]]) -> list[str]:
    """The settings as `MODULE.NAME=VALUE` strings, for a report."""
    return [f"{module.__name__.rsplit('.', 1)[-1]}.{attr}={value!r}" for module, attr, value in settings]
