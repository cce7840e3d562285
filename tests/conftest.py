"""Shared fixtures. ``attention_backend`` is the backend matrix: every registered backend that
can run on this machine, or only ``ROCDRAFT_ATTENTION_BACKEND`` when that is set (one CI job
per backend runs the same suite).

Hypothesis profiles: with ``CI=true`` (GitHub Actions sets it; so does .ci/run) the
``rocdraft-ci`` profile derandomizes (each test's examples are seeded by a hash of the test, so
every CI run and any ``CI=true`` rerun tries the same examples); locally ``rocdraft-dev`` draws
new random examples each run. Both print a failure's reproducing example and its
``@reproduce_failure`` blob. The pytest header names the profile in use.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

FAILURE_REPORTING = dict(print_blob=True, phases=(Phase.explicit, Phase.reuse, Phase.generate,
                                                  Phase.target, Phase.shrink, Phase.explain))
settings.register_profile("rocdraft-ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], **FAILURE_REPORTING)
settings.register_profile("rocdraft-dev", derandomize=False, **FAILURE_REPORTING)


def hypothesis_profile(environ: Mapping[str, str]) -> str:
    """``rocdraft-ci`` when ``CI`` is ``true`` or ``1`` (any case), else ``rocdraft-dev``."""
    return "rocdraft-ci" if environ.get("CI", "").strip().lower() in ("true", "1") \
        else "rocdraft-dev"


settings.load_profile(hypothesis_profile(os.environ))


def profile_line() -> str:
    name = settings.get_current_profile_name()
    seeding = ("derandomize=True: fixed examples, seeded per test by a hash of the test"
               if settings.default.derandomize else "random examples (set CI=true to fix them)")
    return f"hypothesis profile {name!r}: {seeding}; print_blob={settings.default.print_blob}"


def pytest_report_header(config) -> str:
    return profile_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if config.option.verbose < 0:  # -q hides the header: say it once at the end instead
        terminalreporter.write_line(profile_line())


if not torch.cuda.is_available():
    # Triton kernels can only run in the interpreter here; it must be on before any kernel
    # module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The test models are tiny: one intra-op thread avoids thread oversubscription on small CI
# machines (two threads on two busy cores made a tiny linear 30x slower).
torch.set_num_threads(1)

import rocdraft.backends  # noqa: E402,F401  (registers every backend)
from rocdraft.backends import registry  # noqa: E402
from rocdraft.platform import detect_platform  # noqa: E402


def matrix_backends() -> list[str]:
    chosen = os.environ.get("ROCDRAFT_ATTENTION_BACKEND")
    if chosen:
        return [chosen]
    kind = detect_platform().kind
    return [name for name in registry.registered_names()
            if registry.refusal_reason(registry.get_backend(name), kind) is None]


@pytest.fixture(params=matrix_backends())
def attention_backend(request) -> str:
    """Name of one attention backend of the matrix."""
    return request.param


SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "scripts")


@pytest.fixture()
def import_script(monkeypatch):
    """``import_script(name)`` -> the module ``scripts/<name>.py``, imported with scripts/ on
    sys.path for this test only (as running the script puts it there); dropped from
    sys.modules afterwards, so each test imports it afresh."""
    import importlib
    import sys

    imported = []

    def load(name: str):
        monkeypatch.syspath_prepend(SCRIPTS_DIR)
        imported.append(name)
        return importlib.import_module(name)

    yield load
    for name in imported:
        sys.modules.pop(name, None)
