"""``composer-par compare``: two runs' losses and parameters side by side, from JSON logs
and from checkpoints (safetensors and DCP), the first divergent step named."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from composer_par.cli.main import main
from composer_par.testing.parity import full_parameters
from composer_par.testing.tasks import LlamaTask
from composer_par.tools.compare import run_log

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("compare_command")

STEPS = 6
TASK = LlamaTask(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, global_batch=4, seq_len=8)


def _train(split_after: int | None) -> tuple[list[float], Any]:
    """Plain single-process SGD; with ``split_after`` the batches after that step come
    from other data, so the runs part at step ``split_after + 1``."""
    import torch

    torch.manual_seed(0)
    model = TASK.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(1, STEPS + 1):
        shift = 1000 if split_after is not None and step > split_after else 0
        loss = TASK.loss(model, TASK.batch(step + shift))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    from composer_par import checkpoint

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, split in (("base", None), ("again", None), ("split", 3)):
        losses, model = _train(split)
        params = full_parameters(model)
        (root / f"{name}.json").write_text(json.dumps(run_log(losses, params)))
        save_file({k: v.contiguous() for k, v in params.items()}, root / f"{name}.safetensors")
        checkpoint.save(root / f"{name}-dcp", model, step=STEPS)
        paths[name] = root / name
    return paths


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_json_logs_split_after_step_3(runs: dict[str, Path]) -> None:
    code, out, _ = _run(["compare", f"{runs['base']}.json", f"{runs['split']}.json"])
    assert code == 1, out
    assert "losses: first divergent step 4" in out and "the runs differ" in out
    code, out, _ = _run(["compare", f"{runs['base']}.json", f"{runs['split']}.json", "--json"])
    data = json.loads(out)
    assert code == 1 and data["first_divergent_step"] == 4 and not data["equal"]
    assert [row["diff"] for row in data["steps"][:3]] == [0.0, 0.0, 0.0]
    assert data["parameter_method"] == "summary" and data["parameters_differing"]


def test_the_same_run_twice_is_equal_bit_for_bit(runs: dict[str, Path]) -> None:
    code, out, _ = _run(["compare", f"{runs['base']}.json", f"{runs['again']}.json",
                         "--assert-equal"])
    assert code == 0, out
    assert f"losses: equal at every one of the {STEPS} steps" in out
    assert "the runs are equal within the tolerance" in out


@pytest.mark.parametrize("kind", [".safetensors", "-dcp"])
def test_checkpoints_elementwise(runs: dict[str, Path], kind: str) -> None:
    code, out, _ = _run(["compare", f"{runs['base']}{kind}", f"{runs['again']}{kind}",
                         "--assert-equal", "--json"])
    data = json.loads(out)
    assert code == 0 and data["equal"] and data["parameter_method"] == "elementwise"
    assert data["first_divergent_step"] is None and data["steps"] == []
    code, out, _ = _run(["compare", f"{runs['base']}{kind}", f"{runs['split']}{kind}",
                         "--json"])
    data = json.loads(out)
    assert code == 1 and not data["parameters_equal"]
    largest = data["largest_parameter_differences"][0]
    assert largest["name"] in data["parameters_differing"] and largest["diff"] > 1e-4


def test_a_log_against_a_checkpoint_uses_summaries(runs: dict[str, Path]) -> None:
    code, out, _ = _run(["compare", f"{runs['base']}.json", f"{runs['again']}.safetensors"])
    assert code == 0, out
    assert "losses: not compared" in out and "by their summaries" in out


@pytest.mark.parametrize(("contents", "message"), [
    ("[1, 2]", "a JSON log is an object"),
    ('{"loss": [1]}', 'expected "losses"'),
    ("{not json", "not a JSON log"),
])
def test_bad_logs_are_exit_2(tmp_path: Path, contents: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(contents)
    code, _, err = _run(["compare", str(bad), str(bad)])
    assert code == 2 and message in err
    code, _, err = _run(["compare", str(tmp_path / "missing.json"), str(bad)])
    assert code == 2 and "no such file" in err


def test_a_long_log_is_summarized_and_full_table_prints_every_step(tmp_path: Path) -> None:
    """200,000 steps: the report stays a screenful (the first divergence with the steps
    around it, the largest differences, the ends), the JSON stays small; --full-table
    prints every step."""
    steps = 200_000
    a = [1.0 / (1 + i) for i in range(steps)]
    b = list(a)
    for i in range(1000, steps):
        b[i] += 1e-3  # the runs part at step 1001
    b[150_000] += 5.0  # the largest difference, at step 150001
    (tmp_path / "a.json").write_text(json.dumps(run_log(a)))
    (tmp_path / "b.json").write_text(json.dumps(run_log(b)))
    code, out, _ = _run(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert code == 1
    assert len(out.splitlines()) < 60 and len(out) < 6000, len(out)
    assert "losses: first divergent step 1001; 199000 of 200000 steps differ" in out
    rows = {line.split()[0] for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert {"1", "998", "1001", "1004", "150001", "200000"} <= rows, rows
    assert "--full-table prints every step" in out
    code, out, _ = _run(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                         "--json"])
    data = json.loads(out)
    assert len(out) < 20_000 and data["steps_compared"] == steps
    assert data["largest_loss_differences"][0]["step"] == 150_001
    short = 2_000
    (tmp_path / "c.json").write_text(json.dumps(run_log(a[:short])))
    (tmp_path / "d.json").write_text(json.dumps(run_log(b[:short])))
    code, out, _ = _run(["compare", str(tmp_path / "c.json"), str(tmp_path / "d.json"),
                         "--full-table"])
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == short and "--full-table prints" not in out
