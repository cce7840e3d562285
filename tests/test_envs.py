"""rocdraft/envs.py: switches accept one documented set of spellings and refuse the rest naming
the variable; backend variables are checked against the registered names, naming the variable."""
from __future__ import annotations

import pytest

from rocdraft import envs
from rocdraft.errors import RocdraftError

SWITCHES = [(envs.HIP_KERNELS, envs.hip_kernels_enabled, True),
            (envs.AITER_ASM_LAYOUT, envs.aiter_asm_layout, False)]


@pytest.mark.parametrize("var, read, default", SWITCHES)
def test_switch_defaults_when_unset_or_empty(monkeypatch, var, read, default):
    monkeypatch.delenv(var, raising=False)
    assert read() is default
    monkeypatch.setenv(var, "")
    assert read() is default
    monkeypatch.setenv(var, "  ")
    assert read() is default


@pytest.mark.parametrize("var, read, default", SWITCHES)
@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" 1 ", True),
    ("0", False), ("false", False), ("False", False), ("NO", False), ("off", False)])
def test_switch_spellings(monkeypatch, var, read, default, value, expected):
    monkeypatch.setenv(var, value)
    assert read() is expected


@pytest.mark.parametrize("var, read, default", SWITCHES)
@pytest.mark.parametrize("value", ["2", "yes please", "enable", "-1", "y", "t"])
def test_unknown_switch_value_names_variable_value_and_valid_ones(monkeypatch, var, read,
                                                                  default, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(RocdraftError) as exc:
        read()
    msg = str(exc.value)
    assert f"{var}={value!r}" in msg and "\n" not in msg
    assert all(v in msg for v in envs.TRUE_VALUES + envs.FALSE_VALUES)
    with pytest.raises(RocdraftError, match=var):
        envs.check_switches()


def test_check_switches_passes_on_good_values(monkeypatch):
    monkeypatch.setenv(envs.HIP_KERNELS, "off")
    monkeypatch.setenv(envs.AITER_ASM_LAYOUT, "on")
    envs.check_switches()


@pytest.mark.parametrize("var", [envs.ATTENTION_BACKEND, envs.DRAFT_ATTENTION_BACKEND])
def test_checked_backend(monkeypatch, var):
    registered = ["TORCH_SDPA", "TRITON_ATTN"]
    monkeypatch.delenv(var, raising=False)
    assert envs.checked_backend(var, registered) is None
    monkeypatch.setenv(var, "")
    assert envs.checked_backend(var, registered) is None
    monkeypatch.setenv(var, "TRITON_ATTN")
    assert envs.checked_backend(var, registered) == "TRITON_ATTN"
    monkeypatch.setenv(var, "triton_attn")
    with pytest.raises(RocdraftError) as exc:
        envs.checked_backend(var, registered)
    msg = str(exc.value)
    assert f"{var}='triton_attn'" in msg and "TORCH_SDPA, TRITON_ATTN" in msg


def test_describe_source(monkeypatch):
    monkeypatch.setenv(envs.DRAFT_ATTENTION_BACKEND, "X")
    assert envs.describe_source(envs.DRAFT_ATTENTION_BACKEND) == \
        "ROCDRAFT_DRAFT_ATTENTION_BACKEND='X'"
