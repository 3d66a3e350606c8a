"""Options have two scopes (process: init(); engine: optimizer / hook / strategy) and one precedence
rule: an explicit argument > its IMERGE_* env var > the default."""

import pytest

from imerge_hooks.cluster import session
from imerge_hooks.core.config import PROCESS_OPTIONS, Config
from imerge_hooks.core.errors import IMergeConfigError


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


@pytest.mark.parametrize("option", ["tail_credit_bytes", "plan_search_budget_s"])
def test_a_keyword_none_means_what_it_says(initialised, monkeypatch, option):
    """``tail_credit_bytes=None`` is off and ``plan_search_budget_s=None`` searches to the end, even over
    an env var and a non-None default; an engine's argument left at None (``schedule``) is not given."""
    monkeypatch.setenv(f"IMERGE_{option.upper()}", "7")
    assert getattr(Config.from_env(), option) == 7
    assert getattr(Config.from_env(**{option: None}), option) is None
    assert getattr(session.engine_config("DistributedOptimizer", **{option: None}), option) is None
    assert session.engine_config("DistributedOptimizer", schedule=None).schedule == "wfbp"
    monkeypatch.setattr(session.state, "explicit", {**session.state.explicit, option: None})  # init(option=None)
    assert getattr(session.engine_config("IMergeHookState"), option) is None


def test_num_servers_none_is_not_given(monkeypatch):
    monkeypatch.setenv("IMERGE_NUM_SERVERS", "2")
    assert Config.from_env().num_servers == 2


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_timeout_that_is_not_finite_is_refused_naming_the_env_var(monkeypatch, text):
    monkeypatch.setenv("IMERGE_TIMEOUT_S", text)
    with pytest.raises(ValueError, match=rf"timeout_s must be a finite number.*IMERGE_TIMEOUT_S='{text}'"):
        Config.from_env()


@pytest.mark.parametrize("option", ["credit_bytes", "partition_bytes", "plan_search_budget_s", "stall_warning_s"])
def test_a_number_that_is_not_finite_is_refused_by_name(option):
    with pytest.raises(ValueError, match=rf"IMerge: {option} must be a finite number, got nan"):
        Config.from_env(**{option: float("nan")})
