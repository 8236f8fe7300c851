"""Hugging Face checkpoint to .ninfer conversion."""
