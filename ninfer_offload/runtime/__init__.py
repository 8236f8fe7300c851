"""Runtime: engine, per-sequence state, expert store, loader, sampling."""
