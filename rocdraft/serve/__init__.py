"""``rocdraft serve``: an OpenAI-compatible HTTP server over the incremental ``LLMEngine``.

    protocol.py      request bodies -> SamplingParams (400 naming the bad value), response JSON
    admission.py     prompts -> token ids that fit the context (a worker thread); early refusal
    guard.py         ASGI middleware: body limit (413), JSON catch-all 500, one-line logs
    chat_template.py the model's Jinja2 chat template
    detokenize.py    incremental text that never splits a multi-byte character; stop strings
    engine_loop.py   the one thread that drives the engine; handlers enqueue and await; health
    streams.py       one HTTP request's engine requests -> a JSON body or SSE chunks
    metrics.py       /metrics (prometheus_client)
    app.py           the FastAPI app and its routes
    command.py       the ``serve`` subcommand (flags, uvicorn, graceful shutdown, exit status)

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client, jinja2); importing this package
imports none of them.
"""
