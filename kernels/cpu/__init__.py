"""Numba kernels (host path): routed experts computed on the CPU from the stored records."""
