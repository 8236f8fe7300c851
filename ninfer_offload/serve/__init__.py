"""OpenAI-compatible HTTP server (`ninfer serve`).

app.py          FastAPI app: routes, API key, body limit, scheduler lifetime (`create_app`)
scheduler.py    the engine thread: queue, chunked prefill interleaved with batched decode
context.py      per-request preparation: model name, sampling defaults, context budget
chat.py         /v1/chat/completions (template, reasoning split, tool calls)
completions.py  /v1/completions (raw prompt)
generation.py   tokens -> text deltas with stop strings, usage, one log line per request
reasoning.py    qwen3-style `</think>` split, whole and streamed
tool_calls.py   Qwen3 XML tool calls -> OpenAI tool_calls, whole and streamed
stops.py        stop strings over streamed text
sse.py          server-sent events, disconnect handling
protocol.py     request bodies (pydantic)
errors.py       OpenAI error JSON and handlers
"""
