"""The FastAPI app over a fake engine (no model): routes, errors, stop strings, capacity,
chat templates, step failures. The real engine behind a real server: test_serve_live.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from rocdraft.errors import RocdraftError  # noqa: E402
from rocdraft.outputs import GenerationStats, RequestOutput  # noqa: E402
from rocdraft.serve.app import ServeSettings, build_app  # noqa: E402
from rocdraft.serve.engine_loop import EngineLoop  # noqa: E402
from rocdraft.serve.metrics import ServerMetrics  # noqa: E402

EOS = 0
REPLY = "Hi wörld 日本 ok"


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 1; 0 is EOS): multi-byte characters always span
    several tokens."""

    chat_template = None
    special_tokens = {}

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")


class FakeEngine:
    """Each request generates REPLY's bytes then EOS, one token per step (two per step when
    ``tokens_per_step`` is 2, as speculation would); ``gate`` cleared holds every step."""

    def __init__(self, tokens_per_step: int = 1, max_model_len: int = 64) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.tokens_per_step = tokens_per_step
        self.stats = GenerationStats(num_speculative_tokens=2)
        self.requests: dict = {}
        self.num_blocks = 10
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next_step = False
        self.aborted: list = []

    num_waiting = 0

    @property
    def num_running(self) -> int:
        return len(self.requests)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.requests)

    def add_request(self, request_id, prompt, params) -> None:
        if request_id in self.requests:
            raise RocdraftError(f"request id {request_id!r} is already in flight")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RocdraftError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise RocdraftError(f"prompt of {len(ids)} tokens does not fit max_model_len "
                                f"{self.max_model_len}")
        self.requests[request_id] = (ids, params, [])

    def abort_request(self, request_id) -> bool:
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device lost")
        script = self.tokenizer.encode(REPLY) + [EOS]
        outputs = []
        for request_id, (ids, params, out) in list(self.requests.items()):
            new, reason = [], None
            for _ in range(self.tokens_per_step):
                token = script[len(out)]
                out.append(token)
                new.append(token)
                if token == EOS or token in params.stop_token_ids:
                    reason = "stop"
                elif len(out) >= params.max_tokens:
                    reason = "length"
                if reason:
                    break
            self.stats.generated_tokens += len(new)
            self.stats.record_verification(2, len(new) - 1)
            if reason:
                del self.requests[request_id]
            outputs.append(RequestOutput(ids, list(out), None, reason, request_id=request_id,
                                         new_token_ids=new, finished=reason is not None,
                                         num_verify_steps=len(out), num_accepted_drafts=0))
        return outputs


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_client(engine=None, **settings):
    engine = engine or FakeEngine()
    loop = EngineLoop(engine)
    loop.metrics = ServerMetrics(lambda: loop.snapshot, "fake")
    base = dict(model_name="fake", max_model_len=engine.max_model_len, max_num_seqs=4)
    app = build_app(loop, ServeSettings(**{**base, **settings}))
    return TestClient(app), engine


@pytest.fixture
def client():
    c, engine = make_client()
    with c:
        c.engine = engine
        yield c


def events(response) -> list:
    items = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            items.append(payload if payload == "[DONE]" else json.loads(payload))
    return items


def test_completion_text_usage_and_acceptance(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6,
                                             "return_token_ids": True})
    assert r.status_code == 200
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == "Hi wö" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == ByteTokenizer().encode(REPLY)[:6]  # "ö" is two tokens
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert body["rocdraft"]["acceptance_length"] == 1.0
    assert body["object"] == "text_completion" and body["model"] == "fake"


def test_streaming_never_splits_a_character_and_ends_with_done(client):
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "ab", "max_tokens": 40, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        items = events(r)
    assert items[-1] == "[DONE]"
    texts = [c["choices"][0]["text"] for c in items[:-2]]
    assert "".join(texts) == REPLY
    assert all("\ufffd" not in t for t in texts)
    assert items[-3]["choices"][0]["finish_reason"] == "stop"
    assert items[-2]["choices"] == [] and items[-2]["usage"]["completion_tokens"] == \
        len(REPLY.encode()) + 1


def test_stop_string_truncates_and_aborts_in_the_engine(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 40, "stop": ["日"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi wörld " and choice["finish_reason"] == "stop"
    assert len(client.engine.aborted) == 1 and not client.engine.requests


def test_stop_string_on_the_last_token_is_finish_reason_stop(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stop": "i"})
    choice = r.json()["choices"][0]
    assert choice["text"] == "H" and choice["finish_reason"] == "stop"
    assert not client.engine.aborted  # the engine had finished it already


def test_stop_string_split_over_chunks_is_never_streamed(client):
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "ab", "max_tokens": 40, "stream": True,
                             "stop": "wör"}) as r:
        items = events(r)
    text = "".join(c["choices"][0]["text"] for c in items[:-1])
    assert text == "Hi " and items[-2]["choices"][0]["finish_reason"] == "stop"


def test_list_of_prompts_gives_one_choice_each(client):
    r = client.post("/v1/completions", json={"prompt": ["a", "bcd"], "max_tokens": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["Hi", "Hi"]
    assert body["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "logprobs": 1}, "logprobs"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x" * 80}, "prompt"),  # does not fit max_model_len 64
    ({"prompt": ""}, "prompt"),
])
def test_bad_requests_are_400_and_the_server_keeps_serving(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).json()[
        "choices"][0]["text"] == "Hi"
    assert not client.engine.requests and client.app.state.capacity.in_flight == 0


def test_invalid_json_unknown_model_and_route(client):
    r = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["fake"] and data[0]["max_model_len"] == 64


def test_api_key():
    c, _ = make_client(api_key="sekret")
    with c:
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        bad = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                    headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key


def test_full_waiting_queue_is_503_and_frees_when_requests_end():
    engine = FakeEngine()
    c, _ = make_client(engine, max_num_seqs=1, max_waiting_requests=1)
    with c:
        engine.gate.clear()  # hold the engine: two requests fill the running and waiting slots
        results = []
        threads = [threading.Thread(target=lambda: results.append(c.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 3}))) for _ in range(2)]
        for t in threads:
            t.start()
        capacity = c.app.state.capacity
        deadline = time.monotonic() + 10
        while capacity.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        engine.gate.set()
        for t in threads:
            t.join(10)
        assert [x.json()["choices"][0]["text"] for x in results] == ["Hi ", "Hi "]
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code \
            == 200


def test_failed_step_is_500_for_its_requests_only(client):
    client.engine.fail_next_step = True
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}
                       ).status_code == 200
    assert client.get("/health").status_code == 200


def test_chat_without_template_is_a_clear_400(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_chat_with_template_renders_and_streams():
    engine = FakeEngine(tokens_per_step=2)
    c, _ = make_client(engine, chat_template=TEMPLATE, special_tokens={"bos_token": "<s>"})
    with c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 4})
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi w"}
        assert body["usage"]["prompt_tokens"] == len("<s><user>hi\n<assistant>")
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True}) as s:
            items = events(s)
        assert items[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(i["choices"][0]["delta"].get("content", "") for i in items[:-1]) == REPLY
        assert items[-2]["choices"][0]["finish_reason"] == "stop"
        assert items[-2]["object"] == "chat.completion.chunk"


def test_metrics_count_requests(client):
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
    text = client.get("/metrics").text
    assert 'rocdraft_requests_total{finish_reason="length",model_name="fake"} 1.0' in text
    assert 'rocdraft_generation_tokens_total{model_name="fake"} 3.0' in text
