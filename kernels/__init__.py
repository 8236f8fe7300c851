"""Triton kernels (GPU fast path), each next to the reference op it must match."""
