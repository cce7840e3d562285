"""A live ``rocdraft serve`` (the built-in pair, real uvicorn on a free port in a thread)
driven by the official ``openai`` client, checked against ``LLM.generate`` token for token;
errors, disconnects, the API key, /metrics, and graceful shutdown of a server process."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from distributed_helpers import live_children  # noqa: E402
from rocdraft.builtin import builtin_paths  # noqa: E402
from rocdraft.config import SamplingParams, SpeculativeConfig  # noqa: E402
from rocdraft.engine import LLM  # noqa: E402
from rocdraft.serve.app import ServeSettings  # noqa: E402
from rocdraft.serve.chat_template import chat_renderer  # noqa: E402
from serve_helpers import start_server as start_in_thread  # noqa: E402

KEY = "test-key"
MODEL = "builtin-chat"
MAX_TOKENS = 16
PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def", "for i in range(10):"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}### {{ m.role }}:\n{{ m.content }}\n"
            "{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
MAX_REQUEST_BYTES = 8 << 20
FIVE_MB_PROMPT = "x = 1\n" * 874000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def target_with_template(tmp_path_factory):
    """The built-in target with a small chat template in its tokenizer_config.json."""
    src = builtin_paths().target
    dst = tmp_path_factory.mktemp("target")
    for name in os.listdir(src):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(src, name), dst / name)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def server(target_with_template):
    """(base url, engine, reference outputs): the engine is an LLM so the references come from
    its own ``generate`` before it starts serving. It runs its target forward and draft loop
    through the graph runners a GPU engine captures (``graph_mode="replay-eagerly"``: the
    same padded static inputs, replayed eagerly here), so every server test below also
    covers requests joining and leaving the runners' buckets; its outputs equal an eager
    engine's (checked here on the first prompts)."""
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, draft_policy="fixed")
    llm = LLM(target_with_template, builtin_paths().eagle3, speculative_config=spec,
              max_model_len=256, max_num_seqs=16, graph_mode="replay-eagerly")
    eager = LLM(target_with_template, builtin_paths().eagle3, speculative_config=spec,
                max_model_len=256, max_num_seqs=16).generate(PROMPTS, GREEDY)
    settings = ServeSettings(model_name=MODEL, max_model_len=llm.max_model_len,
                             max_num_seqs=16, max_waiting_requests=0, api_key=KEY,
                             chat_template=llm.tokenizer.chat_template,
                             special_tokens=llm.tokenizer.special_tokens,
                             max_request_bytes=MAX_REQUEST_BYTES,
                             vocab_size=llm.model_runner.target.config.vocab_size,
                             max_token_bytes=llm.tokenizer.max_token_bytes)
    chat_prompt = chat_renderer(settings)([{"role": "user", "content": "Write a loop."}])
    concurrent = [f"x{i} = {i} *" for i in range(16)]
    refs = llm.generate(PROMPTS + [chat_prompt] + concurrent, GREEDY)
    assert [r.token_ids for r in refs[:len(PROMPTS)]] == [r.token_ids for r in eager]
    assert llm.model_runner.graphs.num_replays > 0
    reference = {"prompts": refs[:len(PROMPTS)], "chat": refs[len(PROMPTS)],
                 "concurrent": refs[len(PROMPTS) + 1:], "concurrent_prompts": concurrent}
    srv, thread, port = start_in_thread(llm, settings, shutdown_timeout=5, log_level="warning")
    yield f"http://127.0.0.1:{port}", llm, reference
    srv.should_exit = True
    thread.join(30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def wait_blocks_free(llm, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (llm.num_free_blocks != llm.num_blocks or llm.has_unfinished_requests()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.num_free_blocks == llm.num_blocks and not llm.has_unfinished_requests()


def start_server(*flags: str, env: dict | None = None,
                 timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """``python -m rocdraft.serve.command`` on a free port with ``flags``, polled until /health
    answers 200 -> (the process, its base url)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rocdraft.serve.command", "--port", str(port),
         "--max-model-len", "128", "--max-num-seqs", "2", "--log-level", "warning", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    return proc, url


def ids_body():
    return {"return_token_ids": True}


def test_completions_equal_generate(server, client):
    _, _, ref = server
    for prompt, expected in zip(PROMPTS, ref["prompts"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=ids_body())
        choice = r.choices[0]
        assert choice.token_ids == expected.token_ids
        assert choice.text == expected.text
        assert r.usage.completion_tokens == len(expected.token_ids)
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert r.rocdraft["acceptance_length"] >= 1.0  # speculation ran


def test_streaming_completion_equals_generate(server, client):
    _, _, ref = server
    expected = ref["prompts"][0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body=ids_body())
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert [t for c in content for t in c.choices[0].token_ids] == expected.token_ids
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].rocdraft["acceptance_length"] >= 1.0


def test_chat_equals_generate_streaming_and_not(server, client):
    _, _, ref = server
    messages = [{"role": "user", "content": "Write a loop."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.choices[0].message.content == ref["chat"].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref["chat"].prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ref["chat"].text


def test_sixteen_concurrent_clients_get_their_own_outputs(server, client):
    _, llm, ref = server

    def one(i):
        prompt = ref["concurrent_prompts"][i]
        if i % 2:
            stream = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=ids_body())
            return [t for c in stream if c.choices for t in c.choices[0].token_ids]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=ids_body())
        return r.choices[0].token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [r.token_ids for r in ref["concurrent"]]
    wait_blocks_free(llm)


def test_error_statuses_and_the_server_keeps_serving(server, client):
    url, llm, ref = server
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="a", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=MODEL, prompt="a", n=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="gpt-9", prompt="a")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(url + "/v1/completions", json={"prompt": "a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/nowhere").json()["error"]["code"] == "not_found"
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body=ids_body())
    assert r.choices[0].token_ids == ref["prompts"][1].token_ids
    wait_blocks_free(llm)


def test_bad_bodies_get_openai_json_4xx(server, client):
    """Deep nesting, a body over the limit, max_tokens past the context, stop ids outside
    the vocabulary, curl's form Content-Type, a 401's WWW-Authenticate."""
    url, llm, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    deep = httpx.post(url + "/v1/completions", headers=headers,
                      content=b'{"prompt": ' + b"[" * 100_000)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    big = httpx.post(url + "/v1/completions", headers=headers,
                     content=b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    for max_tokens in (10**9, 10**30):
        start = time.perf_counter()
        with pytest.raises(openai.BadRequestError, match=f"max_tokens {max_tokens} exceeds "
                                                         f"max_model_len 256") as info:
            client.completions.create(model=MODEL, prompt="def f():", max_tokens=max_tokens)
        assert time.perf_counter() - start < 2.0
        assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match=r"prompt of 250 tokens \+ max_tokens 10 "
                                                     r"exceeds max_model_len 256"):
        client.completions.create(model=MODEL, prompt=[5] * 250, max_tokens=10)
    with pytest.raises(openai.BadRequestError, match=r"stop_token_ids \[999999\] outside"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                  extra_body={"stop_token_ids": [999999]})
    form = httpx.post(url + "/v1/completions", content=json.dumps(
        {"prompt": "a", "max_tokens": 2, "temperature": 0}), headers={
        **headers, "Content-Type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert form.status_code == 200 and form.json()["usage"]["completion_tokens"] == 2
    unauthorized = httpx.get(url + "/v1/models")
    assert unauthorized.status_code == 401
    assert unauthorized.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health").status_code == 200  # open without the key
    wait_blocks_free(llm)


def test_five_megabyte_prompt_is_refused_fast_while_a_stream_runs(server, client):
    """The 5 MB prompt is refused from a bound on its token count, never tokenized on the
    event loop: the running stream's chunks and /health keep their pace (the figures to reach
    are 0.5 s, 0.25 s and 50 ms; the bounds here leave room for a loaded CI machine)."""
    url, llm, _ = server
    gaps, health = [], []
    stream = client.completions.create(model=MODEL, prompt="while True:", max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    done = threading.Event()

    def read_stream():
        last = time.perf_counter()
        for _ in chunks:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        done.set()

    def poll_health():
        while not done.is_set():
            start = time.perf_counter()
            assert httpx.get(url + "/health").status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.02)

    threads = [threading.Thread(target=read_stream), threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError, match="prompt of at least .* tokens does not "
                                                     "fit max_model_len 256"):
        client.completions.create(model=MODEL, prompt=FIVE_MB_PROMPT, max_tokens=4)
    refused = time.perf_counter() - start
    for t in threads:
        t.join(60)
    print(f"5 MB prompt refused in {refused:.3f} s; stream gap max {max(gaps):.3f} s; "
          f"/health max {max(health) * 1000:.1f} ms over {len(health)} probes")
    assert refused < 2.0
    assert max(gaps) < 1.0
    assert max(health) < 0.5
    wait_blocks_free(llm)


def test_full_queue_503_then_disconnects_free_every_block(server, client):
    """16 streams fill max_num_seqs (no waiting allowed): a 17th request gets 503; the
    clients then hang up mid-stream and every KV block comes back."""
    url, llm, ref = server
    generated = llm.stats.generated_tokens
    headers = {"Authorization": f"Bearer {KEY}"}
    http = httpx.Client(base_url=url, headers=headers, timeout=60)
    streams, opened = [], []
    try:
        for i in range(16):
            s = http.stream("POST", "/v1/completions", json={
                "prompt": f"y{i} =", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True})
            response = s.__enter__()
            streams.append(s)
            lines = response.iter_lines()
            opened.append(lines)  # dropping the iterator would close the connection
            while not next(lines).startswith("data: "):
                pass
        assert llm.num_free_blocks < llm.num_blocks
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert info.value.status_code == 503
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        http.close()
    wait_blocks_free(llm)
    assert llm.stats.generated_tokens - generated < 16 * 200  # aborted, not run to the end
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body=ids_body())
    assert r.choices[0].token_ids == ref["prompts"][2].token_ids


def test_openai_stream_closed_mid_way_aborts(server, client):
    _, llm, _ = server
    generated = llm.stats.generated_tokens
    stream = client.completions.create(model=MODEL, prompt="while True:", max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    stream.close()
    wait_blocks_free(llm)
    assert llm.stats.generated_tokens - generated < 200  # aborted, not run to the end


@pytest.mark.parametrize("speculative", [False, True], ids=["target-only", "fixed-chain"])
def test_async_server_streams_the_tokens_of_generate(target_with_template, speculative):
    """An engine with async scheduling (rocdraft/engine/overlap.py: each step launched
    before the previous one lands; target-only decode, or a fixed-policy chain of 3 drafts)
    serves 8 concurrent clients, streaming and not, the synchronous engine's tokens; a
    stream closed mid-way aborts its request while its next step is in flight, and every
    block comes back."""
    kwargs = dict(max_model_len=256, max_num_seqs=8, graph_mode="replay-eagerly")
    if speculative:
        kwargs.update(draft=builtin_paths().eagle3, speculative_config=SpeculativeConfig(
            method="eagle3", num_speculative_tokens=3, draft_policy="fixed"))
    llm = LLM(target_with_template, async_scheduling=True, **kwargs)
    prompts = [f"y{i} = {i} +" for i in range(8)]
    expected = LLM(target_with_template, **kwargs).generate(prompts, GREEDY)
    settings = ServeSettings(model_name=MODEL, max_model_len=llm.max_model_len, max_num_seqs=8,
                             max_waiting_requests=0, api_key=KEY,
                             chat_template=llm.tokenizer.chat_template,
                             special_tokens=llm.tokenizer.special_tokens,
                             max_request_bytes=MAX_REQUEST_BYTES,
                             vocab_size=llm.model_runner.target.config.vocab_size,
                             max_token_bytes=llm.tokenizer.max_token_bytes)
    srv, thread, port = start_in_thread(llm, settings, shutdown_timeout=5, log_level="warning")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    try:
        def one(i):
            if i % 2:
                stream = client.completions.create(model=MODEL, prompt=prompts[i], stream=True,
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body=ids_body())
                return [t for c in stream if c.choices for t in c.choices[0].token_ids]
            r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body=ids_body())
            return r.choices[0].token_ids

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [e.token_ids for e in expected]
        assert llm.overlap.num_overlapped > 0
        if speculative:
            # acceptance length above 1.5: drafts accepted
            assert llm.stats.num_accepted_drafts > 0.5 * llm.stats.num_verify_steps
        stream = client.completions.create(model=MODEL, prompt="while True:", max_tokens=200,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices[0].finish_reason is None
        stream.close()
        wait_blocks_free(llm)
    finally:
        srv.should_exit = True
        thread.join(30)


def test_non_streaming_client_gone_aborts(server):
    url, llm, _ = server
    generated = llm.stats.generated_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", timeout=httpx.Timeout(5, read=0.3),
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "x =", "max_tokens": 200, "ignore_eos": True})
    wait_blocks_free(llm)
    assert llm.stats.generated_tokens - generated < 200


def test_metrics_parse_and_move(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    url = server[0]

    def scrape() -> dict:
        samples = {}
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in family.samples:
                key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())
                                       if k != "model_name")
                samples[key] = s.value
        return samples

    before = scrape()
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                              temperature=0)
    after = scrape()
    assert after["rocdraft_generation_tokens_total"] - \
        before["rocdraft_generation_tokens_total"] == MAX_TOKENS
    assert after["rocdraft_requests_total,finish_reason=length"] == \
        before["rocdraft_requests_total,finish_reason=length"] + 1
    assert after["rocdraft_time_to_first_token_seconds_count"] > \
        before["rocdraft_time_to_first_token_seconds_count"]
    assert after["rocdraft_verify_steps_total"] > before["rocdraft_verify_steps_total"]
    assert after["rocdraft_draft_tokens_proposed_at_position_total,position=0"] > 0
    assert after["rocdraft_kv_blocks_used"] == 0
    assert after["rocdraft_kv_blocks_free"] == server[1].num_blocks


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_finishes_in_flight_and_exits_0(sig):
    proc, url = start_server(env={**os.environ, "ROCDRAFT_API_KEY": KEY})
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(url + "/v1/completions", json={"prompt": "a"}).status_code == 401
        lines = []
        with httpx.stream("POST", url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": "def f(x):", "max_tokens": 48, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as response:
            it = response.iter_lines()
            lines.append(next(it))
            proc.send_signal(sig)  # in flight: it is finished, not cut off
            lines.extend(it)
        data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split(":", 1)[1]
                           for line in f)
    except OSError:
        return False


def test_tensor_parallel_server_equals_generate_and_leaves_no_workers():
    """``rocdraft serve --tensor-parallel-size 2`` (gloo): the openai client gets LLM.generate's
    greedy tokens (TP 1, speculative), and SIGTERM stops the server and its worker."""
    prompt = PROMPTS[0]
    llm = LLM(builtin_paths().target, builtin_paths().eagle3,
              speculative_config=SpeculativeConfig(method="eagle3", num_speculative_tokens=3,
                                                   draft_policy="fixed"),
              max_model_len=128, max_num_seqs=2)
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))[0]
    del llm
    proc, url = start_server("--tensor-parallel-size", "2", "--api-key", KEY,
                             "--served-model-name", "tp", timeout_s=180)
    try:
        workers = live_children(proc.pid)
        assert workers, "the TP 2 server started no worker process"
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = client.completions.create(model="tp", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        assert r.choices[0].token_ids == expected.token_ids
        assert r.rocdraft["acceptance_length"] > 1.5  # drafts were accepted under TP
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "worker processes outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sse_lines(response) -> list[str]:
    return [x for x in response.iter_lines() if x.startswith("data: ")]


def test_shutdown_timeout_ends_cut_streams_with_a_final_chunk():
    """SIGTERM with --shutdown-timeout 1 and streams that need longer: each ends with a chunk
    whose finish_reason is "abort", an error event and [DONE]; a waiting non-streaming request
    gets a JSON 503; the log has one line per aborted request and no traceback; exit 0."""
    proc, url = start_server("--shutdown-timeout", "1", "--max-model-len", "1024",
                             "--log-level", "info")
    body = {"prompt": "def f(x):", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    results = {}

    def stream(i):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={**body, "stream": True}) as response:
            results[i] = sse_lines(response)

    def plain():
        results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads.append(threading.Thread(target=plain))  # waits: --max-num-seqs 2
        for t in threads:
            t.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for i in range(2):
        data = results[i]
        assert data[-1] == "data: [DONE]"
        error = json.loads(data[-2][6:])["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout 1 s" in \
            error["message"]
        assert json.loads(data[-3][6:])["choices"][0]["finish_reason"] == "abort"
    plain = results["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in log and "CancelledError" not in log
    assert log.count("aborted after") == 3, log


def test_tensor_parallel_worker_killed_health_503_then_exit_1():
    """A TP 2 server whose worker is SIGKILLed mid-stream: the stream gets its error event and
    [DONE], /health turns 503 naming the worker within a second, new requests get 503 (not
    500), and the server exits with status 1."""
    proc, url = start_server("--tensor-parallel-size", "2", "--max-model-len", "1024",
                             timeout_s=180)
    try:
        (worker,) = live_children(proc.pid)
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": "def f(x):", "max_tokens": 900, "temperature": 0,
                "ignore_eos": True, "stream": True}) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert "rank 1 exit code -9 (SIGKILL)" in json.loads(data[-2][6:])["error"]["message"]
        try:  # the server may already have closed its socket on the way out
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
        except httpx.TransportError:
            pass
        assert proc.wait(timeout=60) == 1
        print(f"server exited 1, {time.monotonic() - killed:.2f} s after the kill")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tensor_parallel_worker_killed_while_idle():
    """No request runs: the worker's death turns /health 503 within a second all the same;
    with --no-exit-on-engine-death the server stays up, answering 503 (not 500)."""
    proc, url = start_server("--tensor-parallel-size", "2", "--no-exit-on-engine-death",
                             timeout_s=180)
    try:
        (worker,) = live_children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed < 1.0, "/health still 200 a second later"
            time.sleep(0.01)
        print(f"/health 503 {time.monotonic() - killed:.3f} s after the kill")
        health = httpx.get(url + "/health", timeout=5).json()["error"]["message"]
        assert health == ("the engine is dead: tensor-parallel worker(s) died: rank 1 exit "
                          "code -9 (SIGKILL)")
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and "SIGKILL" in r.json()["error"]["message"]
        time.sleep(1.0)
        assert proc.poll() is None  # kept up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1  # it did die: a supervisor should know
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
