"""`ninfer serve` on CUDA: a real uvicorn server over the tiny model's engine on the GPU. Skipped without CUDA."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_serve_api import MODEL, LiveServer

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import SamplingParams
from ninfer_offload.serve.app import create_app

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_server_rehearses_its_serving_path_before_it_listens(tiny_artifact, frontend, caplog):
    """Before it listens, a CUDA server sends greedy and sampled requests through its own routes
    (`serve.rehearsal`); they leave nothing behind: every slot is free for two requests side by side,
    whose greedy outputs equal the engine's own generation of one sequence at a time."""
    engine = Engine.load(tiny_artifact, device="cuda", max_sequences=2, spec="none")
    engine.warm_up()
    prompt = frontend.encode("Once upon a time there was")
    expected = frontend.decode(list(generate(engine, prompt, 12, SamplingParams(greedy=True), frontend.stop_ids)), skip_special_tokens=True)
    with caplog.at_level(logging.INFO, logger="ninfer.serve"):
        with LiveServer(create_app(engine, frontend, MODEL, 512, max_concurrency=2, max_queue=2)) as live:
            assert any("serving path rehearsed" in record.getMessage() for record in caplog.records)
            assert live.health()["active"] == 0 and live.health()["waiting"] == 0
            client = live.client()

            def complete(_: int) -> str:
                return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

            with ThreadPoolExecutor(2) as pool:
                assert list(pool.map(complete, range(2))) == [expected, expected]
