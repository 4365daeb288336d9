"""``composer-par inspect`` and ``composer-par convert``: text, --json, progress on stderr,
exit 2 naming the file and key on bad input, nothing half-written."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from composer_par import checkpoint as ck
from composer_par.checkpoint import steps
from composer_par.cli.checkpoint import ProgressBar, parse_size
from composer_par.cli.main import main
from composer_par.plan import ParallelPlan
from tests.test_checkpoint_io import reference, state, write_weights


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the test's own set-up printed
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = reference()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    plan = ParallelPlan.from_toml('[mesh]\n[[plugins]]\nname = "meta_init"\nseed = 3\n')
    ck.save(tmp_path / "ckpt", model, optimizer, step=7, plan=plan, extra={"epoch": 1})
    partial = tmp_path / "ckpt" / "step-000000009"
    partial.mkdir()
    return tmp_path / "ckpt"


def test_inspect_a_root_shows_steps_commit_state_and_the_plan(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["inspect", str(saved)], capsys)
    assert code == 0
    assert "step         7  committed" in out and "step         9  UNCOMMITTED (ignored)" in out
    assert "model.layers.0.attention.wq.weight" in out and "64x64" in out and "float32" in out
    assert 'name = "meta_init"' in out and "seed = 3" in out and "extra: {'epoch': 1}" in out
    code, out, _ = run(["inspect", str(saved), "--json"], capsys)
    data = json.loads(out)
    assert data["latest"].endswith("step-000000007")
    assert [s["committed"] for s in data["steps"]] == [True, False]
    keys = {k["name"]: k for k in data["checkpoint"]["keys"]}
    assert keys["model.norm.weight"] == {"name": "model.norm.weight", "shape": [64],
                                         "dtype": "float32", "bytes": 256, "chunks": 1}
    assert "optim.state.norm.weight.exp_avg" in keys


def test_inspect_an_uncommitted_step_says_so(saved: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["inspect", str(saved / "step-000000009")], capsys)
    assert code == 0 and "commit: uncommitted" in out and "load and latest() ignore it" in err


def test_inspect_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_weights(tmp_path / "w.safetensors", {"a": torch.zeros(2, 3),
                                                      "b": torch.ones(4, dtype=torch.bfloat16)})
    code, out, _ = run(["--json", "inspect", str(path)], capsys)
    data = json.loads(out)
    assert code == 0 and data["kind"] == "safetensors" and data["bytes"] == 32
    assert data["keys"][1] == {"name": "b", "shape": [4], "dtype": "bfloat16", "bytes": 8,
                               "file": "w.safetensors"}


def test_convert_both_ways_with_progress_and_json(saved: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["convert", str(saved), str(tmp_path / "st"), "--json",
                          "--max-file-size", "100KB", "--dtype", "bfloat16"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["to"] == "safetensors" and len(data["files"]) > 1
    assert "converting to safetensors: 100%" in err and "done in" in err
    code, out, err = run(["convert", str(tmp_path / "st"), str(tmp_path / "back")], capsys)
    assert code == 0 and "(dcp)" in out and "converting to dcp: 100%" in err
    assert steps.is_committed(tmp_path / "back")
    model = reference(seed=9)
    ck.load(tmp_path / "back", model)
    assert all(torch.equal(v, state(reference())[k].to(torch.bfloat16).float())
               for k, v in state(model).items())


@pytest.mark.parametrize("case", ["truncated", "uncommitted", "exists", "missing"])
def test_bad_input_exits_2_naming_the_file_and_writes_nothing(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    if case == "truncated":
        src = write_weights(tmp_path / "w.safetensors", state(reference()))
        src.write_bytes(src.read_bytes()[:-4])
        expected = "w.safetensors: truncated: key output.weight"
    elif case == "uncommitted":
        src = saved / "step-000000009"
        expected = "step-000000009: uncommitted checkpoint"
    elif case == "exists":
        src = saved
        (tmp_path / "dst").mkdir()
        expected = "dst already exists"
    else:
        src = tmp_path / "nothing-here"
        expected = "nothing-here: no such file or directory"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run(["convert", str(src), str(tmp_path / "dst"), "--json"], capsys)
    assert code == 2 and expected in err and json.loads(out)["ok"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, _, err = run(["inspect", str(src)], capsys)
    if case in ("truncated", "missing"):
        assert code == 2 and expected in err


def test_sizes_and_the_progress_bar() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1000") == 1000
    stream = io.StringIO()
    bar = ProgressBar(stream, "x")
    for done in range(0, 101, 5):
        bar(done, 100)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "x: 0% (0.00/0.00 GiB)" and len(lines) == 12  # a line per tenth + done
