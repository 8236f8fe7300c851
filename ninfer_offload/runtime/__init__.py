"""Runtime: engine and sessions over a pooled state, step inputs and CUDA graphs, loader, expert store, sampling, generation."""
