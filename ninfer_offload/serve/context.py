"""What every route needs: the model's name and limits, sampling defaults, request submission."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.sampling import SamplingParams, sampling_from_config
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.protocol import SamplingFields
from ninfer_offload.serve.scheduler import GenerationRequest, QueueFullError, Scheduler


@dataclass
class ServeContext:
    """The engine's frontend and scheduler plus the server's naming and context limit."""

    frontend: Any
    scheduler: Scheduler
    model_name: str
    max_context: int

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404, f"The model '{name}' does not exist; this server serves '{self.model_name}'", param="model", code="model_not_found"
            )

    def sampling(self, body: SamplingFields) -> SamplingParams:
        """Request values, else the model's generation_config.json defaults, else OpenAI's."""
        return sampling_from_config(
            self.frontend.generation_config,
            temperature=body.temperature,
            top_k=None if body.top_k is None else max(body.top_k, 0),  # -1 (vLLM) disables top-k
            top_p=body.top_p,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
        )

    def token_budget(self, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """`max_tokens` checked against the context (vLLM's rule); None means all the room left."""
        if prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
        room = self.max_context - prompt_tokens
        if room <= 0 or (requested is not None and requested > room):
            asked = prompt_tokens + (requested or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{asked} tokens ({prompt_tokens} in the prompt, {requested or 0} for the completion). "
                "Please shorten the prompt or lower max_tokens.",
                param=prompt_param if room <= 0 else "max_tokens",
                code="context_length_exceeded",
            )
        return requested if requested is not None else room

    def start(self, prefix: str, prompt_ids: list[int], body: SamplingFields, max_tokens: int) -> TextGeneration:
        """Queue the request on the engine thread; 429 when the queue is full."""
        try:
            sampling = self.sampling(body)
        except NinferError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        request = GenerationRequest(prompt_ids, max_tokens, sampling, frozenset(self.frontend.stop_ids))
        try:
            handle = self.scheduler.submit(request, asyncio.get_running_loop(), f"{prefix}-{uuid.uuid4().hex[:24]}")
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        return TextGeneration(handle, self.frontend.incremental_decoder(skip_special_tokens=True), body.stop_strings())
