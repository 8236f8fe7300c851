"""What every route needs: the model's name and limits, the request worker thread, sampling
checks, prompt size checks, request submission."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ninfer_offload.errors import NinferError
from ninfer_offload.frontend.grammar import GrammarCompiler
from ninfer_offload.runtime.sampling import SamplingError, SamplingParams, sampling_from_config
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.protocol import SamplingFields
from ninfer_offload.runtime.decoder import GenerationRequest
from ninfer_offload.serve.scheduler import QueueFullError, Scheduler, ShuttingDownError

log = logging.getLogger("ninfer.serve")

Result = TypeVar("Result")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait before trying again

# Unicode normalization (NFC, NFKC) composes at most 4 code points into one; ASCII text it leaves alone.
_NORMALIZATION_SHRINK = 4


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: its body, prompt tokens, completion budget and sampling."""

    body: SamplingFields
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    constraint: Any = None  # a GrammarConstraint for structured output
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked for
    cache_prompt: bool = True  # resume from and save to the engine's prompt cache


def longest_token_bytes(frontend: Any) -> int:
    """The most UTF-8 bytes of text one token of the vocabulary covers (its decoded text; a partial
    character decodes to U+FFFD, which counts 3 bytes for the 1 to 3 it covers)."""
    tokenizer = frontend.tokenizer
    texts = tokenizer.decode_batch([[i] for i in range(frontend.vocab_size)], skip_special_tokens=False)
    return max(len(text.encode("utf-8")) for text in texts)


@dataclass
class ServeContext:
    """The engine's frontend and scheduler, the server's naming and context limit, and one worker
    thread that decodes, validates, renders and tokenizes requests off the event loop, one at a
    time (so the memory of that work is bounded by one request's)."""

    frontend: Any
    scheduler: Scheduler
    model_name: str
    max_context: int
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ninfer-request"))
    max_token_bytes: int = field(init=False)
    grammar_compiler: GrammarCompiler | None = field(init=False)
    grammar_problem: str | None = field(init=False)  # why structured output is unavailable

    def __post_init__(self) -> None:
        self.max_token_bytes = longest_token_bytes(self.frontend)
        try:
            self.grammar_compiler, self.grammar_problem = GrammarCompiler.for_frontend(self.frontend, self.frontend.vocab_size), None
        except NinferError as exc:
            self.grammar_compiler, self.grammar_problem = None, str(exc)
            log.warning("warning: structured output (response_format, tools) is unavailable: %s", exc)

    async def off_loop(self, work: Callable[..., Result], *args: Any) -> Result:
        """`work(*args)` on the request worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, work, *args)

    def grammars(self, param: str) -> GrammarCompiler:
        """Structured-output grammars against the model's tokenizer; 400 naming `param` (the field that
        asks for a grammar) when llguidance could not use the tokenizer."""
        if self.grammar_compiler is None:
            message = f"{param} needs structured output, which is unavailable for this model: {self.grammar_problem}"
            raise APIError(400, message, param=param, code="unsupported_value")
        return self.grammar_compiler

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404, f"The model '{name}' does not exist; this server serves '{self.model_name}'", param="model", code="model_not_found"
            )

    def sampling(self, body: SamplingFields) -> SamplingParams:
        """Request values, else the model's generation_config.json defaults, else OpenAI's; 422
        naming the field the sampler cannot use (the rules are `SamplingParams`'), or a biased token
        id outside the vocabulary."""
        bias = body.logit_bias or {}
        vocab = self.frontend.vocab_size
        if any(not 0 <= token < vocab for token in bias):
            raise APIError(422, f"logit_bias token ids must lie in [0, {vocab})", param="logit_bias", code="invalid_value")
        try:
            return sampling_from_config(
                self.frontend.generation_config,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed,
                logit_bias=tuple(sorted(bias.items())),
            )
        except SamplingError as exc:
            raise APIError(422, str(exc), param=exc.param, code="invalid_value") from None

    def encode(self, prompt: str, param: str) -> list[int]:
        """Token ids of `prompt`; 400 without tokenizing when it has more characters than
        `max_context` tokens can cover (each covers at most `max_token_bytes` bytes of normalized text)."""
        per_token = self.max_token_bytes * (1 if prompt.isascii() else _NORMALIZATION_SHRINK)
        if len(prompt) > self.max_context * per_token:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, the prompt has {len(prompt)} "
                f"characters, more than {self.max_context} tokens can hold. Please shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        return self.frontend.encode(prompt)  # releases the GIL: the event loop keeps serving meanwhile

    def token_budget(self, prompt_tokens: int, requested: int | None, prompt_param: str, limit_param: str = "max_tokens") -> int:
        """The completion limit (`limit_param`) checked against the context (vLLM's rule); None means all the room left."""
        if prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
        room = self.max_context - prompt_tokens
        if room <= 0 or (requested is not None and requested > room):
            asked = prompt_tokens + (requested or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{asked} tokens ({prompt_tokens} in the prompt, {requested or 0} for the completion). "
                f"Please shorten the prompt or lower {limit_param}.",
                param=prompt_param if room <= 0 else limit_param,
                code="context_length_exceeded",
            )
        return requested if requested is not None else room

    def start(self, prefix: str, prepared: Prepared) -> TextGeneration:
        """Queue the request on the engine thread; 429 when the queue is full, 503 when shutting down."""
        request = GenerationRequest(
            prepared.prompt_ids, prepared.max_tokens, prepared.sampling, frozenset(self.frontend.stop_ids), prepared.constraint,
            prepared.logprobs, prepared.cache_prompt,
        )
        try:
            handle = self.scheduler.submit(request, asyncio.get_running_loop(), f"{prefix}-{uuid.uuid4().hex[:24]}")
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDownError as exc:
            raise APIError(503, str(exc), code="shutting_down") from None
        decoder = self.frontend.incremental_decoder(skip_special_tokens=True)
        return TextGeneration(handle, decoder, prepared.body.stop_strings())
