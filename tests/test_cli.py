"""The composer-par CLI: exit codes, --json, --help, color, and no traceback on bad input.

Most tests call ``main(argv)`` in-process; a few run real processes for what only a
fresh interpreter shows (torch not imported, start-up time, no traceback).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par import ParallelPlan, PlanFileError
from composer_par.cli.common import TRACEBACK_ENV, Output, use_color
from composer_par.cli.main import COMMANDS, main
from composer_par.findings import RULES
from composer_par.planfile import MAX_PLAN_BYTES, MAX_RANKS
from composer_par.plugin.caller import HookError
from composer_par.plugin.registry import ALLOW_ENV, BLOCK_ENV, GROUP
from tests.cli_run import run
from tests.test_planfile import FUZZ, plan_data, to_toml_document

CLEAN = """
[mesh]
dp_shard = 8
[topology]
nodes = 1
devices_per_node = 8
[[plugins]]
name = "fsdp2"
[[plugins]]
name = "meta_init"
"""
WARNS = CLEAN.replace("nodes = 1", "nodes = 2").replace("dp_shard = 8", "dp_shard = 16")  # CP305
ERRORS = CLEAN.replace("dp_shard = 8", "dp_replicate = 2\ndp_shard = 4")  # CP201: no HSDP
INFERRED = '[mesh]\ndp_shard = -1\n[[plugins]]\nname = "fsdp2"\n'
UNREADABLE = {
    "bad_toml": "[mesh\n",
    "unknown_plugin": CLEAN.replace('"meta_init"', '"meta_int"'),
    "unknown_option": CLEAN.replace('"fsdp2"', '"fsdp2"\nreshard_after_foward = true'),
    "unknown_key": "[mesj]\n" + CLEAN,
    "bad_value": CLEAN.replace("dp_shard = 8", "dp_shard = 0"),
}


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NO_COLOR", "TERM", ALLOW_ENV, BLOCK_ENV,
                 TRACEBACK_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    texts = {"clean": CLEAN, "warns": WARNS, "errors": ERRORS, "inferred": INFERRED,
             **UNREADABLE}
    out = {}
    for name, text in texts.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        out[name] = str(path)
    out["missing"] = str(tmp_path / "missing.toml")
    out["directory"] = str(tmp_path)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    out["binary"] = str(binary)
    return out


def run_json(argv: list[str]) -> tuple[int, Any]:
    code, out, _ = run([*argv, "--json"])
    return code, json.loads(out)  # the whole of stdout is one JSON document


# -- exit codes ------------------------------------------------------------------------------

EXIT_CODES: list[tuple[str, Callable[[dict[str, str]], list[str]], int]] = [
    ("clean", lambda f: ["validate", f["clean"]], 0),
    ("warnings only", lambda f: ["validate", f["warns"]], 0),
    ("errors", lambda f: ["validate", f["errors"]], 1),
    ("world size flag breaks the equation", lambda f: ["validate", f["clean"], "--world-size",
                                                       "16"], 1),
    ("flags override the topology", lambda f: ["validate", f["clean"], "--nodes", "2",
                                               "--devices-per-node", "4"], 0),
    ("inferred mesh, unknown world", lambda f: ["validate", f["inferred"]], 0),
    ("bad TOML", lambda f: ["validate", f["bad_toml"]], 2),
    ("unknown plugin", lambda f: ["validate", f["unknown_plugin"]], 2),
    ("unknown option", lambda f: ["validate", f["unknown_option"]], 2),
    ("unknown top-level key", lambda f: ["validate", f["unknown_key"]], 2),
    ("bad value", lambda f: ["validate", f["bad_value"]], 2),
    ("missing file", lambda f: ["validate", f["missing"]], 2),
    ("a directory", lambda f: ["validate", f["directory"]], 2),
    ("not UTF-8", lambda f: ["validate", f["binary"]], 2),
    ("no plan argument", lambda f: ["validate"], 2),
    ("unknown flag", lambda f: ["validate", f["clean"], "--node", "2"], 2),
    ("--nodes 0", lambda f: ["validate", f["clean"], "--nodes", "0"], 2),
    ("--nodes not an int", lambda f: ["validate", f["clean"], "--nodes", "two"], 2),
    ("--world-size too large", lambda f: ["validate", f["clean"], "--world-size",
                                          str(MAX_RANKS + 1)], 2),
    ("too many ranks from flags", lambda f: ["validate", f["clean"], "--nodes", str(MAX_RANKS),
                                             "--devices-per-node", "2"], 2),
    ("one flag, nothing to derive from", lambda f: ["validate", f["inferred"], "--nodes", "3"], 2),
    ("unknown command", lambda f: ["vaildate", f["clean"]], 2),
    ("no command", lambda f: [], 2),
    ("explain clean", lambda f: ["explain", f["clean"]], 0),
    ("explain warnings", lambda f: ["explain", f["warns"]], 0),
    ("explain errors", lambda f: ["explain", f["errors"]], 1),
    ("explain unreadable", lambda f: ["explain", f["unknown_plugin"]], 2),
    ("explain missing", lambda f: ["explain", f["missing"]], 2),
    ("plugins", lambda f: ["plugins"], 0),
    ("rules", lambda f: ["rules"], 0),
    ("help", lambda f: ["--help"], 0),
    ("version", lambda f: ["--version"], 0),
]


@pytest.mark.parametrize(("argv", "expected"), [(a, e) for _, a, e in EXIT_CODES],
                         ids=[name for name, _, _ in EXIT_CODES])
def test_exit_codes(files: dict[str, str], argv: Callable[[dict[str, str]], list[str]],
                    expected: int) -> None:
    code, out, err = run(argv(files))
    assert code == expected, (out, err)
    assert "Traceback" not in out + err


@pytest.mark.parametrize(("argv", "expected"), [(a, e) for n, a, e in EXIT_CODES
                                                if n not in ("help", "version")],
                         ids=[n for n, _, _ in EXIT_CODES if n not in ("help", "version")])
def test_json_is_all_of_stdout_and_carries_the_exit_code(
    files: dict[str, str], argv: Callable[[dict[str, str]], list[str]], expected: int
) -> None:
    code, data = run_json(argv(files))
    assert code == expected
    if "exit_code" in data:
        assert data["exit_code"] == code


def test_json_before_the_command(files: dict[str, str]) -> None:
    code, out, _ = run(["--json", "validate", files["errors"]])
    assert code == 1 and json.loads(out)["findings"][0]["code"] == "CP201"


@pytest.mark.parametrize("command", ["", *(c.name for c in COMMANDS)])
def test_help_everywhere(command: str) -> None:
    code, out, _ = run([command, "--help"] if command else ["--help"])
    assert code == 0
    assert "--json" in out and "usage: composer-par" in out


# -- validate ----------------------------------------------------------------------------------


def test_validate_text_and_json(files: dict[str, str]) -> None:
    code, out, _ = run(["validate", files["errors"]])
    assert "dp_replicate(2) * dp_shard(4) = 8 == world_size(8) on 1 node(s)" in out
    assert "ERROR CP201" in out and "fix:" in out and "\x1b[" not in out
    code, data = run_json(["validate", files["errors"]])
    assert code == 1 and data["ok"] is False and data["world_size"] == 8
    assert data["mesh"] == {"dp_replicate": 2, "dp_shard": 4}
    assert data["topology"] == {"nodes": 1, "devices_per_node": 8}
    assert [f["code"] for f in data["findings"]] == ["CP201"]


def test_validate_clean_and_warnings(files: dict[str, str]) -> None:
    assert "plan is valid: no findings" in run(["validate", files["clean"]])[1]
    code, data = run_json(["validate", files["warns"]])
    assert code == 0 and data["ok"] and [f["severity"] for f in data["findings"]] == ["warning"]


def test_unreadable_plan_reports_every_cp5xx_finding(files: dict[str, str]) -> None:
    code, out, _ = run(["validate", files["unknown_plugin"]])
    assert code == 2
    assert "cannot read the plan" in out and "(did you mean 'meta_init'?)" in out
    code, data = run_json(["validate", files["unknown_option"]])
    assert code == 2 and data["exit_code"] == 2
    [finding] = data["findings"]
    assert finding["code"] == "CP505"
    assert "(did you mean 'reshard_after_forward'?)" in finding["message"]


def test_topology_flags(files: dict[str, str]) -> None:
    _, data = run_json(["validate", files["clean"], "--nodes", "2", "--devices-per-node", "4"])
    assert data["topology"] == {"nodes": 2, "devices_per_node": 4}
    assert [f["code"] for f in data["findings"]] == ["CP305"]
    # One flag alone: the other comes from the world size (the mesh's 8 ranks).
    _, data = run_json(["validate", files["clean"], "--devices-per-node", "2"])
    assert data["topology"] == {"nodes": 4, "devices_per_node": 2}
    # ... or, when the world size does not divide, from the file's [topology].
    _, data = run_json(["validate", files["clean"], "--nodes", "3"])
    assert data["topology"] == {"nodes": 3, "devices_per_node": 8}
    assert "CP101" in [f["code"] for f in data["findings"]]
    # Without [topology], flags make one; the -1 mesh size is inferred from it.
    _, data = run_json(["validate", files["inferred"], "--nodes", "2", "--devices-per-node", "4"])
    assert data["world_size"] == 8 and data["ok"]


def test_world_size_flag_resolves_an_inferred_mesh(files: dict[str, str]) -> None:
    code, data = run_json(["validate", files["inferred"], "--world-size", "16"])
    assert code == 0 and data["world_size"] == 16 and data["topology"] is None
    code, out, err = run(["validate", files["inferred"]])
    assert code == 0 and "world size is unknown" in err and "world size" not in out


def test_validate_reads_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(ERRORS))
    code, data = run_json(["validate", "-"])
    assert code == 1 and data["plan"] == "-"
    monkeypatch.setattr(sys, "stdin", io.StringIO("[mesh"))
    assert run(["validate", "-"])[0] == 2


def test_an_internal_error_is_exit_3_says_it_is_a_bug_and_how_to_see_the_traceback(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(ParallelPlan, "validate", boom)
    code, out, err = run(["validate", files["clean"]])
    assert code == 3 and out == ""
    first, *notes = err.splitlines()
    assert first == "composer-par: internal error: RuntimeError: boom"
    assert "a bug in composer_par" in notes[0] and "not in your input" in notes[0]
    assert f"set {TRACEBACK_ENV}=1 to see the traceback" in notes[1]
    assert "Traceback" not in err
    code, data = run_json(["validate", files["clean"]])
    assert code == 3 and data == {"ok": False, "error": "RuntimeError: boom", "exit_code": 3,
                                  "internal": True, "culprit": "composer_par"}
    # The variable prints the traceback after the summary; the exit code and the one JSON
    # document stay.
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    code, out, err = run(["validate", files["clean"], "--json"])
    assert code == 3 and json.loads(out)["exit_code"] == 3
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


def test_an_os_error_on_a_file_named_on_the_command_line_is_input(tmp_path: Path) -> None:
    from composer_par.cli.common import fail

    def exit_code(exc: OSError, argv: list[str]) -> tuple[int, str]:
        err = io.StringIO()
        code = fail(exc, Output(json_mode=False, stdout=io.StringIO(), stderr=err), None, argv)
        return code, err.getvalue()

    given = str(tmp_path / "ckpt")
    inside = FileNotFoundError(2, "No such file or directory", f"{given}/step-1/x.distcp")
    assert exit_code(inside, ["inspect", given]) == (
        2, f"composer-par: error: cannot read {given}/step-1/x.distcp: No such file or "
        "directory\n")
    assert exit_code(NotADirectoryError(20, "Not a directory", given),
                     ["demo", f"--checkpoint-dir={given}"])[0] == 2
    # A file nobody named is composer-par's own business: a bug.
    code, err = exit_code(FileNotFoundError(2, "No such file", "/elsewhere/x"), ["inspect", given])
    assert code == 3 and "internal error: FileNotFoundError" in err


FAULTY_PLUGIN = """
from typing import ClassVar

import attrs

from composer_par.plugin import Plugin, hookimpl


@attrs.frozen
class Faulty(Plugin):
    name: ClassVar[str] = "faulty"

    @hookimpl
    def composer_par_validate_plan(self, plan, mesh, topology):
        return helper()


def helper():
    return {}["a bug in the plugin"]
"""


@pytest.fixture
def faulty_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A third-party plugin, registered through its entry point, whose hook raises."""
    package = tmp_path / "faulty_plugin_dist"
    package.mkdir()
    (package / "__init__.py").write_text(FAULTY_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = metadata.entry_points

    def entry_points(**kwargs: Any) -> Any:
        found = real(**kwargs)
        if kwargs.get("group") != GROUP:
            return found
        return [*found, metadata.EntryPoint("faulty", "faulty_plugin_dist:Faulty", GROUP)]

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    plan = tmp_path / "faulty.toml"
    plan.write_text(CLEAN + '[[plugins]]\nname = "faulty"\n')
    return str(plan)


def test_a_bug_in_a_plugin_names_the_plugin_and_its_module(faulty_plugin: str) -> None:
    try:
        code, out, err = run(["validate", faulty_plugin])
        assert code == 3 and out == ""
        assert err.startswith("composer-par: internal error: KeyError: 'a bug in the plugin'")
        assert ("a bug in the plugin 'faulty' (module faulty_plugin_dist), not in composer_par"
                in err)
        code, data = run_json(["explain", faulty_plugin])
        assert code == 3 and data["culprit"] == "the plugin 'faulty' (module faulty_plugin_dist)"
    finally:
        sys.modules.pop("faulty_plugin_dist", None)


def test_a_broken_torchrun_environment_is_exit_2(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    code, _, err = run(["validate", files["inferred"]])
    assert code == 2 and err.startswith("composer-par: error: TopologyError")


# -- bounded input: an endless device or a huge file is refused, not read ---------------------

LIMIT_MESSAGE = f"larger than 1 MiB ({MAX_PLAN_BYTES} bytes), the limit for a plan file"


def test_a_plan_file_over_the_limit_is_refused_by_the_python_api(tmp_path: Path) -> None:
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as f:  # sparse: costs no disk
        f.truncate(MAX_PLAN_BYTES + 1)
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(huge)
    [finding] = info.value.report.findings
    assert finding.code == "CP501" and LIMIT_MESSAGE in finding.message
    at_limit = tmp_path / "at_limit.toml"
    at_limit.write_text(CLEAN + "#" * (MAX_PLAN_BYTES - len(CLEAN.encode())))
    assert at_limit.stat().st_size == MAX_PLAN_BYTES
    assert ParallelPlan.from_toml(at_limit).mesh.world_size == 8
    code, data = run_json(["validate", str(huge)])
    assert code == 2 and LIMIT_MESSAGE in data["findings"][0]["message"]


def test_stdin_is_read_with_the_same_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(CLEAN + " " * MAX_PLAN_BYTES))
    code, data = run_json(["validate", "-"])
    assert code == 2 and data["plan"] == "-"
    assert LIMIT_MESSAGE in data["findings"][0]["message"]


def limited_memory() -> None:
    """A child that would read an endless device without a bound dies of MemoryError
    instead of taking the machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_an_endless_device_is_refused_at_the_limit(device: str) -> None:
    for argv, stdin in (([device], subprocess.DEVNULL), (["-"], device)):
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(open(stdin, "rb")) if stdin != subprocess.DEVNULL \
                else stdin
            done = subprocess.run([*cli_command(), "validate", *argv, "--json"], stdin=source,
                                  env=clean_env(), capture_output=True, text=True, timeout=60,
                                  preexec_fn=limited_memory)
        assert done.returncode == 2, (argv, done.stderr)
        [finding] = json.loads(done.stdout)["findings"]
        assert finding["code"] == "CP501" and LIMIT_MESSAGE in finding["message"], finding


# -- explain -----------------------------------------------------------------------------------


def test_explain(files: dict[str, str]) -> None:
    code, out, _ = run(["explain", files["clean"]])
    assert code == 0 and "steps, in apply order:" in out
    assert "[data_parallel] fsdp2" in out and "[materialize] meta_init" in out
    code, data = run_json(["explain", files["clean"]])
    assert data["explanation"]["rank_groups"] == {"dp_shard": [list(range(8))]}
    assert data["report"]["ok"] and data["world_size"] == 8
    code, out, _ = run(["explain", files["errors"]])
    assert code == 1 and "the plan has 1 error(s)" in out and "CP201" in out
    code, out, _ = run(["explain", files["warns"]])
    assert code == 0 and "1 warning(s): run `composer-par validate`" in out


def test_explain_when_a_plugin_hook_is_misspelled(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def misspelled(*args: Any, **kwargs: Any) -> None:
        raise HookError("unknown hook composer_par_data_paralel")

    monkeypatch.setattr(ParallelPlan, "explain", misspelled)
    code, data = run_json(["explain", files["clean"]])
    assert code == 0 and data["explanation"] is None


# -- plugins and rules ---------------------------------------------------------------------------


def test_plugins_lists_the_builtins() -> None:
    code, out, _ = run(["plugins"])
    assert code == 0
    assert out.split("\n")[0].split() == ["NAME", "VERSION", "DISTRIBUTION", "CLAIMS", "STAGES"]
    assert "fsdp2" in out and "dp_shard (shard)" in out and "materialize" in out
    code, data = run_json(["plugins"])
    rows = {r["name"]: r for r in data["plugins"]}
    assert rows["fsdp2"]["distribution"] == "composer-par"
    # finalize: the gradient divide factor, set once every unit exists
    assert rows["fsdp2"]["stages"] == ["data_parallel", "finalize"] and data["blocked"] == []


@pytest.fixture
def broken_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.entry_points

    def entry_points(**kwargs: Any) -> Any:
        found = real(**kwargs)
        if kwargs.get("group") != GROUP:
            return found
        return [*found, metadata.EntryPoint("broken", "composer_par_no_such_module:P", GROUP)]

    monkeypatch.setattr(metadata, "entry_points", entry_points)


@pytest.mark.usefixtures("broken_plugin")
def test_a_broken_plugin_shows_its_error(files: dict[str, str]) -> None:
    code, out, err = run(["plugins"])
    assert code == 1 and "Traceback" not in out + err
    assert "ERROR broken: plugin 'broken'" in out and "fsdp2" in out
    code, data = run_json(["plugins"])
    broken = next(r for r in data["plugins"] if r["name"] == "broken")
    assert "ModuleNotFoundError" in broken["error"]
    Path(files["clean"]).write_text(CLEAN + '[[plugins]]\nname = "broken"\n')
    code, data = run_json(["validate", files["clean"]])
    assert code == 2 and [f["code"] for f in data["findings"]] == ["CP504"]


def test_blocked_plugins_are_listed_as_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BLOCK_ENV, "meta_init")
    code, out, _ = run(["plugins"])
    assert code == 0 and "blocked by the environment: meta_init" in out
    _, data = run_json(["plugins"])
    names = [r["name"] for r in data["plugins"]]
    assert "fsdp2" in names and "meta_init" not in names and data["blocked"] == ["meta_init"]


def test_rules_is_the_whole_catalog() -> None:
    code, out, _ = run(["rules"])
    assert code == 0 and all(code in out for code in RULES)
    _, data = run_json(["rules"])
    assert [r["code"] for r in data["rules"]] == sorted(RULES)
    assert {r["severity"] for r in data["rules"]} <= {"error", "warning", "info"}


# -- --model: the user's code is input, whatever it raises or exits with ----------------------

USER_MODELS = """
import sys

import torch.nn as nn


class Stop(BaseException):
    pass


def exits():
    sys.exit(3)


def exits_cleanly():
    sys.exit()


def raises_base_exception():
    raise Stop("stop")


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def named_modules(self, *args, **kwargs):
        raise ValueError("odd model")


def odd():
    return Odd()
"""


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``cli_user_models`` and ``cli_exits_on_import`` in the current directory, where
    --model looks first."""
    (tmp_path / "cli_user_models.py").write_text(USER_MODELS)
    (tmp_path / "cli_exits_on_import.py").write_text("import sys\nsys.exit('no model here')\n")
    monkeypatch.chdir(tmp_path)
    yield
    for name in ("cli_user_models", "cli_exits_on_import"):
        sys.modules.pop(name, None)


USER_CODE_FAILURES = [
    ("cli_user_models:exits", "the model code called sys.exit(3)"),
    ("cli_user_models:exits_cleanly", "the model code called sys.exit(None)"),
    ("cli_exits_on_import:build", "the model code called sys.exit('no model here')"),
    ("cli_user_models:raises_base_exception", "the model code raised Stop: stop"),
    ("cli_user_models:odd", "the model code raised ValueError: odd model"),
]


@pytest.mark.usefixtures("user_models")
@pytest.mark.parametrize(("spec", "message"), USER_CODE_FAILURES,
                         ids=[spec.partition(":")[2] for spec, _ in USER_CODE_FAILURES])
@pytest.mark.parametrize("command", ["validate", "estimate"])
def test_model_code_that_exits_or_raises_is_exit_2_naming_it(
    files: dict[str, str], spec: str, message: str, command: str
) -> None:
    argv = [command, files["clean"], "--model", spec]
    argv += ["--seq", "8"] if command == "estimate" else []
    code, out, err = run([*argv, "--json"])
    assert code == 2, err
    data = json.loads(out)  # all of stdout: one document
    assert data["exit_code"] == 2 and data["ok"] is False
    assert data["error"].startswith(f"--model {spec}: {message}")
    assert "composer-par cannot use this model" in data["error"]
    assert "internal error" not in err
    code, out, err = run(argv)
    assert code == 2 and out == "" and f"--model {spec}: {message}" in err


# -- demo: argument errors are found before any process starts -------------------------------


@pytest.fixture
def demo_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The arguments of each demo that got as far as starting processes (it does not:
    the run, which launches them, is replaced by a recorder)."""
    from composer_par.tools import demo

    started: list[Any] = []
    monkeypatch.delenv(demo.FAIL_ENV, raising=False)
    monkeypatch.setattr(demo, "run", lambda args, out=None: started.append(args) or 0)
    return started


BAD_DEMO_ARGUMENTS = [
    (["--fail", "abc"], "argument --fail: expected RANK:STEP"),
    (["--fail", "1"], "argument --fail: expected RANK:STEP"),
    (["--fail=-1:2"], "argument --fail: expected RANK:STEP"),
    (["--fail", "1:0"], "argument --fail: expected RANK:STEP"),
    (["--fail", "4:2"], "rank 4 is not one of the 4 processes (0 .. 3)"),
    (["--nproc", "2", "--fail", "2:1"], "rank 2 is not one of the 2 processes"),
    (["--fail", "1:41"], "step 41 comes after the last step (--steps 40)"),
    (["--timeout", "-1"], "argument --timeout: expected a finite number > 0"),
    (["--timeout", "0"], "argument --timeout: expected a finite number > 0"),
    (["--timeout", "nan"], "argument --timeout: expected a finite number > 0"),
    (["--timeout", "1e300"], "argument --timeout: expected a finite number > 0 and <= 86400"),
    (["--timeout", "soon"], "argument --timeout: expected a number"),
    (["--steps", "0"], "argument --steps: expected an int >= 1"),
    (["--steps", "-3"], "argument --steps: expected an int >= 1"),
    (["--nproc", "0"], "argument --nproc: expected an int from 1 to 256"),
    (["--nproc", "-1"], "argument --nproc: expected an int from 1 to 256"),
    (["--seq-len", "1"], "argument --seq-len: expected an int from 2 to 131072"),
    (["--batch", "0"], "argument --batch: expected an int from 1 to 4096"),
    (["--batch", "1"], "--batch 1 is smaller than the plan's 2 data-parallel ranks"),
    (["--lr", "0"], "argument --lr: expected a finite number > 0"),
    (["--lr", "inf"], "argument --lr: expected a finite number > 0"),
    (["--plan", "missing.toml"], "argument --plan: cannot read missing.toml"),
    (["--plan", "/dev/zero"], "argument --plan: cannot read /dev/zero: it is larger than 1 MiB"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_DEMO_ARGUMENTS,
                         ids=[" ".join(a) for a, _ in BAD_DEMO_ARGUMENTS])
def test_demo_argument_errors_come_before_any_process(
    demo_runs: list[Any], extra: list[str], message: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["demo", *extra])
    assert code == 2 and message in err and out == "", err
    code, data = run_json(["demo", *extra])
    assert code == 2 and message in data["error"] and data["exit_code"] == 2
    assert demo_runs == []


def test_demo_arguments_that_are_fine_reach_the_run(
    demo_runs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from composer_par.tools.demo import FAIL_ENV

    assert run(["demo", "--fail", " 1:2", "--steps", "4", "--timeout", "0.5"])[0] == 0
    [args] = demo_runs
    assert (args.fail, args.steps, args.timeout, args.nproc) == ("1:2", 4, 0.5, None)
    # The variable is the default of --fail, checked like the option.
    monkeypatch.setenv(FAIL_ENV, "one:two")
    code, _, err = run(["demo"])
    assert code == 2 and "argument --fail: expected RANK:STEP" in err and len(demo_runs) == 1


# -- --json: exactly one JSON document on stdout, whatever goes wrong -------------------------

# A bad argument for every command (a value its type refuses, where it has one).
BAD_ARGUMENTS = {
    "validate": ["validate", "plan.toml", "--nodes", "0"],
    "explain": ["explain", "plan.toml", "--world-size", "many"],
    "plugins": ["plugins", "extra"],
    "rules": ["rules", "--code", "CP101"],
    "demo": ["demo", "--fail", "abc"],
    "inspect": ["inspect"],
    "convert": ["convert", "only-a-source"],
    "clean": ["clean", "root", "--older-than", "soon"],
    "estimate": ["estimate", "plan.toml", "--seq", "0", "--params", "1e9"],
    "suggest": ["suggest", "--nodes", "0", "--devices-per-node", "8", "--device-memory",
                "80GiB", "--params", "1e9", "--seq", "8"],
    "env": ["env", "extra"],
    "compare": ["compare", "a.json", "b.json", "--rtol", "-1"],
    "selfcheck": ["selfcheck", "plan.toml", "--model", "m:f", "--steps", "0"],
    "import": ["import", "accelerate.yaml", "--nodes", "0"],
    "launch": ["launch", "plan.toml", "--slurm", "--port", "0"],
    "lighthouse": ["lighthouse", "--min-replicas", "0"],
}


def test_every_command_has_a_bad_argument_case() -> None:
    assert sorted(BAD_ARGUMENTS) == sorted(c.name for c in COMMANDS)


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
@pytest.mark.parametrize("where", ["after", "before"])
def test_a_bad_argument_gives_one_json_document_and_exit_2(
    demo_runs: list[Any], command: str, where: str
) -> None:
    for argv in (BAD_ARGUMENTS[command], [command, "--no-such-option"]):
        full = [*argv, "--json"] if where == "after" else ["--json", *argv]
        code, out, err = run(full)
        data = json.loads(out)  # raises on anything but exactly one document
        assert code == 2 and data == {"ok": False, "error": data["error"], "exit_code": 2}, full
        assert err.startswith("composer-par: error: ") and data["error"] in err
    assert demo_runs == []


@pytest.mark.parametrize("argv", [["--help"], ["validate", "--help"], ["--version"], [],
                                  ["demo", "--help"]], ids=str)
def test_help_version_and_no_command_are_one_json_document(argv: list[str]) -> None:
    code, out, _ = run([*argv, "--json"])
    data = json.loads(out)
    assert data["exit_code"] == code
    if argv:
        assert code == 0 and data["ok"] and ("usage: composer-par" in data["text"]
                                             or "composer-par 0." in data["text"])
    else:
        assert code == 2 and "choose a command" in data["error"]


def test_what_else_writes_to_stdout_goes_to_stderr_with_json(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ParallelPlan.validate

    def chatty(self: ParallelPlan, *args: Any, **kwargs: Any) -> Any:
        print("a plugin that prints")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ParallelPlan, "validate", chatty)
    code, out, err = run(["validate", files["clean"], "--json"])
    assert code == 0 and json.loads(out)["ok"] and "a plugin that prints" in err
    code, out, _ = run(["validate", files["clean"]])
    assert "a plugin that prints" in out


def test_a_command_that_reports_only_on_stderr_still_gives_a_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo says why it cannot start on stderr (here: a directory it did not make).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "composer-par-demo").mkdir()
    (tmp_path / "composer-par-demo" / "precious.txt").write_text("keep me")
    code, out, err = run(["demo", "--json"])
    assert code == 2 and "not made by the demo" in err
    assert json.loads(out) == {"ok": False, "exit_code": 2,
                               "error": "see the messages on stderr"}


# -- color ----------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_color_only_on_a_terminal_without_no_color() -> None:
    assert use_color(Terminal(), {})
    assert use_color(Terminal(), {"NO_COLOR": ""})  # no-color.org: set and non-empty
    assert not use_color(Terminal(), {"NO_COLOR": "1"})
    assert not use_color(Terminal(), {"TERM": "dumb"})
    assert not use_color(io.StringIO(), {})
    assert not Output(json_mode=True, stdout=Terminal(), stderr=io.StringIO()).color


def test_findings_are_colored_on_a_terminal(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["validate", files["errors"]]) == 1
    assert "\x1b[31mERROR\x1b[0m CP201" in terminal.getvalue()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    main(["validate", files["errors"], "--json"])
    assert "\x1b[" not in terminal.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    main(["validate", files["errors"]])
    assert "\x1b[" not in terminal.getvalue()


# -- fuzz: any file gives exit 0/1 when it reads as a plan, else exit 2 ------------------------


def check_cli_agrees_with_the_loader(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "plan.toml")
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        try:
            plan = ParallelPlan.from_toml(path)
            expected = plan.validate(world_size=plan.world_size()).exit_code()
        except PlanFileError:
            expected = 2
        for command in ("validate", "explain"):
            code, data = run_json([command, str(path)])
            assert code == expected and data["exit_code"] == expected


# Fewer examples than the loader's own fuzz: each runs two commands and a Registry scan.
CLI_FUZZ = settings(FUZZ, max_examples=60)


@CLI_FUZZ
@given(plan_data)
def test_cli_on_random_structured_plan_files(data: dict[str, Any]) -> None:
    check_cli_agrees_with_the_loader(to_toml_document(data))


@CLI_FUZZ
@given(st.text())
def test_cli_on_random_text(text: str) -> None:
    check_cli_agrees_with_the_loader(text)


# -- real processes: torch-free, fast, no traceback --------------------------------------------

PROBE = """
import contextlib, io, json, sys, time
started = time.perf_counter()
from composer_par.cli.main import main
imported = time.perf_counter()
codes, seconds = [], []
for argv in json.loads(sys.argv[1]):
    before = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes.append(main(argv))
    seconds.append(time.perf_counter() - before)
print(json.dumps({
    "codes": codes,
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
    "import_seconds": imported - started,
    "seconds": seconds,
}))
"""


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", ALLOW_ENV, BLOCK_ENV, TRACEBACK_ENV)}
    env["NO_COLOR"] = "1"
    return env


def cli_command() -> list[str]:
    script = Path(sys.executable).parent / "composer-par"
    return [str(script)] if script.exists() else [sys.executable, "-m", "composer_par.cli"]


@pytest.fixture
def plan_64(tmp_path: Path) -> str:
    path = tmp_path / "plan64.toml"
    path.write_text(CLEAN.replace("dp_shard = 8", "dp_replicate = 8\ndp_shard = 8")
                    .replace("nodes = 1", "nodes = 8"))
    return str(path)


def test_static_commands_never_import_torch(
    files: dict[str, str], plan_64: str
) -> None:
    argvs = [["validate", plan_64], ["validate", plan_64, "--json"], ["explain", plan_64],
             ["validate", files["unknown_plugin"]], ["plugins"], ["rules"]]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], env=clean_env(),
                          capture_output=True, text=True, timeout=60, check=True)
    probe = json.loads(done.stdout)
    assert probe["codes"] == [1, 1, 1, 2, 0, 0]
    assert probe["torch"] == []
    # How fast they answer is benchmarks/bench_validate.py's to measure (a timed test fails
    # on a loaded machine, not on slow code).


def test_the_console_script_never_prints_a_traceback(files: dict[str, str]) -> None:
    cases = [["validate", files[name]] for name in
             ("bad_toml", "unknown_plugin", "missing", "directory", "binary")]
    cases += [["validate", files["clean"], "--nodes", "x"], ["nope"], []]
    for argv in cases:
        done = subprocess.run([*cli_command(), *argv], env=clean_env(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert "Traceback" not in done.stdout + done.stderr, argv
    done = subprocess.run([*cli_command(), "validate", "-", "--json"], input="[mesh\n",
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and json.loads(done.stdout)["findings"][0]["code"] == "CP502"

