"""`POST /v1/responses` (OpenAI Responses API, stateless): the conversation (`serve.conversation`)
with output items `reasoning`, `message` and `function_call`, whole or as the documented event stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.serve.body import decode_json, refuse_long_list, validate
from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.conversation import BlockEvent, PreparedChat, prepare_chat, reply_blocks, whole_reply
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.responses_request import NAMES, FunctionChoice, ResponsesRequest, to_chat
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect


def _prepare(ctx: ServeContext, raw: bytes) -> tuple[ResponsesRequest, PreparedChat]:
    data = decode_json(raw)
    refuse_long_list(data, "input", ctx.max_context)
    refuse_long_list(data, "tools", ctx.max_context)
    body = validate(data, ResponsesRequest, required_first=("model", "input"))
    return body, prepare_chat(ctx, to_chat(body), NAMES)


async def create_response(ctx: ServeContext, request: Request) -> Response:
    body, chat = await ctx.off_loop(_prepare, ctx, await request.body())
    generation = ctx.start("resp", chat.request)
    response = _Response(ctx, body, generation)
    if body.stream:
        return event_stream(_events(response, chat, generation), generation, response.failure, done=None)
    return await until_disconnect(request, generation, _complete(response, chat, generation))


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(call: dict, status: str) -> dict:
    function = call["function"]
    return {
        "type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": function["name"], "arguments": function["arguments"],
        "status": status,
    }


class _Response:
    """The response object of one request, as it stands (`status`, `output`, `usage`), and its stream's events."""

    def __init__(self, ctx: ServeContext, body: ResponsesRequest, generation: TextGeneration) -> None:
        self.generation = generation
        self.sequence = 0
        self.fields = {
            "id": generation.handle.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": ctx.model_name,
            "instructions": body.instructions,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "text": {"format": body.text.format.model_dump(by_alias=True) if body.text and body.text.format else {"type": "text"}},
            "previous_response_id": None,
            "store": False,
            "metadata": {},
        }

    def snapshot(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if status in ("completed", "incomplete"):
            used = self.generation.usage()
            usage = {
                "input_tokens": used["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": used["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": used["total_tokens"],
            }
        return {**self.fields, "status": status, "incomplete_details": incomplete, "error": error, "output": output, "usage": usage}

    def final_status(self) -> str:
        return "incomplete" if self.generation.finish_reason == "length" else "completed"

    def event(self, kind: str, **fields) -> str:
        """One stream event of type `kind`, numbered."""
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, event=kind)

    def failure(self, error: APIError) -> str:
        return self.event("error", code=error.code, message=error.message, param=error.param)


async def _complete(response: _Response, chat: PreparedChat, generation: TextGeneration) -> JSONResponse:
    reply = await whole_reply(chat, generation)
    status = response.final_status()
    output = []
    if reply.reasoning:
        output.append(_reasoning_item(_item_id("rs"), reply.reasoning, status))
    if reply.content:
        output.append(_message_item(_item_id("msg"), reply.content, status))
    output += [_call_item(call, "completed") for call in reply.calls]
    return JSONResponse(response.snapshot(status, output))


async def _events(response: _Response, chat: PreparedChat, generation: TextGeneration) -> AsyncIterator[str]:
    """response.created and .in_progress; per output item: output_item.added (and content_part.added),
    its deltas, then its .done events; at the end response.completed (or .incomplete when the token
    limit cut the reply)."""
    output: list[dict] = []
    ids: dict[int, str] = {}

    def events(block: BlockEvent) -> list[str]:
        where = {"output_index": block.index}
        if block.kind == "tool_call":
            item = _call_item(block.value, "completed")
            if block.event == "start":
                ids[block.index] = item["id"]
                return [response.event("response.output_item.added", **where, item={**item, "arguments": "", "status": "in_progress"})]
            item["id"] = ids[block.index]
            output.append(item)
            at = {"item_id": item["id"], **where}
            return [
                response.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                response.event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]),
                response.event("response.output_item.done", **where, item=item),
            ]
        reasoning = block.kind == "reasoning"
        build, text_kind = (_reasoning_item, "reasoning_text") if reasoning else (_message_item, "output_text")
        logprobs = {} if reasoning else {"logprobs": []}
        if block.event == "start":
            ids[block.index] = _item_id("rs" if reasoning else "msg")
            item = build(ids[block.index], "", "in_progress")
            at = {"item_id": item["id"], **where, "content_index": 0}
            return [
                response.event("response.output_item.added", **where, item={**item, "content": []}),
                response.event("response.content_part.added", **at, part=item["content"][0]),
            ]
        at = {"item_id": ids[block.index], **where, "content_index": 0}
        if block.event == "delta":
            return [response.event(f"response.{text_kind}.delta", **at, delta=block.value, **logprobs)]
        item = build(ids[block.index], block.value, response.final_status() if generation.finish_reason else "completed")
        output.append(item)
        return [
            response.event(f"response.{text_kind}.done", **at, text=block.value, **logprobs),
            response.event("response.content_part.done", **at, part=item["content"][0]),
            response.event("response.output_item.done", **where, item=item),
        ]

    yield response.event("response.created", response=response.snapshot("in_progress", []))
    yield response.event("response.in_progress", response=response.snapshot("in_progress", []))
    async for block in reply_blocks(chat, generation):
        for event in events(block):
            yield event
    status = response.final_status()
    yield response.event(f"response.{status}", response=response.snapshot(status, output))
