"""``rocdraft`` CLI: ``generate`` (JSON shape, greedy tokens equal transformers', prompt
sources, speculative methods lossless, per-request failures), ``backends``, and user errors
(one ``rocdraft: error:`` line on stderr, exit code 2, no traceback). Most calls run
``rocdraft.entrypoints.cli.main`` in-process; two go through ``python -m rocdraft.entrypoints.cli`` and the
``rocdraft`` console script to prove the entry points."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.backends import registry
from rocdraft.entrypoints.cli import main
from rocdraft.platform import detect_platform

OUTPUT_KEYS = {"prompt_token_ids", "token_ids", "text", "finish_reason"}
STATS_KEYS = {"method", "attention_backend", "device", "dtype", "generated_tokens", "elapsed_s",
              "tokens_per_s", "num_speculative_tokens", "draft_attention_backend",
              "acceptance_length", "per_position_acceptance", "num_verify_steps", "tree",
              "nodes_per_verify_step", "num_tree_verify_steps"}
PROMPT_A = "1,5,6,7"
PROMPT_B = "1,30,31,32,33,34,35,36"
MAX_POSITIONS = 256  # TINY max_position_embeddings
ON_CPU = detect_platform().kind == "cpu"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints and prompt files, written once for the module."""
    root = tmp_path_factory.mktemp("cli")
    target = write_tiny_llama(root / "llama", kind="llama")
    deep = write_tiny_llama(root / "deep", kind="deep")
    paths = {"target": target, "deep": deep,
             "eagle1": write_eagle1_head(root / "eagle1", target),
             "eagle3": write_eagle3_head(root / "eagle3", deep)}
    notok = root / "notok"
    notok.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(target / name, notok / name)
    paths["notok"] = notok
    gpt = root / "gpt2"
    gpt.mkdir()
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (gpt / "config.json").write_text(json.dumps(config))
    paths["gpt2"] = gpt
    paths["noconfig"] = root / "noconfig"
    paths["noconfig"].mkdir()
    paths["missing"] = root / "does-not-exist"
    files = {"plain.txt": "hello world\n\n  \nthe quick brown fox\n",
             "prompts.jsonl": json.dumps("hello\nworld") + "\n\n" + json.dumps("the fox") + "\n",
             "empty.txt": "\n   \n",
             "not-a-string.jsonl": json.dumps({"prompt": "x"}) + "\n",
             "not-json.jsonl": "hello world\n"}
    for name, text in files.items():
        (root / name).write_text(text)
        paths[name] = root / name
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    paths["latin1.txt"] = root / "latin1.txt"
    return paths


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ckpt["target"] / "tokenizer.json"))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def generate_json(capsys, *argv) -> dict:
    rc, out, err = run_cli(capsys, "generate", *argv, "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert set(result) == {"outputs", "stats"}
    assert set(result["stats"]) == STATS_KEYS
    for output in result["outputs"]:
        keys = OUTPUT_KEYS | ({"error"} if output["finish_reason"] == "error" else set())
        assert set(output) == keys
    return result


def ids(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def assert_user_error(rc: int, out: str, err: str, *fragments: str) -> str:
    assert rc == 2, (out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("rocdraft: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# --- generate ------------------------------------------------------------------------------

def test_greedy_json_matches_transformers(capsys, ckpt, tokenizer):
    """Two --prompt-ids prompts in one batch; each equals transformers' greedy generate."""
    from transformers import AutoModelForCausalLM

    result = generate_json(capsys, "--target", ckpt["target"], "--prompt-ids", PROMPT_A,
                           "--prompt-ids", PROMPT_B, "--max-new-tokens", 12, "--device", "cpu")
    outputs, stats = result["outputs"], result["stats"]
    assert [o["prompt_token_ids"] for o in outputs] == [ids(PROMPT_A), ids(PROMPT_B)]
    model = AutoModelForCausalLM.from_pretrained(ckpt["target"], dtype=torch.float32).eval()
    for output in outputs:
        prompt = torch.tensor([output["prompt_token_ids"]])
        with torch.no_grad():
            expected = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      do_sample=False, max_new_tokens=12, pad_token_id=0)
        expected = expected[0, prompt.shape[1]:].tolist()
        assert output["token_ids"] == expected
        stopped = expected[-1] == 2
        assert output["finish_reason"] == ("stop" if stopped else "length")
        assert output["text"] == tokenizer.decode(output["token_ids"])
    assert stats["method"] == "none" and stats["num_speculative_tokens"] == 0
    assert stats["draft_attention_backend"] is None
    assert stats["attention_backend"] in registry.registered_names()
    assert stats["device"] == "cpu" and stats["dtype"] == "float32"
    assert stats["generated_tokens"] == sum(len(o["token_ids"]) for o in outputs)
    assert stats["elapsed_s"] > 0 and stats["tokens_per_s"] > 0
    assert stats["acceptance_length"] == 0.0
    assert stats["per_position_acceptance"] == [] and stats["num_verify_steps"] == 0


def test_every_matrix_backend_gives_the_same_tokens(capsys, ckpt, attention_backend):
    # The tiny float32 model (head_dim 16, the engine's block_size 16) is outside what the
    # vendor backends accept; the registry says why.
    fits = registry.ModelRequirements(block_size=16, head_dim=16, dtype=torch.float32)
    reason = registry.refusal_reason(registry.get_backend(attention_backend),
                                     detect_platform().kind, fits)
    if reason:
        pytest.skip(f"{attention_backend} cannot run the tiny float32 model: {reason}")
    args = ("--target", ckpt["target"], "--prompt-ids", PROMPT_A, "--prompt-ids", PROMPT_B,
            "--max-new-tokens", 6)
    reference = generate_json(capsys, *args, "--attention-backend", "TORCH_SDPA")
    assert reference["stats"]["attention_backend"] == "TORCH_SDPA"
    result = generate_json(capsys, *args, "--attention-backend", attention_backend)
    assert result["stats"]["attention_backend"] == attention_backend
    assert [o["token_ids"] for o in result["outputs"]] == \
        [o["token_ids"] for o in reference["outputs"]]


def test_text_prompts_file_and_ids_in_order(capsys, ckpt, tokenizer):
    result = generate_json(capsys, "--target", ckpt["target"], "a quick fox",
                           "--prompts-file", ckpt["plain.txt"], "--prompt-ids", PROMPT_A,
                           "--max-new-tokens", 3)
    prompts = [o["prompt_token_ids"] for o in result["outputs"]]
    assert prompts == [tokenizer.encode("a quick fox").ids, tokenizer.encode("hello world").ids,
                       tokenizer.encode("the quick brown fox").ids, ids(PROMPT_A)]
    assert prompts[0][0] == 1  # the tokenizer prepends <s>
    for output in result["outputs"]:
        assert output["text"] == tokenizer.decode(output["token_ids"])
        assert 1 <= len(output["token_ids"]) <= 3


def test_jsonl_prompts_file_keeps_newlines(capsys, ckpt, tokenizer):
    result = generate_json(capsys, "--target", ckpt["target"], "--prompts-file",
                           ckpt["prompts.jsonl"], "--max-new-tokens", 3)
    prompts = [o["prompt_token_ids"] for o in result["outputs"]]
    assert prompts == [tokenizer.encode("hello\nworld").ids, tokenizer.encode("the fox").ids]
    assert len(prompts[0]) == 3  # <s> hello world: the newline only separates words


def test_human_readable_output(capsys, ckpt):
    rc, out, err = run_cli(capsys, "generate", "--target", ckpt["target"], "hello world",
                           "--prompt-ids", PROMPT_A, "--max-new-tokens", 3)
    assert rc == 0, err
    assert "--- completion 0 (" in out and "--- completion 1 (" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("[none, ") and " tokens in " in summary and "tok/s" in summary
    assert "acceptance" not in summary


class Recorder:
    """A stdout that is a terminal and keeps each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_at_a_terminal_text_streams_as_generated_and_stats_come_last(capsys, ckpt,
                                                                       monkeypatch):
    """Two prompts at a terminal: each completion's text arrives over several writes, in
    prompt order, equal to --json's text; the statistics line is last; nothing on stderr for
    a quick load."""
    argv = ["--target", ckpt["target"], "hello world", "--prompt-ids", PROMPT_A,
            "--max-new-tokens", 6, "--ignore-eos"]
    expected = generate_json(capsys, *argv)["outputs"]
    screen = Recorder()
    monkeypatch.setattr(sys, "stdout", screen)
    rc = main(["generate", *map(str, argv)])
    assert rc == 0
    out = "".join(screen.writes)
    first = out.index("--- completion 0 ---\n")
    second = out.index("--- completion 1 ---\n")
    text0 = out[first + len("--- completion 0 ---\n"):out.index("\n[length]\n", first)]
    assert text0 == expected[0]["text"]
    assert "[length]" in out[second:]
    assert out.strip().splitlines()[-1].startswith("[none, ")
    chunks = screen.writes[screen.writes.index("--- completion 0 ---\n") + 1:]
    assert len([w for w in chunks[:chunks.index("\n[length]\n")] if w]) > 1  # streamed
    assert capsys.readouterr().err == ""


def test_a_pipe_gets_the_whole_output_at_the_end(capsys, ckpt):
    """Not a terminal (capsys): the completion blocks as before, nothing streamed."""
    rc, out, err = run_cli(capsys, "generate", "--target", ckpt["target"], "hello world",
                           "--max-new-tokens", 3)
    assert rc == 0 and "--- completion 0 (" in out and "--- completion 0 ---" not in out


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_speculative_methods_are_lossless(capsys, ckpt, method):
    target = ckpt["target"] if method == "eagle" else ckpt["deep"]
    draft = ckpt["eagle1"] if method == "eagle" else ckpt["eagle3"]
    args = ("--target", target, "--prompt-ids", PROMPT_A, "--prompt-ids", PROMPT_B,
            "--max-new-tokens", 10, "--attention-backend", "TORCH_SDPA")
    plain = generate_json(capsys, *args, "--method", "none")
    for policy in ("cost", "fixed"):  # whatever the draft count, the tokens are the same
        chosen = generate_json(capsys, *args, "--method", method, "--draft", draft,
                               "--num-speculative-tokens", 3, "--draft-policy", policy)
        assert [o["token_ids"] for o in chosen["outputs"]] == \
            [o["token_ids"] for o in plain["outputs"]]
    spec = chosen  # "fixed": every step verifies all 3 drafts, so the counts below hold
    assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in plain["outputs"]]
    assert [o["finish_reason"] for o in spec["outputs"]] == \
        [o["finish_reason"] for o in plain["outputs"]]
    stats = spec["stats"]
    assert stats["method"] == method and stats["num_speculative_tokens"] == 3
    assert stats["attention_backend"] == "TORCH_SDPA"
    assert stats["draft_attention_backend"] == "TORCH_SDPA"
    per_position = stats["per_position_acceptance"]
    assert len(per_position) == 3 and all(0.0 <= a <= 1.0 for a in per_position)
    verify, length = stats["num_verify_steps"], stats["acceptance_length"]
    assert verify > 0 and 1.0 <= length <= 4.0
    # No draft was capped (short outputs), so every verification proposed all 3 drafts.
    assert length == pytest.approx(1 + sum(per_position), abs=1e-3)
    # Each request samples one token at prefill, then >= 1 and <= accepted + 1 per verify.
    generated = stats["generated_tokens"]
    assert generated == sum(len(o["token_ids"]) for o in spec["outputs"])
    assert 2 + verify <= generated <= 2 + round(verify * length) + 1


@pytest.mark.parametrize("tree_args, tree", [
    (("--speculative-token-tree", "[(0,), (1,), (0, 0), (0, 1), (1, 0)]"),
     [[0], [1], [0, 0], [0, 1], [1, 0]]),
    (("--tree-depth", 3, "--tree-top-k", 2, "--tree-total-tokens", 6),
     {"depth": 3, "top_k": 2, "total_tokens": 6}),
])
def test_tree_generate_json_stats_and_lossless(capsys, ckpt, tree_args, tree):
    args = ("--target", ckpt["deep"], "--prompt-ids", PROMPT_A, "--prompt-ids", PROMPT_B,
            "--max-new-tokens", 8, "--attention-backend", "TORCH_SDPA")
    plain = generate_json(capsys, *args, "--method", "none")
    assert plain["stats"]["tree"] is None and plain["stats"]["nodes_per_verify_step"] == 0.0
    result = generate_json(capsys, *args, "--draft", ckpt["eagle3"], *tree_args)
    assert [o["token_ids"] for o in result["outputs"]] == \
        [o["token_ids"] for o in plain["outputs"]]
    stats = result["stats"]
    assert stats["tree"] == tree
    depth = 3 if isinstance(tree, dict) else 2
    nodes = 5  # the static list has 5 nodes; total_tokens 6 keeps 5
    assert len(stats["per_position_acceptance"]) == depth  # per depth for trees
    assert stats["num_verify_steps"] > 0
    assert 0 < stats["num_tree_verify_steps"] <= stats["num_verify_steps"]  # drafts trees first
    assert 0 < stats["nodes_per_verify_step"] <= nodes
    assert 1.0 <= stats["acceptance_length"] <= depth + 1
    rc, out, err = run_cli(capsys, "generate", *args, "--draft", ckpt["eagle3"], *tree_args)
    assert rc == 0 and "per depth:" in out and "drafts verified per step" in out, err


@pytest.mark.parametrize("tree_args, fragments", [
    (("--speculative-token-tree", "0,1"), ("node 0 is not a tuple", "expected a list of")),
    (("--speculative-token-tree", "[(0,), (1, 1)]"), ("(1, 1) has no parent (1,)",)),
    (("--speculative-token-tree", "eagle", "--tree-top-k", 2), ("tree_top_k", "choose one")),
    (("--tree-depth", 3, "--tree-total-tokens", 6), ("missing tree_top_k",)),
])
def test_bad_tree_flags_are_one_line_errors(capsys, ckpt, tree_args, fragments):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["deep"], "--draft",
                               ckpt["eagle3"], "--prompt-ids", PROMPT_A, *tree_args),
                      *fragments)


@pytest.mark.parametrize("method", ["none", "eagle"])
def test_seeded_sampling_ignores_batch_neighbours(capsys, ckpt, method):
    spec = ("--draft", ckpt["eagle1"]) if method == "eagle" else ()
    args = ("--target", ckpt["target"], "--method", method, *spec, "--temperature", "1.0",
            "--seed", "7", "--max-new-tokens", 8)
    alone = generate_json(capsys, *args, "--prompt-ids", PROMPT_A)["outputs"]
    batched = generate_json(capsys, *args, "--prompt-ids", PROMPT_A, "--prompt-ids",
                            PROMPT_B)["outputs"]
    assert batched[0]["token_ids"] == alone[0]["token_ids"]
    assert len(batched[1]["token_ids"]) >= 1


def test_method_defaults_to_eagle3_with_a_draft(capsys, ckpt):
    result = generate_json(capsys, "--target", ckpt["deep"], "--draft", ckpt["eagle3"],
                           "--prompt-ids", PROMPT_A, "--max-new-tokens", 3)
    assert result["stats"]["method"] == "eagle3"


def test_bad_requests_fail_alone(capsys, ckpt):
    too_long = ",".join(["5"] * MAX_POSITIONS)
    longest = ",".join(["5"] * (MAX_POSITIONS - 1))
    alone = generate_json(capsys, "--target", ckpt["target"], "--prompt-ids", PROMPT_A,
                          "--max-new-tokens", 5)["outputs"][0]
    result = generate_json(capsys, "--target", ckpt["target"], "--prompt-ids", too_long,
                           "--prompt-ids", "", "--prompt-ids=1,500", "--prompt-ids=-3,4",
                           "--prompt-ids", PROMPT_A, "--prompt-ids", longest,
                           "--max-new-tokens", 5)
    long_out, empty, oov, negative, good, edge = result["outputs"]
    for failed, fragment in ((long_out, "max_model_len"), (empty, "empty prompt"),
                             (oov, "outside the vocabulary"),
                             (negative, "outside the vocabulary")):
        assert failed["finish_reason"] == "error"
        assert fragment in failed["error"]
        assert failed["token_ids"] == [] and failed["text"] is None
    assert "500" in oov["error"] and "-3" in negative["error"]
    assert good["token_ids"] == alone["token_ids"]
    assert good["finish_reason"] == alone["finish_reason"]
    # A prompt one token short of max_model_len still generates exactly one token.
    assert len(edge["token_ids"]) == 1 and edge["finish_reason"] in ("length", "stop")
    assert result["stats"]["generated_tokens"] == len(good["token_ids"]) + 1


def test_bad_request_in_text_output(capsys, ckpt):
    rc, out, err = run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                           "1,999", "--prompt-ids", PROMPT_A, "--max-new-tokens", 2)
    assert rc == 0, err
    assert "--- completion 0 (error) ---\n[error] token ids [999] outside the vocabulary" in out
    assert "--- completion 1 (" in out


def test_prompt_without_a_utf8_form_fails_alone(capsys, ckpt):
    """A non-UTF-8 argv byte reaches Python as a lone surrogate ("\\udcff"): that prompt fails
    with one line, the others complete, and nothing raises."""
    result = generate_json(capsys, "--target", ckpt["target"], "caf\udcff", "hello world",
                           "--max-new-tokens", 2)
    bad, good = result["outputs"]
    assert bad["finish_reason"] == "error" and "not valid UTF-8" in bad["error"]
    assert "0xff" in bad["error"] and "\n" not in bad["error"]
    assert good["finish_reason"] != "error" and len(good["token_ids"]) >= 1
    rc, out, err = run_cli(capsys, "generate", "--target", ckpt["target"], "caf\udcff")
    assert rc == 1 and "Traceback" not in err, err
    assert "--- completion 0 (error) ---\n[error] prompt is not valid UTF-8: byte 0xff" in out


def test_target_without_tokenizer(capsys, ckpt):
    result = generate_json(capsys, "--target", ckpt["notok"], "hello world", "--prompt-ids",
                           PROMPT_A, "--max-new-tokens", 3)
    text_prompt, id_prompt = result["outputs"]
    assert text_prompt["finish_reason"] == "error"
    assert "tokenizer" in text_prompt["error"]
    assert id_prompt["text"] is None and len(id_prompt["token_ids"]) >= 1
    rc, out, _ = run_cli(capsys, "generate", "--target", ckpt["notok"], "--prompt-ids",
                         PROMPT_A, "--max-new-tokens", 3)
    assert rc == 0
    assert " ".join(map(str, id_prompt["token_ids"])) in out


# --- user errors ---------------------------------------------------------------------------

def test_missing_directory(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["missing"], "--prompt-ids",
                               PROMPT_A), str(ckpt["missing"]), "does not exist")


def test_directory_without_config(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["noconfig"],
                               "--prompt-ids", PROMPT_A), "config.json")


def test_unsupported_architecture(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["gpt2"], "--prompt-ids",
                               PROMPT_A), "GPT2LMHeadModel", "LlamaForCausalLM")


def test_unknown_backend_lists_registered(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--attention-backend", "NO_SUCH"),
                      "NO_SUCH", *registry.registered_names())


def test_unknown_backend_from_env(capsys, ckpt, monkeypatch):
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "NO_SUCH")
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A), "ROCDRAFT_ATTENTION_BACKEND='NO_SUCH'",
                      *registry.registered_names())


def test_unknown_draft_backend_from_env(capsys, ckpt, monkeypatch):
    monkeypatch.setenv("ROCDRAFT_DRAFT_ATTENTION_BACKEND", "NO_SUCH")
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle", "--draft", ckpt["eagle1"]),
                      "ROCDRAFT_DRAFT_ATTENTION_BACKEND='NO_SUCH'", *registry.registered_names())


@pytest.mark.parametrize("var", ["ROCDRAFT_HIP_KERNELS", "ROCDRAFT_AITER_ASM_LAYOUT"])
def test_unknown_switch_value_from_env(capsys, ckpt, monkeypatch, var):
    monkeypatch.setenv(var, "maybe")
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A), f"{var}='maybe'", "1/true/yes/on", "0/false/no/off")


def test_unknown_draft_backend(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle", "--draft", ckpt["eagle1"],
                               "--draft-attention-backend", "NO_SUCH"), "NO_SUCH")


@pytest.mark.skipif(not ON_CPU, reason="CPU-only expectation")
def test_aiter_on_cpu_says_why(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--attention-backend", "ROCM_AITER_FA"),
                      "ROCM_AITER_FA", "platform cpu")


@pytest.mark.skipif(not ON_CPU, reason="CPU-only expectation")
def test_cuda_device_without_gpu(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--device", "cuda"), "cuda", "no GPU")


@pytest.mark.parametrize("flags, fragment", [
    (("--temperature", "-0.5"), "temperature"),
    (("--temperature", "nan"), "temperature"),
    (("--temperature", "inf"), "temperature must be finite, got inf"),
    (("--top-p", "0"), "top_p"),
    (("--top-p", "1.5"), "top_p"),
    (("--top-k", "-5"), "top_k"),
    (("--max-new-tokens", "0"), "max_tokens"),
])
def test_bad_sampling_params(capsys, ckpt, flags, fragment):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, *flags), fragment)


def test_speculative_method_without_draft(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle3"), "--method eagle3", "--draft")


def test_bad_num_speculative_tokens(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle", "--draft", ckpt["eagle1"],
                               "--num-speculative-tokens", "0"), "num_speculative_tokens")


@pytest.mark.parametrize("method, head, fragment", [
    ("eagle3", "eagle1", "use method 'eagle'"),
    ("eagle", "eagle3", "use method 'eagle3'"),
])
def test_head_of_the_wrong_format(capsys, ckpt, method, head, fragment):
    line = assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["deep"],
                                      "--prompt-ids", PROMPT_A, "--method", method, "--draft",
                                      ckpt[head]), fragment)
    assert str(ckpt[head]) in line


def test_draft_that_is_not_a_head(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle", "--draft", ckpt["target"]),
                      "draft head format")


def test_missing_draft_directory(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle", "--draft", ckpt["missing"]),
                      str(ckpt["missing"]))


@pytest.mark.parametrize("name, fragments", [
    ("empty.txt", ("empty",)),
    ("does-not-exist", ("cannot read prompts file", "does-not-exist")),
    (".", ("cannot read prompts file",)),  # a directory
    ("latin1.txt", ("latin1.txt", "UTF-8")),
    ("not-a-string.jsonl", ("not-a-string.jsonl:1", "JSON string")),
    ("not-json.jsonl", ("not-json.jsonl:1", "not JSON")),
])
def test_bad_prompts_file(capsys, ckpt, name, fragments):
    path = ckpt["target"].parent / name
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"],
                               "--prompts-file", path), *fragments)


@pytest.mark.parametrize("value", ["1,x", "1.5", "a b"])
def test_bad_prompt_ids(capsys, ckpt, value):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"],
                               "--prompt-ids", value), "--prompt-ids", repr(value))


def test_no_prompt(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"]), "no prompt")


@pytest.mark.parametrize("argv, fragment", [
    ((), "command"),
    (("nope",), "'nope'"),
    (("generate", "--method", "bogus"), "--method"),
    (("generate", "--max-new-tokens", "x"), "--max-new-tokens"),
    (("generate", "--dtype", "float64"), "--dtype"),
    (("backends", "--frobnicate"), "--frobnicate"),
])
def test_usage_errors_are_one_line(capsys, argv, fragment):
    """argparse's own errors follow the same format (exit 2, one line, no usage dump)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    captured = capsys.readouterr()
    assert_user_error(exc.value.code, captured.out, captured.err, fragment)


def test_help_still_works(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "--prompt-ids" in capsys.readouterr().out


def test_multi_line_library_message_becomes_one_line(capsys, ckpt, tmp_path):
    """torch.load's refusal spans several lines; the CLI still prints one."""
    head = tmp_path / "corrupt-head"
    shutil.copytree(ckpt["eagle1"], head)
    (head / "pytorch_model.bin").write_bytes(b"garbage\n")
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--method", "eagle", "--draft", head),
                      "pytorch_model.bin")


def test_corrupt_safetensors_is_a_user_error(capsys, ckpt, tmp_path):
    target = tmp_path / "corrupt-target"
    shutil.copytree(ckpt["target"], target)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[:1000])
    assert_user_error(*run_cli(capsys, "generate", "--target", target, "--prompt-ids",
                               PROMPT_A), "model.safetensors")


# --- KV cache and batch sizing flags --------------------------------------------------------

class _RecordedLLM(Exception):
    """Raised by a stand-in LLM: carries the keyword arguments the CLI built."""


@pytest.mark.parametrize("flags, expected", [
    ((), {}),  # nothing given: LLM's own defaults
    (("--max-num-seqs", 3, "--max-model-len", 32, "--max-num-batched-tokens", 64,
      "--num-kv-blocks", 50), dict(max_num_seqs=3, max_model_len=32,
                                   max_num_batched_tokens=64, num_kv_blocks=50)),
    (("--kv-cache-memory", "2GiB"), dict(kv_cache_memory="2GiB")),
    (("--gpu-memory-utilization", "0.5"), dict(gpu_memory_utilization=0.5)),
])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_sizing_flags_map_to_llm_arguments(capsys, ckpt, monkeypatch, flags, expected,
                                           command):
    import rocdraft.engine.args

    def recording_args(*args, **kwargs):  # the engine arguments the flags give
        raise _RecordedLLM(kwargs)

    monkeypatch.setattr(rocdraft.engine.args, "EngineArgs", recording_args)
    prompt = ("--prompt-ids", PROMPT_A) if command == "generate" else ()
    spec = ("--method", "eagle3", "--draft", ckpt["eagle3"]) if command == "bench" else ()
    with pytest.raises(_RecordedLLM) as info:
        run_cli(capsys, command, "--target", ckpt["deep"], *spec, *prompt, *flags)
    kwargs = info.value.args[0]
    sizing = {k: kwargs[k] for k in ("max_num_seqs", "max_model_len", "max_num_batched_tokens",
                                     "num_kv_blocks", "kv_cache_memory",
                                     "gpu_memory_utilization") if k in kwargs}
    assert sizing == expected


def test_kv_cache_memory_flag_sizes_the_cache(capsys, ckpt, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="rocdraft.engine"):
        result = generate_json(capsys, "--target", ckpt["target"], "--prompt-ids", PROMPT_A,
                               "--max-new-tokens", 4, "--max-model-len", 64,
                               "--kv-cache-memory", "1MiB")
    assert len(result["outputs"][0]["token_ids"]) >= 1
    # 3 layers x 2 KV heads x 16 x float32 x K and V x 16 tokens = 12288 bytes a block
    logged = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert logged and "85 blocks x 16 tokens = 1360 tokens" in logged[-1]
    assert "sized by kv_cache_memory" in logged[-1]


@pytest.mark.parametrize("flags, fragments", [
    (("--kv-cache-memory", "1KiB"), ("1024 bytes", "cannot hold one request",
                                     "max_model_len 256", "196608 bytes")),
    (("--kv-cache-memory", "lots"), ("kv_cache_memory", "'lots'", "2GiB")),
    (("--kv-cache-memory=-2GiB",), ("kv_cache_memory must be > 0",)),
    (("--kv-cache-memory", "0"), ("kv_cache_memory must be > 0 bytes",)),
    (("--num-kv-blocks", "2"), ("num_kv_blocks 2", "cannot hold one request")),
    (("--num-kv-blocks", "20", "--kv-cache-memory", "1GiB"), ("were given together",)),
    (("--max-num-seqs", "0"), ("max_num_seqs must be >= 1, got 0",)),
])
def test_bad_sizing_flags(capsys, ckpt, flags, fragments):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, *flags), *fragments)


@pytest.mark.skipif(not ON_CPU, reason="CPU-only expectation")
def test_gpu_memory_utilization_on_the_cpu_names_the_flag(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--prompt-ids",
                               PROMPT_A, "--gpu-memory-utilization", "0.9"),
                      "--gpu-memory-utilization", "needs a GPU", "--kv-cache-memory")


# --- backends ------------------------------------------------------------------------------

def test_backends_text(capsys, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_ATTENTION_BACKEND", raising=False)
    rc, out, err = run_cli(capsys, "backends")
    assert rc == 0, err
    for name in registry.registered_names():
        assert f"\n{name}  [" in out
    assert "selected now: " in out


def test_backends_json(capsys, monkeypatch):
    monkeypatch.delenv("ROCDRAFT_ATTENTION_BACKEND", raising=False)
    rc, out, err = run_cli(capsys, "backends", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert [b["name"] for b in report["backends"]] == registry.registered_names()
    for row in report["backends"]:
        assert isinstance(row["available"], bool)
        assert row["capabilities"]["multi_token_drafting"] in (True, False)
        if not row["available"]:
            assert row["unavailable_reason"]
    assert report["selected"]["name"] in registry.registered_names()
    assert report["selected"]["reason"]
    if ON_CPU:  # the first available backend of the CPU's priority list
        selected = next(b for b in report["backends"] if b["name"] == report["selected"]["name"])
        assert selected["available"] and "priority" in report["selected"]["reason"]


def test_backends_json_with_env(capsys, monkeypatch):
    monkeypatch.setenv("ROCDRAFT_ATTENTION_BACKEND", "TORCH_SDPA")
    rc, out, _ = run_cli(capsys, "backends", "--json")
    assert rc == 0
    selected = json.loads(out)["selected"]
    assert selected["name"] == "TORCH_SDPA"
    assert "ROCDRAFT_ATTENTION_BACKEND" in selected["reason"]
    rc, out, _ = run_cli(capsys, "backends")
    assert "selected now: TORCH_SDPA (ROCDRAFT_ATTENTION_BACKEND=TORCH_SDPA)" in out


# --- subcommands in their own modules --------------------------------------------------------

def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("generate", "backends", "bench", "serve", "bench-serve"):
        assert f"    {name} " in out, out


@pytest.mark.parametrize("command, module", [("serve", "fastapi"), ("bench-serve", "httpx")])
def test_a_missing_extra_is_one_line_naming_it(capsys, monkeypatch, command, module):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real(name, *a))
    line = assert_user_error(*run_cli(capsys, command, "--port", "1"), f"rocdraft {command} needs",
                             module, "pip install 'rocdraft[serve]'")
    assert "Traceback" not in line


def test_a_command_whose_module_is_absent_is_one_line(capsys, monkeypatch):
    import dataclasses

    import rocdraft.entrypoints.cli

    absent = dataclasses.replace(rocdraft.entrypoints.cli.COMMANDS["serve"], module="rocdraft.absent.command",
                                 needs=())
    monkeypatch.setitem(rocdraft.entrypoints.cli.COMMANDS, "serve", absent)
    assert_user_error(*run_cli(capsys, "serve"), "rocdraft serve is not part of this install",
                      "rocdraft.absent")


def test_serve_takes_the_model_flags(capsys):
    """``rocdraft serve``'s flags come from rocdraft/serve/command.py and cli_options."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn")):
        pytest.skip("the serve extra (fastapi, uvicorn) is not installed")
    from rocdraft.entrypoints.cli import build_parser

    args = build_parser("serve").parse_args(["serve", "--port", "8123", "--target", "/t",
                                             "--num-speculative-tokens", "2"])
    assert (args.port, args.target, args.num_speculative_tokens) == (8123, "/t", 2)


# --- entry points --------------------------------------------------------------------------

def _console_script() -> str:
    beside = Path(sys.executable).with_name("rocdraft")
    found = str(beside) if beside.is_file() else shutil.which("rocdraft")
    assert found, "the rocdraft console script is not installed (pip install -e .)"
    return found


@pytest.fixture(scope="module", autouse=True)
def entry_point_processes(request, ckpt):
    """Start the two real processes test_entry_points checks as soon as the checkpoints exist,
    so their interpreter start-up overlaps the in-process tests."""
    if not any(item.name == "test_entry_points" for item in request.session.items):
        yield None
        return
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    module = subprocess.Popen(
        [sys.executable, "-m", "rocdraft.entrypoints.cli", "generate", "--target", str(ckpt["target"]),
         "--prompt-ids", PROMPT_A, "--max-new-tokens", "4", "--json"], **pipes)
    script = subprocess.Popen(
        [_console_script(), "generate", "--target", str(ckpt["missing"]), "--prompt-ids",
         PROMPT_A], **pipes)
    yield module, script
    for process in (module, script):
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_entry_points(capsys, ckpt, entry_point_processes):
    """``python -m rocdraft.entrypoints.cli`` and the ``rocdraft`` console script, in real processes."""
    module, script = entry_point_processes
    module_out, module_err = module.communicate(timeout=120)
    script_out, script_err = script.communicate(timeout=120)
    assert module.returncode == 0, module_err
    in_process = generate_json(capsys, "--target", ckpt["target"], "--prompt-ids", PROMPT_A,
                               "--max-new-tokens", 4)
    result = json.loads(module_out)
    assert set(result["stats"]) == STATS_KEYS
    assert result["outputs"][0]["token_ids"] == in_process["outputs"][0]["token_ids"]
    assert_user_error(script.returncode, script_out, script_err, "does not exist")


# --- method inference and seeds -------------------------------------------------------------

@pytest.mark.parametrize("target, head, method", [("target", "eagle1", "eagle"),
                                                  ("deep", "eagle3", "eagle3")])
def test_method_is_read_from_the_head_when_not_given(capsys, ckpt, target, head, method):
    result = generate_json(capsys, "--target", ckpt[target], "--draft", ckpt[head],
                           "--prompt-ids", PROMPT_A, "--max-new-tokens", "4")
    assert result["stats"]["method"] == method


def test_draft_with_method_none_is_an_error(capsys, ckpt):
    assert_user_error(*run_cli(capsys, "generate", "--target", ckpt["target"], "--draft",
                               ckpt["eagle3"], "--method", "none", "--prompt-ids", PROMPT_A),
                      "--method none")


def test_seed_gives_each_prompt_its_own_stream(capsys, ckpt):
    args = ("--target", ckpt["target"], "--prompt-ids", PROMPT_A, "--prompt-ids", PROMPT_A,
            "--temperature", "1.0", "--seed", "3", "--max-new-tokens", "12", "--ignore-eos")
    first = [o["token_ids"] for o in generate_json(capsys, *args)["outputs"]]
    again = [o["token_ids"] for o in generate_json(capsys, *args)["outputs"]]
    assert first == again  # reproducible
    assert first[0] != first[1]  # the same prompt twice does not repeat one stream


# --- Ctrl-C ----------------------------------------------------------------------------------

# Runs ``python -m rocdraft.entrypoints.cli`` (through runpy, as -m does) after wrapping LLM._step so that
# the first step announces itself on stderr: the test interrupts a run that is generating.
# The child restores Python's SIGINT handler first: a pytest started with SIGINT ignored (a
# background job) would otherwise hand the ignore down and the child would never see Ctrl-C.
_ANNOUNCING_CHILD = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
import rocdraft.engine
step = rocdraft.engine.LLM._step
def announced(self, *args, **kwargs):
    if not getattr(announced, "said", False):
        announced.said = True
        print("test: generating", file=sys.stderr, flush=True)
    return step(self, *args, **kwargs)
rocdraft.engine.LLM._step = announced
sys.argv[0] = "rocdraft"
runpy.run_module("rocdraft.entrypoints.cli", run_name="__main__", alter_sys=True)
"""


def _interrupt_while_generating(argv: list[str]) -> tuple[int, str, str]:
    import signal
    import threading

    process = subprocess.Popen([sys.executable, "-c", _ANNOUNCING_CHILD, *map(str, argv)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(180, process.kill)
    watchdog.start()
    try:
        before = []
        for line in process.stderr:
            before.append(line)
            if line.rstrip().endswith("test: generating"):
                break
        else:
            raise AssertionError(f"the run never started generating: {''.join(before)}")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
    return process.returncode, out, err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_ctrl_c_prints_one_line_exits_130_and_leaves_nothing(ckpt, tmp_path, command):
    many = ["--prompt-ids", PROMPT_A] * 100
    if command == "generate":
        argv = ["generate", "--target", ckpt["target"], *many, "--max-new-tokens", 240,
                "--ignore-eos", "--json"]
    else:
        pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
        argv = ["bench", "--target", ckpt["deep"], "--draft", ckpt["eagle3"], "--prompts-file",
                ckpt["plain.txt"], "--batch-size", 64, "--max-new-tokens", 200, "--repeat", 5,
                "--plot", tmp_path / "bench.png", "--json"]
    rc, out, err = _interrupt_while_generating(argv)
    assert rc == 130, (out, err)
    assert "Traceback" not in err, err
    assert err.rstrip("\n").split("\n")[-1] == "rocdraft: interrupted", err
    assert out == ""
    assert list(tmp_path.iterdir()) == []  # no plot, no temporary file


def test_a_torchrun_rank_ends_its_process_after_the_command(tmp_path):
    """Launched by torchrun (its env:// variables, WORLD_SIZE 2), ``rocdraft`` ends the
    process with the command's exit code once its output is flushed, skipping the
    interpreter's teardown (where gloo's threads could abort a finished run): an atexit
    handler never runs. Without torchrun, or called with argv (in-process), it returns."""
    from rocdraft.entrypoints.cli import ends_the_process

    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('teardown ran'))\n"
              "from rocdraft.entrypoints.cli import main\n"
              "sys.argv = ['rocdraft'] + sys.argv[1:]\n"
              "sys.exit(main())\n")
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29999"}
    assert ends_the_process(torchrun) and not ends_the_process({})
    for env, teardown in ((torchrun, False), ({}, True)):
        for argv, code in ((["backends", "--json"], 0), (["generate"], 2)):
            done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True,
                                  text=True, timeout=120, cwd=tmp_path,
                                  env={**os.environ, **env})
            assert done.returncode == code, done.stderr[-2000:]
            assert ("teardown ran" in done.stdout) is teardown, (env, argv)
            if code == 0:
                assert json.loads(done.stdout.replace("teardown ran", ""))  # flushed whole
            else:
                assert done.stderr.startswith("rocdraft: error:"), done.stderr
