"""nvfp4 routed and shared experts (and other nvfp4 matrices) through `Engine.load`: logits equal
transformers run on the weights the artifact stores, resident, with every expert in host memory and
through the CPU miss path; bad nvfp4 payloads are one-line load errors naming the tensor. CPU, float32.

Two artifacts of the same tiny checkpoint: the `nvfp4` recipe's (nvfp4 experts, row-split rest) and
one whose attention outputs, embedding and head are nvfp4 too, with other divisor counts."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tiny_hf
import torch
from kernels_support import HAS_CUDA, needs_cuda, needs_triton_device
from nvfp4_support import nvfp4_artifact

from ninfer_offload import ArtifactError, Engine, open_artifact
from ninfer_offload.artifact.formats import NVFP4, BlockScaleGeometry
from ninfer_offload.convert.tiny import tiny_config
from ninfer_offload.model.nvfp4 import Nvfp4Matrix

PROMPT = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(5)).tolist()
STEPS = 4
ARTIFACTS = ["tiny_artifact_nvfp4", "tiny_artifact_nvfp4_matrices"]


@pytest.fixture(scope="module", params=ARTIFACTS)
def path(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def oracle(path):
    """transformers' model holding the weights the nvfp4 artifact stores, decoded by its codecs."""
    from transformers import Qwen3_5MoeTextConfig

    model = tiny_hf.oracle_module().Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig.from_dict(tiny_config(nvfp4=True)))
    with open_artifact(path) as artifact:
        model.load_state_dict(tiny_hf.hf_state_from_artifact(artifact, model.config), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def resident(path):
    engine = Engine.load(path)
    yield engine
    engine.close()


def _run(engine: Engine, steps: list[int], prompt: list[int] = PROMPT) -> list[torch.Tensor]:
    session = engine.session()
    out = [session.prefill(prompt)] + [session.step(token) for token in steps]
    session.close()
    return out


def _head_is_nvfp4(path) -> bool:
    """Whether `path` is the artifact whose non-expert matrices are nvfp4 too."""
    with open_artifact(path) as artifact:
        return artifact.object(artifact.bindings["text/output_head"].parts[0].object).format == NVFP4


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-4) -> bool:
    return (got - want).abs().max().item() <= tolerance * max(1.0, want.abs().max().item())


def test_nvfp4_weights_stay_encoded(resident, path):
    layer = resident.text.layers[0]
    (gate_up,) = layer.moe.shared_in.weights  # the nvfp4 gate and up stacked into one product
    assert isinstance(gate_up, Nvfp4Matrix) and isinstance(layer.moe.shared_down, Nvfp4Matrix)
    assert gate_up.data.numel() == BlockScaleGeometry(256, 128, 2).encoded_size  # two tiles, a divisor each
    assert all(isinstance(layout.gate_up, BlockScaleGeometry) for layout in resident.store.layouts[: resident.config.num_layers])
    assert isinstance(resident.text.head, Nvfp4Matrix) == _head_is_nvfp4(path)


def test_resident_matches_transformers_on_the_stored_weights(resident, oracle):
    ref, cache = tiny_hf.oracle_forward(oracle, PROMPT)
    assert _close(resident.logits(PROMPT), ref)
    session = resident.session()
    assert _close(session.prefill(PROMPT), ref[-1])
    token = int(ref[-1].argmax())
    for _ in range(STEPS):
        ref_step, cache = tiny_hf.oracle_forward(oracle, [token], cache)
        step = session.step(token)
        assert _close(step, ref_step[0]) and int(step.argmax()) == int(ref_step[0].argmax())
        token = int(ref_step[0].argmax())
    session.close()


def test_host_experts_give_the_resident_logits(path, resident):
    engine = Engine.load(path, experts="host", num_slots=3)
    steps = [3, 99, 250]
    for got, want in zip(_run(engine, steps, PROMPT[:8]), _run(resident, steps, PROMPT[:8])):
        assert torch.equal(got, want)
    assert 0 < engine.store.stats.hit_rate < 1
    engine.close()


def test_cpu_miss_path_gives_the_resident_logits(path, resident):
    engine = Engine.load(path, experts="host", miss_path="cpu")
    steps = [3, 99]
    for got, want in zip(_run(engine, steps, PROMPT[:8]), _run(resident, steps, PROMPT[:8])):
        assert _close(got, want)
    assert engine.store.stats.cpu_assignments > 0
    engine.close()


@needs_triton_device
def test_triton_backend_matches_the_reference_engine(path, resident):
    """Host records and cache slots: the MoE kernels reach both through the offset table."""
    if not (HAS_CUDA or _head_is_nvfp4(path)):
        pytest.skip("under the interpreter the artifact with every kind of nvfp4 matrix is enough")
    device = "cuda" if HAS_CUDA else "cpu"
    engine = Engine.load(path, device=device, dtype="float32", backend="triton", experts="host", num_slots=3)
    for got, want in zip(_run(engine, [3], PROMPT[:3]), _run(resident, [3], PROMPT[:3])):
        assert float((got.cpu().double() - want.double()).norm() / want.double().norm()) < 1e-4
    engine.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_engines_with_graphs(path, resident):
    """On CUDA (Triton kernels, decode steps replayed as CUDA graphs): float32 matches the CPU reference
    engine, and bf16 with every expert in pinned host memory equals bf16 resident bit for bit."""
    steps = [3, 99, 250, 7]
    fp32 = Engine.load(path, device="cuda", dtype="float32")
    for got, want in zip(_run(fp32, steps), _run(resident, steps)):
        assert float((got.cpu().double() - want.double()).norm() / want.double().norm()) < 1e-4
    bf16 = Engine.load(path, device="cuda")
    host = Engine.load(path, device="cuda", experts="host", num_slots=3)
    for got, want in zip(_run(host, steps), _run(bf16, steps)):
        assert torch.equal(got, want)
    assert host.store.stats.pcie_bytes > 0
    for engine in (fp32, bf16, host):
        engine.close()


@pytest.mark.parametrize(
    "binding,where,value,message",
    [
        ("text/layers/0/moe/experts/0/gate", "scale", b"\x7f", "routed gate/up bank.*1 NaN block scales"),
        ("text/layers/1/moe/experts/0/down", "scale", b"\xb8", "routed down bank.*1 negative block scales"),
        ("text/layers/2/moe/shared/down", "divisor", struct.pack("<f", 0.0), "shared/down.*divisors that are not finite and > 0"),
        ("text/layers/2/moe/shared/gate", "divisor", struct.pack("<f", -2.0), "shared/gate.*divisors that are not finite and > 0"),
        ("text/output_head", "divisor", struct.pack("<f", float("inf")), "output_head.*divisors that are not finite"),
        ("text/layers/2/attention/output", "divisor", struct.pack("<f", float("nan")), "attention/output.*divisors that are not finite"),
    ],
)
def test_bad_scales_and_divisors_are_named_at_load(tiny_artifact_nvfp4_matrices, tmp_path, binding, where, value, message):
    with open_artifact(tiny_artifact_nvfp4_matrices) as artifact:
        target = artifact.object(artifact.bindings[binding].parts[0].object)
    geometry = BlockScaleGeometry(*target.shape, target.divisors)
    at = geometry.scale_offset if where == "scale" else geometry.divisor_offset

    def edit(object_id: str, data: np.ndarray) -> None:
        if object_id == target.id:
            data[at : at + len(value)] = np.frombuffer(value, np.uint8)

    path = nvfp4_artifact(tiny_artifact_nvfp4_matrices, tmp_path / "bad.ninfer", {}, edit)
    with pytest.raises(ArtifactError, match=message) as err:
        Engine.load(path)
    assert "\n" not in str(err.value) and target.id in str(err.value)


@pytest.mark.parametrize("shape", ["[64,256] ", "[512,32] "])
def test_shapes_that_are_not_whole_tiles_are_named_at_open(tiny_artifact_nvfp4_matrices, tmp_path, shape):
    """An nvfp4 object with N % 128 != 0 or K % 64 != 0 (same byte count, directory edited in place)."""
    with open_artifact(tiny_artifact_nvfp4_matrices) as artifact:
        obj = next(o for o in artifact.objects if o.kind == "tensor" and o.format == NVFP4 and o.shape == (128, 128))
    raw = tiny_artifact_nvfp4_matrices.read_bytes()
    record = f'"id":"{obj.id}","shape":[128,128],'.encode()
    assert raw.count(record) == 1
    path = tmp_path / "bad.ninfer"
    path.write_bytes(raw.replace(record, f'"id":"{obj.id}","shape":{shape},'.encode()))
    with pytest.raises(ArtifactError, match=rf"{obj.id}.*nvfp4 needs N % 128 == 0 and K % 64 == 0") as err:
        Engine.load(path)
    assert "\n" not in str(err.value)
