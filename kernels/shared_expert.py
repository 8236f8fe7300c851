"""The shared expert's output after its gate/up product: `routed + sigmoid(score) * (silu(gate) * up) @ W_down^T`.

Reference op: `ReferenceBackend.shared_expert(gate, up, down, routed, score)`. One token's shared
expert usually runs inside the routed experts' down launch (`moe.routed_experts` with a
`SharedExpert`, the same roundings); otherwise a quantized down matrix is one `quant_linear` launch
up to its matrix-vector tokens: it computes SwiGLU of the gate/up columns as it reads them and adds the
score-gated rows to the routed output where it stores them (no intermediate activation, no separate
SwiGLU or gating launch). The tiled kernel (a few more tokens) adds the rows the same way after a SwiGLU
launch; prefill and dense weights run both steps as elementwise kernels around the product (`elementwise`). Intermediate results are rounded
to the activation dtype where the reference rounds them.
"""

from __future__ import annotations

import torch

from ninfer_offload.kernels import quant_linear
from ninfer_offload.kernels.dense_linear import dense_linear
from ninfer_offload.kernels.elementwise import add_gated, swiglu
from ninfer_offload.model.backend import Weight


def shared_expert(gate: torch.Tensor, up: torch.Tensor, down: Weight, routed: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(score [T, 1]) * (silu(gate) * up) [T, S] @ down^T (down [H, S])."""
    if isinstance(down, torch.Tensor):
        return add_gated(routed, score, dense_linear(swiglu(gate, up), down))
    return quant_linear.quantized_linear(gate, down.data, down.geometry, up, quant_linear.SWIGLU, routed, score)
