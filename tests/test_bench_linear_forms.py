"""scripts/bench_linear_forms.py on the CPU: one tiny run of every rule over engine steps of
the built-in pair (target-only and EAGLE-3), the rule restored afterwards, and bad flags
refused. What this proves: the script runs and reports what it claims; the timings
themselves are this machine's (its docstring)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rocdraft.models import linear_form as lf

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture()
def bench(import_script):
    return import_script("bench_linear_forms")


def test_every_rule_runs_and_the_shipped_rule_is_restored(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_linear_forms.py", "--batch-sizes", "1,2",
                                      "--speculative", "--repeats", "1", "--steps", "1"])
    shipped = lf.linear_form
    assert bench.main() == 0
    assert lf.linear_form is shipped
    out = capsys.readouterr().out
    for engine in ("target-only", "eagle3 k=4"):
        for batch_size in (1, 2):
            line = next(x for x in out.splitlines() if x.startswith(f"{engine} bs {batch_size}:"))
            assert all(f"{rule} " in line for rule in bench.RULES)


def test_each_alternative_rule_differs_from_the_shipped_one_somewhere(bench):
    shapes = [(rows, out, inp) for rows in (1, 2, 5, 8, 12) for out, inp in
              ((640, 384), (384, 1024), (2048, 384))]
    for onednn in (False, True):
        for name, rule in bench.RULES.items():
            differs = any(rule(*s, onednn) != lf.linear_form(*s, onednn) for s in shapes)
            # without oneDNN the shipped rule is the BLAS forms
            assert differs == (name not in ("rule", "blas") or (name == "blas" and onednn)), \
                (name, onednn)


@pytest.mark.parametrize("flags, fragment", [
    (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
    (["--batch-sizes", "0"], "must be >= 1"),
    (["--repeats", "0"], "must be >= 1"),
])
def test_bad_flags_are_refused(flags, fragment):
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_linear_forms.py"), *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and fragment in done.stderr
