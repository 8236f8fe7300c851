"""The command-line options of a load, defined once for `generate`, `serve` and `plan`: `load_options(*names)`
adds the named ones to a command, which gets their values as one dict (`load`) and makes its
`planner.request.LoadRequest` from them where its checks belong (before the slow load):

    @load_options(*PLACEMENT, *SPECULATION)
    def serve(artifact: Path = typer.Argument(...), ..., load: dict) -> None:
        request = LoadRequest(**load, max_sequences=max_concurrency)

Every option here keeps the name of the `LoadRequest` field it sets, so a bad value reads the same
one-line error from every command.
"""

from __future__ import annotations

import copy
import functools
import inspect

import typer

from ninfer_offload.planner.options import MAX_DRAFTS, PREFILL_CHUNK
from ninfer_offload.planner.request import DEFAULT_CACHE_POLICY, DEFAULT_DRAFT_TOKENS

# (annotation, option) of each shared option, named as its LoadRequest field.
OPTIONS: dict[str, tuple[object, typer.models.OptionInfo]] = {
    "experts": (str, typer.Option(
        "auto", "--experts",
        help="auto (all in VRAM where they fit, else as planned), resident (all in VRAM) or host (all in host memory, read over PCIe).",
    )),
    "profile": (str | None, typer.Option(
        None, "--profile", help="Plan the load for this card: a profile name, TOML file or auto (this GPU's stored or detected profile)."
    )),
    "vram_budget": (str | None, typer.Option(
        None, "--vram-budget", help="Use at most this much VRAM (e.g. 15GiB); the experts that do not fit stay in host memory."
    )),
    "cache_policy": (str, typer.Option(
        DEFAULT_CACHE_POLICY, "--cache-policy",
        help="Expert cache in VRAM: decayed (frequency), batch (frequency blended with the plan's rate per step's rows), "
        "lru or static (the plan's experts only).",
    )),
    "miss_path": (str, typer.Option(
        "pcie", "--miss-path",
        help="Experts not in VRAM: pcie (read by the GPU from host memory), cpu (computed on the host) "
        "or auto (both, split by measured rates).",
    )),
    "spec": (str, typer.Option(
        "auto", "--spec",
        help="auto: mtp where the artifact has MTP weights and the cost model projects it pays on this card (x1.15 or more), "
        "else none; none: one token per step; mtp: decode speculatively, drafting with the model's MTP layer (server: requests "
        "without a grammar or logprobs). An artifact's DFlash/DFlash2 drafter is never run.",
    )),
    "draft_tokens": (int | None, typer.Option(
        None, "--draft-tokens", "--drafts",
        help=f"MTP drafts verified per step when speculating (1..{MAX_DRAFTS}; default {DEFAULT_DRAFT_TOKENS}).",
    )),
    "proposal_head": (bool, typer.Option(
        False, "--proposal-head", help="Draft with the artifact's proposal head (a subset of the vocabulary) instead of the output head."
    )),
    "kv_dtype": (str | None, typer.Option(
        None, "--kv-dtype", help="KV cache: fp8 (half the memory of the default, the compute dtype's bf16; float32 on a CPU load)."
    )),
    "max_context": (int | None, typer.Option(
        None, "--max-context", help="Tokens per sequence, prompt + completion (default: min(the model's, 32768))."
    )),
    "prefill_chunk": (int, typer.Option(
        PREFILL_CHUNK, "--prefill-chunk",
        help="Most prompt tokens per forward: larger prefills faster, most with experts in host memory, and sets more VRAM aside.",
    )),
    "prompt_cache": (bool, typer.Option(
        False, "--prompt-cache/--no-prompt-cache",
        help="Keep the states of finished requests and long prompts, so that a request starting with the same tokens "
        "(a chat's history, an agent's context) prefills only what is new.",
    )),
    "prompt_cache_vram": (str | None, typer.Option(
        None, "--prompt-cache-vram",
        help="Prompt cache in VRAM (e.g. 2GiB), taken from the VRAM budget; default: a tenth of it, at most 4 GiB.",
    )),
    "prompt_cache_host": (str | None, typer.Option(
        None, "--prompt-cache-host", help="Prompt cache in pinned host memory beyond the VRAM part (e.g. 16GiB, the default)."
    )),
}
PLACEMENT = ("experts", "profile", "vram_budget", "cache_policy", "miss_path")  # where the experts go
PROMPT_CACHE = ("prompt_cache", "prompt_cache_vram", "prompt_cache_host")
SPECULATION = ("spec", "draft_tokens", "proposal_head")


def load_options(*names: str, **defaults):
    """A decorator adding the shared options `names` (keys of OPTIONS; `defaults` overrides some defaults) to
    a typer command after its own parameters: the command declares a `load` parameter instead, and gets
    the options' values as a dict of `LoadRequest` keyword arguments."""

    def add(command):
        signature = inspect.signature(command)
        own = [p for name, p in signature.parameters.items() if name != "load"]
        added = []
        for name in names:
            annotation, option = OPTIONS[name]
            if name in defaults:
                option = copy.copy(option)
                option.default = defaults[name]
            added.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=annotation))

        @functools.wraps(command)
        def run(**values):
            load = {name: values.pop(name) for name in names}
            return command(**values, load=load)

        run.__signature__ = signature.replace(parameters=own + added)
        annotations = {name: value for name, value in command.__annotations__.items() if name != "load"}
        run.__annotations__ = annotations | {p.name: p.annotation for p in added}
        return run

    return add
