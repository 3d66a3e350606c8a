"""Options have two scopes (process: init(); engine: optimizer / hook / strategy) and one precedence
rule: an explicit argument > its IMERGE_* env var > the default."""

import pytest

from imerge_hooks import session
from imerge_hooks.config import PROCESS_OPTIONS, Config
from imerge_hooks.errors import IMergeConfigError


@pytest.fixture
def initialised(monkeypatch):
    """The runtime as init(schedule="wfbp", timeout_s=30) on one rank would leave it."""
    monkeypatch.setattr(session.state, "topology", object())
    monkeypatch.setattr(session.state, "config", Config.from_env(schedule="wfbp", timeout_s=30.0, num_servers=0))
    monkeypatch.setattr(session.state, "explicit", {"schedule": "wfbp", "timeout_s": 30.0, "num_servers": 0})


def test_explicit_argument_beats_env_beats_default(initialised, monkeypatch):
    monkeypatch.setenv("IMERGE_SCHEDULE", "priority")
    monkeypatch.setenv("IMERGE_CREDIT_BYTES", "12345")
    cfg = session.engine_config("DistributedOptimizer")
    assert cfg.schedule == "wfbp"  # init()'s explicit argument beats the env var
    assert cfg.credit_bytes == 12345  # the env var beats the default
    assert session.engine_config("DistributedOptimizer", schedule="default").schedule == "default"
    assert cfg.timeout_s == 30.0  # the process's own setting, as init() resolved it


@pytest.mark.parametrize("option", sorted(PROCESS_OPTIONS))
def test_a_process_option_given_to_an_engine_is_refused_naming_where_it_belongs(initialised, option):
    with pytest.raises(IMergeConfigError, match=rf"{option}.*imerge_hooks.init\(\)"):
        session.engine_config("IMergeHookState", **{option: 1})
