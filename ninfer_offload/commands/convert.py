"""`ninfer convert SRC_DIR OUT.ninfer [--recipe official|nvfp4|bf16|q8] [--text-only] [--max-file-bytes N]`.

The checkpoint's safetensors files are chosen as transformers chooses them (the shards its index
lists, else `model.safetensors`); any other `*.safetensors` file in SRC_DIR is named in a warning.
"""

from __future__ import annotations

from pathlib import Path

import typer


def convert(
    src_dir: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)."),
    out_path: Path = typer.Argument(..., help="Artifact to write (entry file; must not exist)."),
    recipe: str = typer.Option(
        "official", "--recipe",
        help="official (Q4/Q5/Q6/Q8 groupwise), nvfp4 (NVFP4 experts, copied from a compressed-tensors NVFP4 checkpoint "
        "or quantized), bf16 (lossless) or q8.",
    ),
    text_only: bool = typer.Option(False, "--text-only", help="Leave the vision tower out."),
    max_file_bytes: int | None = typer.Option(None, "--max-file-bytes", help="Split into continuation parts of at most this many bytes."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
) -> None:
    """Convert a Qwen3.5/3.6-MoE Hugging Face checkpoint into a .ninfer artifact."""
    from ninfer_offload.artifact.reader import open_artifact
    from ninfer_offload.convert import convert as run_conversion
    from ninfer_offload.convert.checkpoint import INDEX, SINGLE_FILE, select_files

    _, ignored = select_files(src_dir)
    if ignored:
        why = f"not listed in {INDEX}" if (src_dir / INDEX).exists() else f"without {INDEX} only {SINGLE_FILE} is read"
        typer.echo(f"warning: ignoring {', '.join(p.name for p in ignored)} ({why})", err=True)
    path = run_conversion(src_dir, out_path, recipe=recipe, text_only=text_only, max_file_bytes=max_file_bytes, progress=progress)
    with open_artifact(path) as artifact:
        files = len(artifact.directory["files"])
        tensors = sum(1 for o in artifact.objects if o.kind == "tensor")
        payload = sum(f["payload_bytes"] for f in artifact.directory["files"])
        typer.echo(
            f"wrote {path} ({', '.join(artifact.components)}; {tensors} tensors, {len(artifact.bindings)} bindings, "
            f"{payload / 2**20:.1f} MiB payload in {files} file{'s' if files > 1 else ''})"
        )
