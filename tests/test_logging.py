"""structlog: one event per applied step, the rank groups, rank binding, no config on import."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import structlog
import torch

from composer_par import MeshSpec, MetaInit, ParallelPlan, configure_logging


@pytest.fixture(autouse=True)
def _reset_structlog() -> None:
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def events(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_apply_logs_each_step_and_every_mesh_dims_groups() -> None:
    stream = io.StringIO()
    configure_logging(json=True, stream=stream)
    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(MetaInit(seed=0))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    plan.apply(model)
    logged = events(stream)
    applied = [e for e in logged if e["event"] == "applied"]
    assert [(e["stage"], e["plugin"]) for e in applied] == [("materialize", "meta_init")]
    assert applied[0]["detail"].startswith("to_empty on cpu")
    groups = [e for e in logged if e["event"] == "mesh dim"]
    assert groups == [dict(groups[0], dim="dp_shard", size=1, rank_groups=[[0]])]
    assert all(e["rank"] == 0 and e["level"] for e in logged)


def test_other_ranks_are_quiet_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    quiet, loud = io.StringIO(), io.StringIO()
    configure_logging(json=True, stream=quiet)
    structlog.get_logger("t").info("hello")
    configure_logging(json=True, stream=loud, all_ranks=True)
    structlog.get_logger("t").info("hello")
    assert quiet.getvalue() == ""
    assert events(loud)[0]["rank"] == 3


def test_level_filters_events() -> None:
    stream = io.StringIO()
    configure_logging(json=True, stream=stream, level="WARNING")
    structlog.get_logger("t").info("hidden")
    structlog.get_logger("t").warning("shown")
    assert [e["event"] for e in events(stream)] == ["shown"]


def test_importing_the_library_configures_nothing() -> None:
    code = ("import structlog; before = structlog.get_config(); import composer_par; "
            "print(structlog.get_config() == before and not structlog.is_configured())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True"
