"""`python -m ninfer_offload` runs the `ninfer` command line."""

from ninfer_offload.cli import entry

entry()
