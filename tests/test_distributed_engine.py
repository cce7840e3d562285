"""The tensor-parallel engine (rocdraft/distributed/executor.py, worker.py, proxy.py through
LLM(tensor_parallel_size=N)) on real spawned gloo processes: greedy and seeded tokens equal
TP 1 token for token (Llama, Qwen2 with biases and a padded vocabulary, Mistral-style;
target-only and speculative with EAGLE-1 and EAGLE-3 heads, drafts accepted; a ragged batch
with preemption; TP 4 with replicated KV heads), refusals before any worker starts, a worker
killed mid-generation, clean shutdown (no child process left), the CLI.
"""
from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from checkpoints import (write_cyclic_eagle1_head, write_cyclic_eagle3_head, write_cyclic_llama,
                         write_tiny_llama)
from distributed_helpers import live_children, make_mistral
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.distributed import messages as msg
from rocdraft.drafter.graphs import capture_buckets
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
FAST_BACKEND = "CPU_ATTN"
SEEDED = [SamplingParams(temperature=0.9, top_k=50, max_tokens=8, seed=s, ignore_eos=True)
          for s in (11, 12, 13, 14)]


def assert_no_children() -> None:
    assert multiprocessing.active_children() == []
    assert live_children(os.getpid()) == []


def _llm(*args, **kwargs) -> LLM:
    """An LLM on the CPU's fastest backend (the backend matrix runs in
    test_speculative_tp2_equals_tp1 only: Triton's interpreter over several ranks is slow)."""
    return LLM(*args, **{"attention_backend": FAST_BACKEND, **kwargs})


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    target = write_cyclic_llama(root / "target")
    return {"target": str(target),
            "eagle": str(write_cyclic_eagle1_head(root / "eagle1", target, fmt="bin")),
            "eagle3": str(write_cyclic_eagle3_head(root / "eagle3", target))}


@pytest.fixture(scope="module")
def reference(pair):
    llm = LLM(pair["target"])
    return {"greedy": _tokens(llm.generate(PROMPTS, GREEDY)),
            "seeded": _tokens(llm.generate(PROMPTS, SEEDED))}


def _spec(method: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method, k, draft_policy="fixed")


def _record_ops(monkeypatch) -> list[int]:
    """The op code of every message rank 0 broadcasts from now on."""
    ops, encode = [], msg.encode
    monkeypatch.setattr(msg, "encode", lambda op, *a, **k: ops.append(op) or encode(op, *a, **k))
    return ops


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_speculative_tp2_equals_tp1(pair, reference, method, monkeypatch):
    """The head runs on rank 0 alone over whole vocabulary tables: only the target's calls
    are broadcast (forward + logits per step), so the draft loop holds no collective. The
    engine decides capture as at TP 1 (on a GPU it captures; here it says "no GPU"), and the
    draft-loop runner the engine builds on a GPU, replaying its static buffers eagerly here,
    runs under TP with the same tokens and without a message."""
    with LLM(pair["target"], pair[method], _spec(method), tensor_parallel_size=2,
             max_num_seqs=4, graph_mode="replay-eagerly") as llm:
        assert llm.draft_runner.graph_refusal == LLM(pair["target"], pair[method],
                                                     _spec(method)).draft_runner.graph_refusal
        runner = llm.draft_runner.proposer.graph_runner
        assert runner.buckets == capture_buckets(4) and not runner.use_graphs
        ops = _record_ops(monkeypatch)
        runs, run = [], runner.run
        monkeypatch.setattr(runner, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
        assert llm.last_stats.acceptance_length > 1.5  # drafts were accepted
        steps = llm.last_stats.num_steps
        assert runs and set(ops) <= {msg.TARGET_FORWARD, msg.TARGET_LOGITS, msg.NOP}
        assert ops.count(msg.TARGET_FORWARD) == ops.count(msg.TARGET_LOGITS) == steps
        # Seeded sampling is per output position, so speculative == target-only here too.
        assert _tokens(llm.generate(PROMPTS, SEEDED)) == reference["seeded"]
        assert llm.model_runner.executor.broadcast_bytes > 0 and llm.model_runner.executor.counter.all_reduce_calls > 0
        pids = llm.model_runner.executor.worker_pids
    assert_no_children()
    assert len(pids) == 1 and llm.model_runner.executor.worker_exit_codes == [0]


def test_a_bfloat16_head_under_tp2_equals_tp1(pair, reference):
    """draft_dtype under TP: the head (EAGLE-1, whose logits come from the target's lm_head)
    runs in bfloat16 on rank 0 over float32 whole vocabulary tables, cast at its edges; the
    sharded target stays float32, and the tokens are TP 1 target-only's."""
    spec = SpeculativeConfig("eagle", 3, draft_policy="fixed", draft_dtype="bfloat16")
    with _llm(pair["target"], pair["eagle"], spec, tensor_parallel_size=2,
              max_num_seqs=4) as llm:
        head = llm.draft_runner.head
        assert head.fc.weight.dtype == torch.bfloat16
        assert head.lm_head.weight.dtype == head.embed_tokens.weight.dtype == torch.float32
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
        assert llm.last_stats.acceptance_length > 1.5
        assert _tokens(llm.generate(PROMPTS, SEEDED)) == reference["seeded"]
    assert_no_children()


@pytest.mark.parametrize("tree", [dict(speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0)]"),
                                  dict(tree_depth=3, tree_top_k=2, tree_total_tokens=6)],
                         ids=["static", "dynamic"])
def test_tree_speculation_tp2_equals_tp1(pair, reference, tree, monkeypatch):
    """Tree steps under TP: the tree-masked verify and the head's levels go through the
    proxies, and every rank compacts its own KV heads (TARGET_COMPACT); without the
    compaction message the workers' caches go stale and the tokens differ."""
    with _llm(pair["target"], pair["eagle3"], SpeculativeConfig("eagle3", **tree,
                                                                draft_policy="fixed"),
              tensor_parallel_size=2, max_num_seqs=4, graph_mode="replay-eagerly") as llm:
        runner = llm.draft_runner.proposer.tree_runner  # the runner a GPU engine builds
        runs, run = [], runner.run
        monkeypatch.setattr(runner, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
        assert llm.last_stats.acceptance_length > 1.5
        assert runs  # the tree levels ran through the tree runner under TP
    assert_no_children()


def test_ragged_batch_with_preemption_tp2(pair, reference):
    with _llm(pair["target"], pair["eagle3"], _spec("eagle3", 4), tensor_parallel_size=2,
             block_size=4, num_kv_blocks=20, max_model_len=64) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.last_stats.num_preemptions > 0
        assert llm.last_stats.acceptance_length > 1.5
        assert _tokens(outs) == reference["greedy"]
    assert_no_children()


def test_tp4_replicated_kv_heads(pair, reference):
    """4 query heads, 2 KV heads: each of the 4 ranks holds one replicated KV head."""
    with _llm(pair["target"], pair["eagle"], _spec("eagle"), tensor_parallel_size=4) as llm:
        assert llm.model_runner.target.kv_cache_spec()[1] == 1
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
        assert llm.last_stats.acceptance_length > 1.5
    assert_no_children()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_target_only_tp2_equals_tp1(kind, tmp_path):
    if kind == "qwen2":  # q/k/v biases; 161 rows: the vocabulary pads to 81 per rank
        path = write_tiny_llama(tmp_path / kind, kind="qwen2", seed=1, vocab_size=161,
                                tokenizer=False)
    else:
        path = write_tiny_llama(tmp_path / kind, kind="llama", seed=2, tokenizer=False)
        if kind == "mistral":
            make_mistral(path)
    expected = _tokens(_llm(str(path)).generate(PROMPTS, GREEDY))
    with _llm(str(path), tensor_parallel_size=2) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert_no_children()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not divide num_attention_heads 4"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(tensor_parallel_size=2, distributed_backend="nccl"), "nccl needs GPUs"),
    (dict(tensor_parallel_size=2, distributed_backend="mpi"), "unknown distributed backend"),
])
def test_refusals_before_any_worker_starts(pair, kwargs, message):
    with pytest.raises(RocdraftError, match=message):
        _llm(pair["target"], **kwargs)
    assert_no_children()


def test_more_ranks_than_visible_gpus_is_refused(pair, monkeypatch):
    from rocdraft.distributed.engine_setup import start_tensor_parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RocdraftError, match="tensor_parallel_size 2 is larger than the 1 "
                                            "visible GPU"):
        start_tensor_parallel(pair["target"], 2, None, "cuda", 60.0)
    assert_no_children()


def test_idle_keepalive_then_worker_killed_mid_generate(pair):
    """An engine idle for longer than the collective timeout still works (keep-alive NOPs);
    a worker SIGKILLed mid-generation makes generate raise within seconds, naming the rank and
    its exit code, and leaves no process behind."""
    llm = _llm(pair["target"], pair["eagle3"], _spec("eagle3"), tensor_parallel_size=2,
              distributed_timeout_s=2.0)
    time.sleep(2.5)
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 10
    (pid,) = llm.model_runner.executor.worker_pids
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    start = time.monotonic()
    killer.start()
    with pytest.raises(RocdraftError, match=r"worker\(s\) died: rank 1 exit code -9 \(SIGKILL\)"):
        llm.generate([[1, 2, 3]] * 4, long)
    assert time.monotonic() - start < 15
    assert_no_children()
    with pytest.raises(RocdraftError, match="tensor-parallel engine is shut down"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()  # idempotent after a failure


def test_worker_killed_while_idle_is_noticed_at_once(pair):
    """No call runs: the worker's process sentinel tells the executor within a second
    (``failure`` names the rank, the listeners hear it once), the other ranks are stopped, and
    the next generate refuses with the same reason."""
    llm = _llm(pair["target"], tensor_parallel_size=2)
    heard, told = [], threading.Event()
    llm.model_runner.executor.add_failure_listener(lambda reason: (heard.append(reason), told.set()))
    assert llm.model_runner.executor.failure is None
    (pid,) = llm.model_runner.executor.worker_pids
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert told.wait(5)
    assert time.monotonic() - start < 1.0
    reason = "tensor-parallel worker(s) died: rank 1 exit code -9 (SIGKILL)"
    assert heard == [reason] and llm.model_runner.executor.failure == reason
    late = []
    llm.model_runner.executor.add_failure_listener(late.append)  # after the fact: called at once
    assert late == [reason]
    with pytest.raises(RocdraftError, match=r"shut down: tensor-parallel worker\(s\) died"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()
    assert_no_children()


def test_a_closed_engine_reports_no_failure(pair):
    """Workers leaving on SHUTDOWN are not a death."""
    llm = _llm(pair["target"], tensor_parallel_size=2)
    heard = []
    llm.model_runner.executor.add_failure_listener(heard.append)
    llm.close()
    time.sleep(0.3)
    assert heard == [] and llm.model_runner.executor.failure is None
    assert_no_children()


def test_close_and_garbage_collection_stop_the_workers(pair):
    llm = _llm(pair["target"], tensor_parallel_size=2)
    assert len(live_children(os.getpid())) == 1
    llm.close()
    llm.close()
    assert llm.model_runner.executor.worker_exit_codes == [0]  # told SHUTDOWN and left, not killed
    assert_no_children()
    llm = _llm(pair["target"], tensor_parallel_size=2)  # dropped without close(): finalizer
    del llm
    gc.collect()
    assert_no_children()


def test_ctrl_c_mid_generate_leaves_no_worker(pair):
    """SIGINT reaches rank 0 mid-generation: KeyboardInterrupt propagates; inside a
    tensor-parallel call the ranks are out of step and the workers are killed at once,
    between calls they stay in step and close() stops them; either way none is left."""
    # Python's own SIGINT handler, set explicitly: a pytest started with SIGINT ignored (a
    # background job) would otherwise never raise KeyboardInterrupt here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        llm = _llm(pair["target"], tensor_parallel_size=2)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3]] * 4, long)
        llm.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_no_children()


def test_interrupt_inside_a_call_kills_the_workers(pair, monkeypatch):
    llm = _llm(pair["target"], tensor_parallel_size=2)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.model_runner.target.module, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1], GREEDY)
    assert_no_children()
    with pytest.raises(RocdraftError, match="shut down: interrupted during a tensor-parallel"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()


def test_two_tp_engines_in_one_process(pair, reference):
    """``rocdraft bench`` holds two engines at once: each has its own process group."""
    with _llm(pair["target"], tensor_parallel_size=2) as a, \
            _llm(pair["target"], pair["eagle"],  # and the unpadded drafting path
                SpeculativeConfig("eagle", 3, draft_policy="fixed", padded_drafting=False),
                tensor_parallel_size=2) as b:
        assert _tokens(a.generate(PROMPTS, GREEDY)) == reference["greedy"]
        assert _tokens(b.generate(PROMPTS, GREEDY)) == reference["greedy"]
        assert b.last_stats.acceptance_length > 1.5
    assert_no_children()


def test_cli_generate_tp2_equals_tp1(pair, capsys):
    from rocdraft.entrypoints.cli import main

    def run(tp: int) -> list:
        argv = ["generate", "--target", pair["target"], "--draft", pair["eagle3"],
                "--num-speculative-tokens", "2", "--prompt-ids", "1,5,7,9", "--prompt-ids",
                "4,4,4", "--max-new-tokens", "8", "--ignore-eos", "--json",
                "--tensor-parallel-size", str(tp), "--attention-backend", FAST_BACKEND]
        assert main(argv) == 0
        return [o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]]

    assert run(2) == run(1)
    gc.collect()
    assert_no_children()


def test_torchrun_launch_equals_tp1(pair, tmp_path):
    """Under torchrun every rank runs the same command: rank 0 the engine, rank 1 turns into
    a worker inside the LLM constructor and exits 0 when rank 0 closes."""
    import subprocess
    import sys

    from rocdraft.distributed.group import free_port

    def run(launcher: tuple[str, ...], tp: int) -> list:
        argv = [*launcher, "-m", "rocdraft.entrypoints.cli", "generate", "--target", pair["target"],
                "--draft", pair["eagle3"], "--prompt-ids", "1,5,7,9", "--max-new-tokens", "8",
                "--ignore-eos", "--json", "--tensor-parallel-size", str(tp),
                "--attention-backend", FAST_BACKEND]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TRITON_INTERPRET": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        return [o["token_ids"] for o in json.loads(done.stdout)["outputs"]]

    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()))
    assert run(torchrun, 2) == run((sys.executable,), 1)
