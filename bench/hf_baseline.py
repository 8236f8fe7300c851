"""transformers' `Qwen3_5MoeForCausalLM` from an artifact's text config with random bf16 weights: the
baseline of bench/resident.py (all on the GPU) and the floor of bench/offload.py (accelerate's offload),
possibly at a reduced depth, and the full-depth time extrapolated from two depths."""

from __future__ import annotations

import importlib
import inspect
import sys

import torch

MODELING = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
FAST_KERNEL_PACKAGES = ("fla", "causal_conv1d")


def text_config(config: dict, depth: int):
    """transformers' text config of the artifact's text `config`, cut to its first `depth` layers."""
    from transformers import Qwen3_5MoeTextConfig

    cfg = dict(config, num_hidden_layers=depth, layer_types=config["layer_types"][:depth])
    return Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})


def random_model(config: dict, depth: int, device: str | torch.device) -> torch.nn.Module:
    """The model of `depth` layers built on `device` in bf16 with transformers' random init (eval mode).
    On "meta" it only has sizes (for device maps)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(text_config(config, depth), dtype=torch.bfloat16).eval()


def import_torch_kernels() -> None:
    """Import transformers' qwen3_5_moe modeling with flash-linear-attention and causal-conv1d hidden.

    transformers binds those packages' kernels in place of its PyTorch GDN and convolution functions
    when the modeling module is first imported (`use_kernel_func_from_hub_with_fallback`, 5.17 and
    5.24): with the packages hidden during that import (`sys.modules[name] = None` makes `import
    name` raise ImportError) the PyTorch paths are bound for the whole process, while the engine
    can still import the packages afterwards (as `tests/tiny_hf.oracle_module` does). Raises if the
    module was already imported with a fast kernel bound.
    """
    if MODELING not in sys.modules:
        saved = {name: sys.modules.get(name) for name in FAST_KERNEL_PACKAGES}
        for name in FAST_KERNEL_PACKAGES:
            sys.modules[name] = None
        try:
            importlib.import_module(MODELING)
        finally:
            for name, module in saved.items():
                if module is None:
                    del sys.modules[name]
                else:
                    sys.modules[name] = module
    module = sys.modules[MODELING]
    for fn in (module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule, module.causal_conv1d_fn):
        if inspect.getclosurevars(fn).nonlocals.get("is_new_implementation"):
            raise RuntimeError(f"{MODELING} was imported with a fast kernel bound before import_torch_kernels()")


def depth_method(depths: tuple[int, ...], full_layers: int) -> str:
    """How `full_depth_seconds` gets the full model's time from `depths`."""
    if depths == (full_layers,):
        return f"measured at all {full_layers} layers"
    lo, hi = depths
    return f"measured at {lo} and {hi} layers, per-layer cost by difference, extrapolated to {full_layers}"


def full_depth_seconds(seconds: dict[int, float], full_layers: int) -> float:
    """The full model's time from its own measurement or from two reduced depths (linear in layers)."""
    if list(seconds) == [full_layers]:
        return seconds[full_layers]
    (lo, a), (hi, b) = sorted(seconds.items())
    if b <= a:  # no measurable per-layer cost: scale the deeper model proportionally instead
        return b * full_layers / hi
    return a + (b - a) * (full_layers - lo) / (hi - lo)
