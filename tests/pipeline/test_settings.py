"""The settings snapshot (sans-IO): built from [frontend], replaced whole on reload."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from direct_frontend.fleet.schema import FaultsConfig, FrontendConfig, LimitsConfig
from direct_frontend.pipeline.admission import AdmissionConfig
from direct_frontend.pipeline.failover import FailoverConfig
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.policies import LeastLoaded, RoundRobin

FRONTEND = FrontendConfig(served_model_name="demo", tokenizer=Path("demo-model"))


def test_the_first_snapshot_is_built_from_the_frontend_section() -> None:
    frontend = dataclasses.replace(
        FRONTEND, faults=FaultsConfig(max_retries=0, stall_timeout_s=5),
        limits=LimitsConfig(max_in_flight=3),
    )
    policy = RoundRobin()
    settings = Settings.first(frontend, policy)
    assert (settings.frontend, settings.policy) == (frontend, policy)
    assert (settings.failover.max_retries, settings.failover.stall_timeout_s) == (0, 5)
    limits = LimitsConfig()
    assert settings.admission.config == AdmissionConfig(3, limits.max_queue, limits.queue_timeout_s)


def test_a_reload_replaces_the_snapshot_and_keeps_admission_while_limits_hold() -> None:
    old = Settings.first(FRONTEND, RoundRobin())
    slower = dataclasses.replace(FRONTEND, max_tokens_default=7,
                                 faults=FaultsConfig(stall_timeout_s=9))
    same_limits = old.reloaded(slower)
    assert same_limits.admission is old.admission  # one cap before and after the reload
    assert same_limits.policy is old.policy and same_limits.failover.stall_timeout_s == 9
    assert old.frontend.max_tokens_default == 1024  # a request holding it keeps its rules
    assert old.failover.stall_timeout_s == FaultsConfig().stall_timeout_s
    tighter = dataclasses.replace(slower, limits=LimitsConfig(max_in_flight=1))
    policy = LeastLoaded()
    new_limits = same_limits.reloaded(tighter, policy)
    # requests admitted under the old limits finish under them: the old cap lives on
    assert new_limits.admission is not old.admission
    assert new_limits.admission.config.max_in_flight == 1 and new_limits.policy is policy
    with pytest.raises(dataclasses.FrozenInstanceError):
        new_limits.policy = RoundRobin()  # type: ignore[misc]


def test_failover_bounds_have_the_schemas_defaults_and_no_others() -> None:
    faults = FaultsConfig()
    failover = FailoverConfig.from_fleet(faults)
    assert (failover.max_retries, failover.max_migrations, failover.stall_timeout_s) == (
        faults.max_retries, faults.max_migrations, faults.stall_timeout_s
    )
    with pytest.raises(TypeError):
        FailoverConfig()  # type: ignore[call-arg]
