"""scripts/soak_serve.py, briefly: 15 s of mixed streaming/non-streaming load with disconnects
and bad bodies against a real server (the built-in pair, uvicorn on a free port in this
process); no error, the server idle afterwards, RSS flat. The minutes-long run and its figures:
docs/serving.md."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import soak_serve  # noqa: E402

from rocdraft.builtin import builtin_paths  # noqa: E402
from rocdraft.config import SpeculativeConfig  # noqa: E402
from rocdraft.engine import LLMEngine  # noqa: E402
from rocdraft.serve.app import ServeSettings  # noqa: E402
from serve_helpers import start_server  # noqa: E402


@pytest.fixture(scope="module")
def url():
    engine = LLMEngine(builtin_paths().target, builtin_paths().eagle3,
                       speculative_config=SpeculativeConfig(method="eagle3",
                                                            num_speculative_tokens=3),
                       max_model_len=256, max_num_seqs=8)
    settings = ServeSettings(model_name="soak", max_model_len=engine.max_model_len,
                             max_num_seqs=8, vocab_size=engine.model_runner.target.config.vocab_size,
                             max_token_bytes=engine.tokenizer.max_token_bytes)
    server, thread, port = start_server(engine, settings, timeout_s=60, log_level="error")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
    engine.close()


def test_a_short_soak_leaves_the_server_idle_with_flat_rss(url, capsys):
    rc = soak_serve.main(["--minutes", "0.25", "--concurrency", "4", "--url", url,
                          "--pid", str(os.getpid()), "--max-tokens", "24"])
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == 0, report["first_errors"]
    assert report["idle_after_s"] is not None and report["rss_flat"]
    assert sum(report["requests"].values()) > 20
    assert rc == 0


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        soak_serve.parse_args(["--minutes", "0"])
    with pytest.raises(SystemExit):
        soak_serve.parse_args(["--url", "http://x"])
    assert "--url and --pid go together" in capsys.readouterr().err
