"""The tensor-core ceiling of a prefill on this GPU: cuBLAS bf16 GEMMs of the forward's products at the chunk's
token count (`planner.flops.forward_products`; a routed product as one batched GEMM over the layer's experts,
each with its share of the tokens), timed with CUDA events. `tensor_fraction` of a measured prefill is its FLOP
rate (products and attention) over the ceiling's rate (products only): the share of what the card's GEMM
library reaches on the same shapes.
"""

from __future__ import annotations

import torch

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.planner.flops import Product, attention_flops, forward_products, product_flops


def _gemm_seconds(product: Product, tokens: int, device: torch.device, repeats: int = 5) -> float:
    """Seconds of one layer's GEMMs of `product` over `tokens` tokens (the fastest of `repeats`)."""
    rows = max(1, round(tokens * product.token_share))
    a = torch.randn(product.experts, rows, product.cols, device=device, dtype=torch.bfloat16)
    b = torch.randn(product.experts, product.cols, product.rows, device=device, dtype=torch.bfloat16)
    torch.bmm(a, b)  # cuBLAS picks and warms its kernel
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.bmm(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def ceiling(dims: ModelDims, chunk: int, device: torch.device) -> dict:
    """cuBLAS bf16 seconds and TFLOPS of one forward's products over `chunk` tokens, per product and in all."""
    products = forward_products(dims)
    rows = []
    for product in products:
        seconds = _gemm_seconds(product, chunk, device) * product.layers
        rows.append({"product": product.name, "seconds": seconds, "tflops": product.flops(chunk) / seconds / 1e12})
    total = sum(row["seconds"] for row in rows)
    return {"tokens": chunk, "seconds": total, "tflops": product_flops(products, chunk) / total / 1e12, "products": rows}


def prefill_fraction(dims: ModelDims, tokens: int, chunk: int, seconds: float, ceilings: dict[int, dict]) -> dict:
    """A measured prefill of `tokens` tokens in chunks of `chunk` that took `seconds`, against the ceiling of the
    same chunks (`ceilings`: `ceiling` by chunk size, filled as needed by the caller)."""
    products = forward_products(dims)
    flops = ceiling_seconds = 0.0
    for start in range(0, tokens, chunk):
        size = min(chunk, tokens - start)
        flops += product_flops(products, size) + attention_flops(dims, size, start)
        ceiling_seconds += ceilings[size]["seconds"]
    ceiling_tflops = product_flops(products, tokens) / ceiling_seconds / 1e12
    tflops = flops / seconds / 1e12
    return {"tflops": tflops, "tensor_ceiling_tflops": ceiling_tflops, "tensor_fraction": tflops / ceiling_tflops}


def chunk_sizes(tokens: int, chunk: int) -> set[int]:
    """The chunk sizes a prefill of `tokens` tokens runs in."""
    return {min(chunk, tokens - start) for start in range(0, tokens, chunk)}
