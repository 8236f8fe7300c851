"""Kernels of the model's backend ops: Triton (GPU fast path), each next to the reference op it
must match, and numba CPU kernels (`cpu`) for routed experts computed on the host.
"""
