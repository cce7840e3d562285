"""The CI around the suite: the GitHub workflow's backend matrix (.github/workflows/ci.yml), its
lint in .ci/run, the install requirements CI and GPU machines rely on (setup.py), and the
hypothesis profiles that make CI runs reproducible (tests/conftest.py).

What these tests prove, on the CPU: the workflow has a CPU job per CPU backend through
ROCDRAFT_ATTENTION_BACKEND, the kernel compile checks, and GPU jobs for ROCM_AITER_FA,
TRITON_ATTN and FLASH_ATTN on self-hosted mi300 / h100 runners running the GPU tests and the
device check; actionlint passes (when installed); triton is required only by the extras that
need it, so ROCm torch keeps its own Triton; CI=true selects a derandomized profile that the
pytest header names. What only GitHub proves: that the runners and images exist.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import Phase, settings

import conftest
from rocdraft.backends import registry

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
CI_RUN = ROOT / ".ci" / "run"


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))


def run_lines(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_cpu_jobs_run_the_suite_per_cpu_backend():
    job = workflow()["jobs"]["cpu"]
    backends = job["strategy"]["matrix"]["backend"]
    cpu_runnable = [name for name in registry.registered_names()
                    if registry.refusal_reason(registry.get_backend(name), "cpu") is None]
    assert sorted(backends) == sorted(cpu_runnable) == ["CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN"]
    assert job["env"] == {"ROCDRAFT_ATTENTION_BACKEND": "${{ matrix.backend }}",
                          "TRITON_INTERPRET": "1"}
    assert "pip install -e \".[test]\"" in run_lines(job)
    assert "pytest tests" in run_lines(job)


def test_kernel_job_runs_both_compile_checks_with_the_apt_toolchain():
    job = workflow()["jobs"]["kernels"]
    commands = run_lines(job)
    assert "scripts/check_kernels_compile.py" in commands
    assert "scripts/check_hip_kernels.py" in commands
    for package in ("clang-19", "lld-19", "llvm-19", "libamdhip64-dev", "rocm-device-libs"):
        assert package in commands
    assert "bookworm" in job["container"]  # Debian 12's clang-19 and HIP 5.2 headers


def test_gpu_jobs_cover_the_gpu_backends_on_self_hosted_runners():
    job = workflow()["jobs"]["gpu"]
    entries = {(e["backend"], e["runner"]) for e in job["strategy"]["matrix"]["include"]}
    assert {("ROCM_AITER_FA", "mi300"), ("TRITON_ATTN", "mi300"), ("FLASH_ATTN", "h100"),
            ("TRITON_ATTN", "h100")} <= entries
    assert {backend for backend, _ in entries} <= set(registry.registered_names())
    assert job["runs-on"][0] == "self-hosted"
    image = job["container"]["image"]
    assert "rocm/pytorch" in image and "pytorch/pytorch" in image
    assert job["env"]["ROCDRAFT_ATTENTION_BACKEND"] == "${{ matrix.backend }}"
    commands = run_lines(job)
    assert "pytest -m gpu tests" in commands and "bash scripts/device_check.sh" in commands
    assert "[test-gpu]" in commands  # never pip's triton over the image's own
    labels = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())
    assert {runner for _, runner in entries} <= set(labels["self-hosted-runner"]["labels"])


def test_ci_run_lints_the_workflow():
    script = CI_RUN.read_text(encoding="utf-8")
    assert "actionlint .github/workflows/ci.yml" in script
    assert '".[test,lint]"' in script


@pytest.mark.skipif(shutil.which("actionlint") is None,
                    reason="actionlint absent (pip install -e '.[lint]')")
def test_workflow_passes_actionlint():
    result = subprocess.run(["actionlint", str(WORKFLOW.relative_to(ROOT))], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """(install_requires, extras_require) as written in setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    names = {}
    evaluate = lambda node: eval(compile(ast.Expression(node), "setup.py", "eval"),  # noqa: E731
                                 {"__builtins__": {}}, names)
    for node in tree.body:  # module-level lists, also sums of earlier ones ([...] + SERVE)
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.BinOp)):
            names[node.targets[0].id] = evaluate(node.value)
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {k.arg: k.value for k in call.keywords}
    return evaluate(keywords["install_requires"]), evaluate(keywords["extras_require"])


def test_triton_is_required_only_where_torch_does_not_bring_it():
    """ROCm torch ships Triton as pytorch-triton-rocm: a plain triton requirement would
    install NVIDIA's Triton over it (or fail offline)."""
    install_requires, extras = setup_requirements()
    assert not any(req.startswith("triton") for req in install_requires)
    assert "triton" in extras["triton"] and "triton" in extras["test"]
    assert not any(req.startswith("triton") for req in extras["test-gpu"])
    assert set(extras["test-gpu"]) <= set(extras["test"])
    assert any(req.startswith("actionlint") for req in extras["lint"])


def test_the_test_extra_runs_the_server_tests():
    """CI installs .[test]: the live-server tests need the serve extra and the openai client
    there, so none of them is skipped."""
    _, extras = setup_requirements()
    assert {"fastapi", "uvicorn", "prometheus_client", "jinja2", "httpx"} <= set(extras["serve"])
    assert set(extras["serve"]) | {"openai"} <= set(extras["test"])


def test_hypothesis_profile_follows_ci():
    assert conftest.hypothesis_profile({"CI": "true"}) == "rocdraft-ci"
    assert conftest.hypothesis_profile({"CI": "1"}) == "rocdraft-ci"
    assert conftest.hypothesis_profile({"CI": "false"}) == "rocdraft-dev"
    assert conftest.hypothesis_profile({}) == "rocdraft-dev"
    assert settings.get_current_profile_name() == conftest.hypothesis_profile(os.environ)
    ci, dev = settings.get_profile("rocdraft-ci"), settings.get_profile("rocdraft-dev")
    assert ci.derandomize and ci.database is None and not dev.derandomize
    for profile in (ci, dev):
        assert profile.print_blob and {Phase.explicit, Phase.shrink, Phase.explain} <= \
            set(profile.phases)


@pytest.mark.parametrize("ci,profile", [("true", "rocdraft-ci"), ("", "rocdraft-dev")])
def test_pytest_header_names_the_profile(ci, profile):
    env = dict(os.environ, CI=ci)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co",
                             "tests/test_device_check.py"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"hypothesis profile {profile!r}" in result.stdout
