"""``rocdraft serve``: an OpenAI-compatible HTTP server over the incremental ``LLMEngine``.

    protocol.py     request bodies -> SamplingParams (400 naming the bad value), response JSON
    detokenize.py   incremental text that never splits a multi-byte character; stop strings
    engine_loop.py  the one thread that drives the engine; handlers enqueue and await
    metrics.py      /metrics (prometheus_client)
    app.py          the FastAPI app and its routes
    command.py      the ``serve`` subcommand (flags, uvicorn, graceful shutdown)

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client, jinja2); importing this package
imports none of them.
"""
