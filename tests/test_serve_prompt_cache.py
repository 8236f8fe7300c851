"""The prompt cache through a real server (tiny model on the CPU, MTP speculation on): a chat's later turns and
requests sharing a prefix report the resumed tokens as `usage.prompt_tokens_details.cached_tokens` and give exactly
the text of the same request with `"cache_prompt": false` (which neither reads nor saves the cache: a cold run),
greedy and seeded, one after another and concurrently; `/health` shows the cache's hits and memory; a non-boolean
`cache_prompt` is a 422 naming it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve_api import MODEL, LiveServer

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app

SYSTEM = "You are a terse assistant who answers every question about the weather in one short sentence."


@pytest.fixture(scope="module")
def server(tiny_artifact, frontend):
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=3, spec="mtp", prompt_cache=True, prompt_cache_every=16)
    with LiveServer(create_app(engine, frontend, MODEL, 512, max_concurrency=3, max_queue=4, prefill_chunk=32)) as live:
        yield live


def chat(server: LiveServer, messages: list[dict], cache: bool = True, **sampling) -> tuple[str, int]:
    """(reply, cached prompt tokens) of a chat request."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "cache_prompt": cache, **sampling}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_a_chat_resumes_its_history_and_replies_as_a_cold_server(server, sampling):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Rain in Oslo? {sampling}"}]
    for turn in range(2):
        reply, cached = chat(server, messages, **sampling)
        assert (reply, 0) == chat(server, messages, cache=False, **sampling)
        assert turn == 0 or cached > 0
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And tomorrow, turn {turn}?"}]


def test_concurrent_completions_sharing_a_prefix_match_cold_ones(server):
    prefix = list(range(40, 80))
    server.post("/v1/completions", {"model": MODEL, "prompt": prefix + [3], "max_tokens": 1})
    prompts = [prefix + list(range(100 + 10 * i, 103 + 11 * i)) for i in range(3)]

    def complete(prompt: list[int], cache: bool) -> tuple[str, int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "cache_prompt": cache}
        data = server.post("/v1/completions", body).json()
        return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: complete(p, True), prompts))
    assert [text for text, _ in together] == [complete(p, False)[0] for p in prompts]
    assert all(cached >= 32 for _, cached in together)
    stats = server.health()["prompt_cache"]
    assert stats["hit_tokens"] > 0 and stats["entries"] > 0 and 0 < stats["device_bytes"] <= stats["device_limit"]


def test_cache_prompt_must_be_a_boolean(server):
    for route, body in [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_prompt": "no"}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_prompt": 1}),
    ]:
        response = server.post(route, body)
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "cache_prompt"
