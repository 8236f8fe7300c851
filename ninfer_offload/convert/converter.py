"""`convert()`: a Hugging Face Qwen3.5/3.6-MoE checkpoint directory -> a v3 `.ninfer` artifact.

Memory bound: objects are encoded one at a time, in object order, while the writer streams them
to disk; sources are read in slices (encode.CHUNK_ELEMENTS elements). Peak resident memory is the
encoded bytes of the object being produced and of the previous one (the writer still holds it
while the next source runs) plus a slice window of about 60 MiB and the interpreter, torch and
numpy: about 2x the largest tensor plus a constant (BF16 sources: an encoded object is at most as
large as its source, except Q8 of rows shorter than 128). Measured: 264 MiB above the idle
process for two consecutive 128 MiB tensors with the bf16 recipe (tests/test_convert_memory.py).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from ninfer_offload import __version__
from ninfer_offload.artifact.formats import NVFP4, encoded_size
from ninfer_offload.artifact.writer import ArtifactWriter
from ninfer_offload.convert.checkpoint import TEXT_RESOURCES, VISION_RESOURCES, Checkpoint
from ninfer_offload.convert.encode import encode_parent, storage_layout
from ninfer_offload.convert.hf_config import ModelSpec, read_model_config
from ninfer_offload.convert.layout import Layout, Parent, plan_layout
from ninfer_offload.convert.recipes import check_recipe
from ninfer_offload.errors import NinferError
from ninfer_offload.artifact.contract import MTP_CONFIG

TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIX = "model.visual."


def text_prefix(names: set[str]) -> str:
    """`model.language_model.` (ConditionalGeneration checkpoints) or `model.` (CausalLM)."""
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise NinferError("checkpoint is missing tensor 'model.embed_tokens.weight' (or 'model.language_model.embed_tokens.weight')")


def directory_entries(layout: Layout):
    """Per parent, in object order: (object id, parent, [(binding, begin, end)], [(binding, input)])."""
    for index, parent in enumerate(layout.parents):
        begin, ranges, uses = 0, [], []
        for member in parent.members:
            end = begin + member.rows * parent.row_elements
            ranges.append((member.binding, begin, end))
            uses += [(member.binding, i) for i in member.inputs]
            begin = end
        yield f"weight/{index:06d}", parent, ranges, uses


def _check_tensors(checkpoint: Checkpoint, layout: Layout, vision: bool) -> None:
    """Every planned source exists with its shape; no text/mtp (or converted vision) tensor is left over."""
    for parent in layout.parents:
        for source in parent.sources:
            checkpoint.check(source.tensor, source.shape)
        problem = parent.nvfp4_problem() if parent.format == NVFP4 else None
        if problem:
            raise NinferError(f"tensor {checkpoint.stored_name(parent.sources[0].tensor)!r}: {problem}; choose another --recipe")
    used = layout.tensors()
    for name in sorted(checkpoint.names - used):
        if not name.startswith(VISION_PREFIX) or vision:
            raise NinferError(f"tensor {name!r} is not part of the Qwen3.5/3.6-MoE layout; refusing to drop it")


def _resources(checkpoint: Checkpoint, vision: bool) -> list[tuple[str, str, bytes]]:
    """(component, role, bytes) of every resource, the four text roles required."""
    found = []
    for role in TEXT_RESOURCES:
        data = checkpoint.chat_template() if role == "chat_template.jinja" else checkpoint.resource(role)
        if data is None:
            what = "chat_template.jinja (or a chat_template inside tokenizer_config.json)" if role == "chat_template.jinja" else role
            raise NinferError(f"{checkpoint.directory}: missing {what}")
        found.append(("text", role, data))
    if vision:
        found += [("vision", role, data) for role in VISION_RESOURCES if (data := checkpoint.resource(role)) is not None]
    return found


def convert(
    src_dir: str | Path,
    out_path: str | Path,
    recipe: str = "official",
    text_only: bool = False,
    max_file_bytes: int | None = None,
    progress: bool = True,
) -> Path:
    """Convert the checkpoint in `src_dir` to the artifact `out_path` (v3); returns the entry path.

    Components: `text` always, `mtp` when the checkpoint has `mtp.*` tensors, `vision` when it has
    a vision tower and `text_only` is false. Nothing is written under `out_path` unless the whole
    conversion succeeds (temporary names, then rename); an existing `out_path` is never replaced.
    """
    check_recipe(recipe)
    out_path = Path(out_path)
    if out_path.exists():
        raise NinferError(f"{out_path} already exists; remove it or choose another output path")
    if not out_path.parent.is_dir():
        raise NinferError(f"{out_path.parent}: output directory does not exist")
    checkpoint = Checkpoint(src_dir)
    spec = read_model_config(checkpoint.config)
    names = checkpoint.names
    has_mtp = "mtp.fc.weight" in names
    has_vision = spec.vision is not None and any(n.startswith(VISION_PREFIX) for n in names) and not text_only
    layout = plan_layout(spec, recipe, names.__contains__, text_prefix(names), has_mtp, has_vision)
    _check_tensors(checkpoint, layout, has_vision)
    writer = ArtifactWriter(out_path, max_file_bytes=max_file_bytes, metadata={"name": checkpoint.directory.resolve().name},
                            provenance=_provenance(checkpoint, recipe, text_only))
    _add_components(writer, spec, has_mtp, has_vision)
    for component, role, data in _resources(checkpoint, has_vision):
        writer.add_resource(f"resource/{component}/{role}", data, component=component, role=role)
    with _progress_bar(progress) as bar:
        task = bar.add_task(f"convert ({recipe})", total=0)
        for object_id, parent, ranges, uses in directory_entries(layout):
            layout_name = storage_layout(parent.format)
            size = encoded_size(layout_name, parent.format, parent.shape, parent.divisors)
            bar.update(task, total=bar.tasks[0].total + size)
            writer.add_tensor(object_id, parent.shape, parent.format, layout_name,
                              _encoder(checkpoint, parent, lambda size=size: bar.advance(task, size)), parent.divisors)
            for binding, begin, end in ranges:
                if len(ranges) == 1:
                    writer.bind(binding, object_id)
                else:
                    writer.bind_parts(binding, [(object_id, begin, end)])
            for binding, input_site in uses:
                writer.use(binding, input_site)
        return writer.write()


def _encoder(checkpoint: Checkpoint, parent: Parent, done):
    """The writer's source callable for `parent`: encodes it, then reports progress."""

    def encode():
        data = encode_parent(parent, checkpoint)
        done()
        return data

    return encode


def _add_components(writer: ArtifactWriter, spec: ModelSpec, mtp: bool, vision: bool) -> None:
    writer.add_component("text", spec.text_config)
    if mtp:
        writer.add_component("mtp", MTP_CONFIG, target="text")
    if vision:
        writer.add_component("vision", spec.vision_config, target="text")


def _provenance(checkpoint: Checkpoint, recipe: str, text_only: bool) -> dict:
    return {
        "converter": f"ninfer-offload {__version__}",
        "recipe": recipe,
        "text_only": text_only,
        "sources": {"checkpoint": {"path": str(checkpoint.directory.resolve())}},
    }


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
