"""Hugging Face checkpoint to .ninfer conversion: `convert(src_dir, out_path, recipe=...)`."""

from ninfer_offload.convert.converter import convert
from ninfer_offload.convert.recipes import RECIPES

__all__ = ["convert", "RECIPES"]
