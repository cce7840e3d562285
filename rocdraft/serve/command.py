"""``rocdraft serve``: the OpenAI-compatible server's flags and its run.

    add_serve_args(parser)   the shared model flags (rocdraft.entrypoints.cli_options) + the server's own
    run_serve(args) -> int   load the engine, serve until SIGINT/SIGTERM (exit 0) or until
                             the engine dies (exit 1)

Shutdown: on SIGINT or SIGTERM uvicorn stops accepting connections and waits up to
``--shutdown-timeout`` seconds for in-flight responses to finish; then the engine loop aborts
whatever is left (freeing its KV blocks): a cut stream gets a last chunk with finish_reason
"abort", an error event and ``[DONE]``, a waiting non-streaming client a 503; the log holds
one line per aborted request. uvicorn cancels what still runs ``ABORT_GRACE_S`` later (a
client that stopped reading), and the process exits 0. (uvicorn's own handler re-raises the
signal after shutting down, which would end the process with the signal instead.)

Engine death (its loop raised, or a tensor-parallel worker died, noticed at once by the
worker's process sentinel): /health answers 503 with the reason, requests get 503, the
streams in flight get their error event, and the server shuts down with exit status 1 so a
supervisor (systemd, Kubernetes) restarts it. ``--no-exit-on-engine-death`` keeps the dead
server up (answering 503) for debugging.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

API_KEY_ENV = "ROCDRAFT_API_KEY"
BUILTIN_MODEL_NAME = "rocdraft-builtin"
ABORT_GRACE_S = 5.0  # after the abort at --shutdown-timeout, for the last chunks to go out
ENGINE_DEAD_EXIT_CODE = 1


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from rocdraft.entrypoints.cli_options import add_model_args

    add_model_args(p)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                     "127.0.0.1; 0.0.0.0 for every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help=f"the model name clients send and /v1/models lists (default: the "
                          f"--target directory's name, {BUILTIN_MODEL_NAME} for the built-in "
                          f"pair)")
    srv.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1/* (default: the "
                          f"{API_KEY_ENV} environment variable; unset: no key)")
    srv.add_argument("--max-waiting-requests", type=int, default=None,
                     help="requests that may wait beyond the --max-num-seqs running ones; "
                          "more get 503 (default: no limit)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may run after SIGINT/SIGTERM before "
                          "they are aborted (default 30)")
    srv.add_argument("--max-request-bytes", type=int, default=None,
                     help="largest request body in bytes; larger ones get 413 before they are "
                          "read (default 4 MiB)")
    srv.add_argument("--no-exit-on-engine-death", action="store_true",
                     help="keep serving (every request 503, /health 503 with the reason) "
                          "after the engine died, instead of exiting with status 1")
    srv.add_argument("--log-level", default="info",
                     choices=("critical", "error", "warning", "info", "debug"))


def settings_from(args, engine):
    """ServeSettings for ``engine`` from the flags (the API key falls back to the env var)."""
    from rocdraft.errors import RocdraftError
    from rocdraft.serve.app import DEFAULT_MAX_REQUEST_BYTES, ServeSettings

    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise RocdraftError(f"--max-waiting-requests must be >= 0, got "
                            f"{args.max_waiting_requests}")
    max_request_bytes = getattr(args, "max_request_bytes", None) or DEFAULT_MAX_REQUEST_BYTES
    if getattr(args, "max_request_bytes", None) is not None and args.max_request_bytes < 1:
        raise RocdraftError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    name = args.served_model_name or (Path(args.target).resolve().name if args.target
                                      else BUILTIN_MODEL_NAME)
    tokenizer = engine.tokenizer
    return ServeSettings(
        model_name=name, max_model_len=engine.max_model_len,
        max_num_seqs=engine.scheduler_config.max_num_seqs,
        max_waiting_requests=args.max_waiting_requests, api_key=api_key,
        chat_template=getattr(tokenizer, "chat_template", None),
        special_tokens=dict(getattr(tokenizer, "special_tokens", None) or {}),
        max_request_bytes=max_request_bytes, vocab_size=engine.model_config.vocab_size,
        max_token_bytes=getattr(tokenizer, "max_token_bytes", None))


def make_server(engine, settings, host: str, port: int, shutdown_timeout: float = 30.0,
                log_level: str = "info", exit_on_engine_death: bool = True):
    """A uvicorn server (not started) for ``engine``: ``server.run()`` serves until
    SIGINT/SIGTERM (main thread), ``server.should_exit = True`` or (``exit_on_engine_death``)
    the engine's death; ``server.exit_code`` is then 0, or 1 after the engine died."""
    import uvicorn

    from rocdraft.serve.app import build_app
    from rocdraft.serve.engine_loop import EngineLoop
    from rocdraft.serve.metrics import ServerMetrics

    loop = EngineLoop(engine)
    loop.metrics = ServerMetrics(lambda: loop.snapshot, settings.model_name)
    log = logging.getLogger(__name__)

    def on_engine_dead(reason: str) -> None:
        server.exit_code = ENGINE_DEAD_EXIT_CODE
        if exit_on_engine_death:
            log.error("%s; shutting down (exit status %d; --no-exit-on-engine-death keeps "
                      "the server up)", reason, ENGINE_DEAD_EXIT_CODE)
            server.should_exit = True
        else:
            log.error("%s; every request gets 503 (--no-exit-on-engine-death)", reason)

    app = build_app(loop, settings, on_engine_dead)

    class Server(uvicorn.Server):
        exit_code = 0

        async def shutdown(self, sockets=None):
            """Abort what still runs at ``shutdown_timeout``, so every stream ends with its
            final chunk before uvicorn's own timeout (``ABORT_GRACE_S`` later) cancels it."""
            timer = asyncio.get_running_loop().call_later(
                shutdown_timeout, loop.abort_all, f"the server is shutting down: "
                f"--shutdown-timeout {shutdown_timeout:g} s ran out")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            signals = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + ABORT_GRACE_S,
                            lifespan="on")
    server = Server(config)
    server.engine_loop = loop
    return server


def run_serve(args) -> int:
    from rocdraft.entrypoints.cli_options import make_engine, prepare_environment

    prepare_environment()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: "
                                                             "%(message)s")
    engine, method = make_engine(args)
    try:  # close() stops tensor-parallel workers, whatever ends the server
        engine.measure_step_costs()  # the draft policy's costs, before any request waits
        settings = settings_from(args, engine)
        print(f"rocdraft serve: {settings.model_name} (method {method}) on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        server = make_server(engine, settings, args.host, args.port, args.shutdown_timeout,
                             args.log_level, not args.no_exit_on_engine_death)
        server.run()
    finally:
        engine.close()
    if not server.started:  # e.g. the port was taken (uvicorn logged why)
        return 1
    return server.exit_code


def main(argv: list[str] | None = None) -> int:
    """``python -m rocdraft.serve.command`` (what ``rocdraft serve`` runs)."""
    from rocdraft.entrypoints.cli_options import CliParser
    from rocdraft.errors import RocdraftError

    parser = CliParser(prog="rocdraft serve")
    add_serve_args(parser)
    try:
        return run_serve(parser.parse_args(argv))
    except RocdraftError as exc:
        print(f"rocdraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
