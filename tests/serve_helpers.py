"""Test utility: a ``rocdraft serve`` server (rocdraft/serve/command.py ``make_server``) over
an engine built in the test, running in a daemon thread on a real port."""
from __future__ import annotations

import threading
import time

from rocdraft.bench.serve_bench import free_port
from rocdraft.serve.command import make_server


def start_server(engine, settings, timeout_s: float = 30, **options):
    """Start serving ``engine`` with ``settings`` on a free port -> (server, thread, port)
    once it accepts connections; ``options`` go to ``make_server`` (shutdown_timeout,
    log_level, ...). Stop it with ``server.should_exit = True`` and ``thread.join``."""
    port = free_port()
    server = make_server(engine, settings, "127.0.0.1", port, **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, f"the server did not start within {timeout_s} s"
    return server, thread, port
