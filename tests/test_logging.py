"""Logging: events go through Python's logging, so nothing reaches stdout unless the
application asks; configure_logging renders them (one event per applied step, the rank
groups, rank binding, rank 0 only); a user's own configuration decides otherwise; the
default group's longer timeout is warned about once, on rank 0."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import pytest
import structlog
import torch

from composer_par import MeshSpec, MetaInit, ParallelPlan, configure_logging
from composer_par import mesh as mesh_module


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def events(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def small_apply() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(MetaInit(seed=0))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    plan.apply(model)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)


SMALL_APPLY = """
import torch
from composer_par import MeshSpec, MetaInit, ParallelPlan
plan = ParallelPlan(MeshSpec(dp_shard=1)).use(MetaInit(seed=0))
with torch.device("meta"):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
plan.apply(model)
"""


# -- what the application asked for ----------------------------------------------------


def test_apply_logs_each_step_and_every_mesh_dims_groups() -> None:
    stream = io.StringIO()
    configure_logging(json=True, stream=stream)
    small_apply()
    logged = events(stream)
    applied = [e for e in logged if e["event"] == "applied"]
    assert [(e["stage"], e["plugin"]) for e in applied] == [("materialize", "meta_init")]
    assert applied[0]["detail"].startswith("to_empty on cpu")
    groups = [e for e in logged if e["event"] == "mesh dim"]
    assert groups == [dict(groups[0], dim="dp_shard", size=1, rank_groups=[[0]])]
    assert all(e["rank"] == 0 and e["level"] and e["timestamp"] for e in logged)


def test_other_ranks_are_quiet_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    quiet, loud = io.StringIO(), io.StringIO()
    configure_logging(json=True, stream=quiet)
    structlog.get_logger("t").info("hello")
    configure_logging(json=True, stream=loud, all_ranks=True)  # replaces the first handler
    structlog.get_logger("t").info("hello")
    assert quiet.getvalue() == ""
    assert events(loud)[0]["rank"] == 3


def test_other_ranks_still_show_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    stream = io.StringIO()
    configure_logging(json=True, stream=stream)
    log = structlog.get_logger("t")
    log.warning("said by every rank")
    log.error("only this rank's")
    assert [e["event"] for e in events(stream)] == ["only this rank's"]


def test_level_filters_events() -> None:
    stream = io.StringIO()
    configure_logging(json=True, stream=stream, level="WARNING")
    structlog.get_logger("t").info("hidden")
    structlog.get_logger("t").warning("shown")
    assert [e["event"] for e in events(stream)] == ["shown"]


def test_records_of_plain_logging_calls_are_rendered_alike() -> None:
    stream = io.StringIO()
    configure_logging(json=True, stream=stream)
    logging.getLogger("someone.else").warning("plain %s", "record")
    [event] = events(stream)
    assert (event["event"], event["level"], event["rank"]) == ("plain record", "warning", 0)


# -- what the application did not ask for ----------------------------------------------


def test_importing_the_library_configures_nothing() -> None:
    code = ("import logging, structlog; before = structlog.get_config(); "
            "import composer_par; import composer_par.plan; "
            "print(structlog.get_config() == before and not structlog.is_configured() "
            "and not logging.getLogger().handlers "
            "and not logging.getLogger('composer_par').handlers)")
    out = run_python(code)
    assert out.stdout.strip() == "True"
    assert out.stderr == ""


def test_import_and_apply_write_nothing_without_a_configuration() -> None:
    out = run_python("import composer_par\n" + SMALL_APPLY)
    assert out.stdout == ""
    assert out.stderr == ""  # only WARNING and above would show, on stderr


def test_the_users_logging_configuration_decides() -> None:
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout, "
            "format='%(levelname)s %(name)s %(message)s')\n" + SMALL_APPLY)
    lines = run_python(code).stdout.splitlines()
    assert lines[0].startswith("INFO composer_par.plan applied stage='materialize' "
                               "plugin='meta_init' detail='to_empty on cpu")
    assert lines[1] == "INFO composer_par.plan mesh dim dim='dp_shard' size=1 rank_groups=[[0]]"


def test_a_users_handler_gets_every_field(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="composer_par"):
        small_apply()
    [applied] = [r for r in caplog.records if r.msg["event"] == "applied"]  # type: ignore[index]
    assert applied.name == "composer_par.plan" and applied.levelno == logging.INFO
    assert applied.msg["plugin"] == "meta_init"  # type: ignore[index]
    assert applied.getMessage().startswith("applied stage='materialize' plugin='meta_init'")


def test_a_users_processor_formatter_renders_the_librarys_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.JSONRenderer()]))
    library = logging.getLogger("composer_par")
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    try:
        small_apply()
    finally:
        library.removeHandler(handler)
        library.setLevel(logging.NOTSET)
    [applied, _] = events(stream)
    assert (applied["event"], applied["stage"]) == ("applied", "materialize")


# -- the default group's timeout ---------------------------------------------------------


def timeout_warnings(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "composer_par.mesh"
            and "whose timeout is longer" in r.getMessage()]


@pytest.fixture
def nothing_warned_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_module, "_TIMEOUTS_WARNED", set())


def test_a_longer_default_group_timeout_is_warned_about_once_with_the_fix(
        caplog: pytest.LogCaptureFixture, nothing_warned_yet: None) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=1800))
    try:
        for _ in range(3):
            MeshSpec(dp_shard=1).build("cpu", timeout=5.0)
        MeshSpec(dp_shard=1).build("cpu", timeout=1800.0)  # as long: nothing to say
    finally:
        dist.destroy_process_group()
    [warning] = timeout_warnings(caplog.records)
    fields = warning.msg
    assert (fields["default_group_timeout_s"], fields["plan_timeout_s"]) == (1800.0, 5.0)  # type: ignore[index]
    assert "init_process_group" in fields["fix"] and "timeout=plan.timeout" in fields["fix"]  # type: ignore[index]


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_warns_about_the_default_groups_timeout(
        rank: int, caplog: pytest.LogCaptureFixture, fake_world: object,
        monkeypatch: pytest.MonkeyPatch, nothing_warned_yet: None) -> None:
    fake_world(2, rank=rank)  # type: ignore[operator]
    from composer_par.plugin import torch_private

    monkeypatch.setattr(torch_private, "group_timeout",
                        lambda group, device_type: timedelta(seconds=1800))
    MeshSpec(dp_shard=2).build("cpu", timeout=5.0)
    assert len(timeout_warnings(caplog.records)) == (1 if rank == 0 else 0)
