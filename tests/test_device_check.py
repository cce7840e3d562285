"""scripts/device_check.sh fits one short GPU slot: static checks of the script and a run of its
deadline guard with stand-in tools.

What these tests prove, on the CPU: the step budgets and the preamble's timeout add up to at
most 540 s; installs never reach an index (--no-deps, --no-build-isolation, --no-index); the
test dependencies are checked first; the GPU tests and benchmarks come before the extension
build; the script parses (bash -n); once its time is spent the remaining steps are skipped and
summary.txt says which. What only a GPU run proves: that each step passes within its budget.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.sh"
LIMIT_S = 540
TEST_DEPENDENCIES = ("pytest", "hypothesis", "numpy", "safetensors", "tokenizers",
                     "transformers", "triton")


def commands() -> list[str]:
    """The script's lines with continuations joined and comments dropped."""
    text = SCRIPT.read_text(encoding="utf-8").replace("\\\n", " ")
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def steps() -> list[tuple[str, int]]:
    """(name, budget seconds) of every ``step NAME BUDGET CMD...`` call, in order."""
    found = []
    for line in commands():
        match = re.match(r"step ([a-z_]+) (\d+) ", line)
        if match:
            found.append((match.group(1), int(match.group(2))))
    return found


def test_budgets_fit_one_540_second_command():
    names = [name for name, _ in steps()]
    assert len(names) == len(set(names)) and len(names) >= 8, names
    outside = [int(n) for line in commands() if not line.startswith("step ")
               for n in re.findall(r"\btimeout (\d+) ", line)]
    assert outside, "the preamble must run under a timeout"
    total = sum(budget for _, budget in steps()) + sum(outside)
    assert total <= LIMIT_S, (total, steps(), outside)
    assert f"TOTAL_BUDGET={LIMIT_S}" in SCRIPT.read_text(encoding="utf-8")


def test_installs_never_reach_an_index():
    installs = [line for line in commands() if "pip install" in line]
    assert installs
    for line in installs:
        assert "--no-deps" in line, line
        assert "--no-build-isolation" in line or "--no-index" in line, line
    assert any("--no-build-isolation --no-deps -e ." in line for line in installs)
    assert not any(re.search(r"\b(curl|wget|git clone)\b", line) for line in commands())


def test_dependencies_checked_first_and_the_slow_build_last():
    order = [name for name, _ in steps()]
    assert order[0] == "deps"
    deps_step = next(line for line in commands() if line.startswith("needed = "))
    assert all(repr(module) in deps_step for module in TEST_DEPENDENCIES)
    build_at = order.index("build_extension")
    for early in ("gpu_tests", "triton_tests", "bench_kv_write", "bench_attention",
                  "bench_draft_loop", "bench_drafter"):
        assert order.index(early) < build_at, order
    assert "export ROCDRAFT_HIP_KERNELS=0" in commands()  # no JIT build before build_extension


def test_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def fake_tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout absent")
def test_deadline_guard_skips_the_remaining_steps_and_says_so(tmp_path):
    """With 14 s in all and the dependency check taking 6 s, the preamble and that first step
    run, then every other step is skipped (its 5 s of kill grace would not fit) and listed in
    summary.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_tool(bin_dir, "python", 'case "$*" in *"needed = "*) sleep 6;; esac; echo fake python')
    fake_tool(bin_dir, "rocdraft", "echo fake rocdraft")
    fake_tool(bin_dir, "nvidia-smi", "echo 'Fake GPU, 1 MiB'")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out),
               DEVICE_CHECK_BUDGET="14")
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    assert "Fake GPU" in summary and "start deps" in summary and "end deps rc=" in summary
    skipped = re.search(r"NOT RUN \(global deadline\): (.*)", summary).group(1).split()
    carried_wheels = any((ROOT / "wheels").glob("*.whl"))
    expected = [name for name, _ in steps()[1:] if carried_wheels or name != "install_wheels"]
    assert skipped == expected, summary
    assert "skip install: global deadline" in summary and "done in" in summary
    assert (out / "deps.txt").is_file() and not (out / "install.txt").exists()


def test_bench_shapes_runs_the_8b_shape_at_bs_1_and_8_before_the_build():
    """Issue 26: the device check measures Llama-3.1-8B's shape at bs 1 and 8 (with the
    extension off, before its slow build) and the fused kernels' bandwidth."""
    line = next(line for line in commands() if "scripts/bench_shapes.py" in line)
    for flag in ("--shape llama-3.1-8b", "--device cuda", "--batch-size 1", "--batch-size 8"):
        assert flag in line, line
    order = [name for name, _ in steps()]
    assert order.index("bench_shapes") < order.index("build_extension")
    assert order.index("bench_fused_kernels") < order.index("build_extension")
