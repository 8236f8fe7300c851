"""The model math: weights, layers, the Backend protocol with its PyTorch reference ops, the step context and the state pool."""
