"""OpenAI-compatible HTTP server (`ninfer serve`).

app.py          FastAPI app: routes, middleware order, scheduler and worker lifetime (`create_app`)
server.py       uvicorn with a bounded graceful shutdown (requests ended at the deadline, exit 0)
guards.py       Host header (DNS rebinding), API key, body size, checked before any route runs
scheduler.py    the engine thread: queue, chunked prefill interleaved with batched decode
context.py      per-request preparation: worker thread, model name, sampling checks, prompt size, submission
body.py         request bodies: JSON with limits (lone surrogates, nesting, list sizes), validation
chat.py         /v1/chat/completions (template, reasoning split, tool calls)
completions.py  /v1/completions (raw prompt)
generation.py   tokens -> text deltas with stop strings, usage, one log line per request
reasoning.py    qwen3-style `</think>` split, one parser for whole and streamed replies
tool_calls.py   Qwen3 XML tool calls -> OpenAI tool_calls, whole and streamed
stops.py        stop strings over streamed text
sse.py          server-sent events, the last error chunk, disconnect handling
protocol.py     request bodies (pydantic)
errors.py       OpenAI error JSON, handlers, and the last-resort JSON 500
"""
