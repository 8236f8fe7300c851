"""ninfer-offload: run Qwen3.6-35B-A3B `.ninfer` artifacts on GPUs too small to hold them."""

__version__ = "0.1.0"
