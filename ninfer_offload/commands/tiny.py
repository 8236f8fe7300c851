"""`ninfer tiny DIR [--seed N]`: a tiny random checkpoint of the real architecture, to try every command in minutes."""

from __future__ import annotations

from pathlib import Path

import typer

from ninfer_offload.errors import NinferError


def tiny(
    directory: Path = typer.Argument(..., help="Directory to write the checkpoint to (new or empty)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    nvfp4: bool = typer.Option(False, "--nvfp4", help="Hidden size and expert widths 128 and 4 experts, which --recipe nvfp4 accepts."),
) -> None:
    """Write a tiny random Qwen3.5/3.6-MoE checkpoint (6 layers, 8 experts, MTP, 512-token vocabulary) for `ninfer convert`."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise NinferError(f"{directory} already exists and is not an empty directory; choose a new one")
    from ninfer_offload.convert.tiny import tiny_config, write_checkpoint

    config = tiny_config(nvfp4=nvfp4)
    write_checkpoint(directory, config, seed=seed)
    size = sum(p.stat().st_size for p in directory.iterdir())
    typer.echo(
        f"wrote {directory}: a random Qwen3_5MoeForCausalLM with {config['num_hidden_layers']} layers, "
        f"{config['num_experts']} experts (top-{config['num_experts_per_tok']}), hidden size {config['hidden_size']}, "
        f"vocabulary {config['vocab_size']}, MTP ({size / 2**20:.1f} MiB); next: ninfer convert {directory} tiny.ninfer"
    )
