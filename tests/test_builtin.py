"""The built-in model pair (models/builtin): it loads through the ordinary loaders, fits the
size budget, is the CLI's default, and meets the acceptance bar on held-out code (greedy,
k = 4) with outputs identical to target-only decoding. Acceptance is a property of the
committed weights (deterministic), not a timing; speedups live in ``rocdraft bench``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocdraft import LLM, SamplingParams, SpeculativeConfig
from rocdraft.builtin import builtin_paths
from rocdraft.cli import main
from rocdraft.corpus import heldout_prompts

PAIR = builtin_paths()
BARS = {"eagle3": 2.5, "eagle": 2.2}


@pytest.fixture(scope="module")
def target_only():
    return LLM(PAIR.target)


@pytest.fixture(scope="module")
def prompts(target_only):
    return heldout_prompts(n=6, prompt_tokens=96, seed=0, tokenizer=target_only.tokenizer)


def test_weights_fit_the_budget_and_are_half_precision():
    files = [p for d in (PAIR.target, PAIR.eagle1, PAIR.eagle3)
             for p in Path(d).glob("*.safetensors")]
    assert len(files) == 3
    assert sum(p.stat().st_size for p in files) <= 40 * 2 ** 20
    for directory in (PAIR.target, PAIR.eagle1, PAIR.eagle3):
        config = json.loads((Path(directory) / "config.json").read_text())
        assert config.get("torch_dtype", config.get("dtype")) in ("bfloat16", "float16")


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_acceptance_bar_on_heldout_code(target_only, prompts, method):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    reference = [o.token_ids for o in target_only.generate(prompts, params)]
    head = PAIR.eagle3 if method == "eagle3" else PAIR.eagle1
    llm = LLM(PAIR.target, draft=head, speculative_config=SpeculativeConfig(method, 4))
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert llm.last_stats.acceptance_length >= BARS[method]


def test_cli_default_is_the_builtin_pair_with_eagle3(capsys):
    rc = main(["generate", "def parse_args(argv):", "--max-new-tokens", "24", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["stats"]["method"] == "eagle3" and out["stats"]["num_verify_steps"] > 0
    assert out["outputs"][0]["text"]
