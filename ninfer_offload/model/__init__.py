"""The model math: config, bindings and layers (PyTorch reference ops)."""
