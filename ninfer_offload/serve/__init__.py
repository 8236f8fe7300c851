"""OpenAI- and Anthropic-compatible HTTP server (`ninfer serve`).

app.py          FastAPI app: routes, middleware order, scheduler and worker lifetime (`create_app`)
server.py       uvicorn with a bounded graceful shutdown (requests ended at the deadline, exit 0)
guards.py       Host header (DNS rebinding), API key, body size, checked before any route runs
scheduler.py    the engine thread: queue, chunked prefill interleaved with batched decode
context.py      per-request preparation: worker thread, model name, sampling checks, prompt size, submission
body.py         request bodies: JSON with limits (lone surrogates, nesting, list sizes), validation
conversation.py the conversation every chat-like route shares: template, limits, grammar, reply split
chat.py         /v1/chat/completions (OpenAI chat format)
responses.py    /v1/responses (OpenAI Responses, stateless); responses_request.py its body -> a chat request
messages.py     /v1/messages, /v1/messages/count_tokens (Anthropic); messages_request.py its body -> a chat request
completions.py  /v1/completions (raw prompt)
generation.py   tokens -> text deltas with stop strings, usage, one log line per request
reasoning.py    qwen3-style `</think>` split, one parser for whole and streamed replies
tool_calls.py   Qwen3 XML tool calls -> OpenAI tool_calls, whole and streamed
stops.py        stop strings over streamed text
sse.py          server-sent events, the last error chunk, disconnect handling
protocol.py     request bodies (pydantic)
errors.py       error JSON (OpenAI's, Anthropic's under /v1/messages), handlers, and the last-resort JSON 500
"""
