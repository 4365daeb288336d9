"""Hostile and faulty input at every door besides the checkpoint readers: ``import``
(configs, the Trainer's JSON), ``compare`` (JSON logs) and the FSDP1 / DeepSpeed
checkpoint readers. A named pipe where a file belongs is refused at once (never waited
on), a document nested too deeply or multiplied by YAML aliases is refused before it is
walked, and each is exit 2 (or a named exception) naming the file, never exit 3."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_par.checkpoint import CheckpointError
from composer_par.cli.main import main
from composer_par.migrate import ImportFailed, import_config, import_trainer_args, load_fsdp1
from tests.test_checkpoint_untrusted import fifo_in_place_of

#: A refusal takes well under this even on a machine busy with other tests; a reader
#: blocked on a pipe is unblocked (so the test fails instead of hanging) only after 10 s.
PROMPTLY = 5.0


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    started = time.monotonic()
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err, time.monotonic() - started


def deep_json(levels: int) -> str:
    return '{"distributed_type": "FSDP", "x": ' + "[" * levels + "]" * levels + "}"


def alias_bomb(levels: int = 7, width: int = 9) -> str:
    """A 10-line accelerate config whose aliases expand to width**levels values."""
    lines = ["distributed_type: FSDP", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels):
        refs = ", ".join([f"*a{level - 1}"] * width)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


# -- import ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [
    ["import", "{fifo}.yaml"],
    ["import", "{fifo}.json"],
    ["import", "--deepspeed", "{fifo}.json"],
    ["import", "--fsdp", "full_shard", "--fsdp-config", "{fifo}.json"],
], ids=["yaml", "json", "deepspeed", "fsdp-config"])
def test_a_pipe_given_to_import_is_refused_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    args = [a.format(fifo=tmp_path / "x") for a in args]
    fifo_in_place_of(Path(args[-1]))
    code, out, seconds = run_cli(args, capsys)
    assert code == 2, out
    assert "CP901" in out and "not a regular file" in out and args[-1] in out
    assert seconds < PROMPTLY


@pytest.mark.timeout(120)
def test_a_pipe_named_by_an_accelerate_config_is_refused_at_once(tmp_path: Path) -> None:
    fifo_in_place_of(tmp_path / "ds.json")
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      "  deepspeed_config_file: ds.json\n")
    started = time.monotonic()
    with pytest.raises(ImportFailed) as caught:
        import_config(config)
    assert time.monotonic() - started < PROMPTLY
    finding = caught.value.report.findings[0]
    assert finding.code == "CP901" and "not a regular file" in finding.message


@pytest.mark.parametrize(("name", "text"), [
    ("deep.json", deep_json(100_000)),   # deeper than the decoder's recursion limit
    ("deep2.json", deep_json(500)),      # decoded, then refused before it is walked
    ("deep.yaml", "distributed_type: FSDP\nx: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("deep2.yaml", "distributed_type: FSDP\nx: " + "[" * 500 + "]" * 500 + "\n"),
], ids=["json-recursion", "json-walk", "yaml-recursion", "yaml-walk"])
def test_deeply_nested_configs_are_exit_2_not_an_internal_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, out, _ = run_cli(["import", str(path)], capsys)
    assert code == 2, out
    assert "CP901" in out and "nested deeper than" in out and "internal error" not in out


def test_deeply_nested_trainer_json_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = '{"version": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    code, out, _ = run_cli(["import", "--fsdp", "full_shard", "--fsdp-config", text], capsys)
    assert code == 2 and "nested deeper than" in out, out
    with pytest.raises(ImportFailed, match="nested deeper than"):
        (tmp_path / "ds.json").write_text(text)
        import_trainer_args(deepspeed=tmp_path / "ds.json")


def test_an_alias_bomb_is_refused_before_it_is_expanded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_text().splitlines()) <= 10
    code, out, seconds = run_cli(["import", str(path)], capsys)
    assert code == 2, out[:2000]
    assert "more than 100000 values once its aliases are expanded" in out
    assert seconds < PROMPTLY and len(out) < 4000


def test_an_alias_to_its_own_container_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("distributed_type: FSDP\nx: &a [1, *a]\n")
    with pytest.raises(ImportFailed, match="refers to a value that contains it"):
        import_config(path)


def test_a_few_aliases_are_read_and_long_values_are_shown_cut(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    # Aliases a person might write, and an unknown key whose value is long.
    path.write_text("distributed_type: FSDP\nfsdp_config: &f\n  fsdp_version: 2\n"
                    "other: " + json.dumps(["y" * 50] * 100) + "\n")
    result = import_config(path)
    unknown = [f for f in result.report.findings if f.code == "CP912"]
    assert unknown and len(unknown[0].message) < 400, unknown
    assert unknown[0].message.rstrip().endswith("plan leaves it out")


# -- compare -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_compare_refuses_a_pipe_at_once(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"losses": [1.0, 0.5]}))
    fifo = fifo_in_place_of(tmp_path / "log.json")
    code, out, seconds = run_cli(["compare", str(fifo), str(good)], capsys)
    assert code == 2 and "not a regular file" in out and seconds < PROMPTLY, out


@pytest.mark.parametrize("levels", [100_000, 500])
def test_compare_refuses_a_deeply_nested_log(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             levels: int) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"losses": [1.0], "x": ' + "[" * levels + "]" * levels + "}")
    code, out, _ = run_cli(["compare", str(deep), str(deep)], capsys)
    assert code == 2, out
    assert "nested" in out and "internal error" not in out


def test_compare_refuses_rungs_that_are_not_objects(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "rungs.json"
    bad.write_text(json.dumps({"rungs": [1, 2]}))
    code, out, _ = run_cli(["compare", str(bad), str(bad)], capsys)
    assert code == 2 and "a list of objects" in out, out


# -- FSDP1 and DeepSpeed files: torch.save pickles ----------------------------------------


class _Payload:
    """Unpickling this writes ``marker``: what a malicious ``torch.save`` file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "code ran"))


def test_a_hostile_fsdp1_pickle_is_a_named_error_and_runs_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    marker = tmp_path / "ran"
    evil = tmp_path / "pytorch_model_fsdp.bin"
    torch.save({"weight": _Payload(marker), "bias": torch.zeros(4)}, evil)
    with pytest.raises(CheckpointError) as caught:
        load_fsdp1(evil, model)
    message = str(caught.value)
    assert str(evil) in message and "nothing from the file ran" in message
    assert "weights_only=False" not in message
    assert not marker.exists()
    assert all(model.state_dict()[k].equal(v) for k, v in before.items())
    code, out, _ = run_cli(["convert", str(evil), str(tmp_path / "out"), "--no-progress"],
                           capsys)
    assert code == 2 and "nothing from the file ran" in out, out
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_a_pipe_in_place_of_an_fsdp1_file_is_named_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "model.bin"
    fifo.write_bytes(b"")
    fifo_in_place_of(fifo)
    started = time.monotonic()
    with pytest.raises(CheckpointError):
        load_fsdp1(fifo, torch.nn.Linear(4, 4))
    assert time.monotonic() - started < PROMPTLY


# -- a checkpoint info field that does not rebuild ----------------------------------------


def test_an_extra_that_does_not_rebuild_is_named_before_the_model_changes(
        tmp_path: Path) -> None:
    from composer_par import checkpoint as ck
    from composer_par.checkpoint import steps
    from tests.test_checkpoint_integrity import fresh
    from tests.test_checkpoint_io import _trained, assert_same, state

    model, optimizer = _trained()
    saved = ck.save(tmp_path / "ckpt", model, optimizer, step=3, extra={"epoch": 1})
    steps.commit(saved, 3)  # a commit without digests: the info file may be edited
    info = json.loads((saved / steps.INFO).read_text())
    info["extra"] = {"__tuple__": 5}
    (saved / steps.INFO).write_text(json.dumps(info))
    model, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=r"composer_par\.json: field extra"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)


# -- every value in every place: a named refusal, never an internal error ----------------

VALUES: list[Any] = [None, True, -1, 2, 3.5, "x", "auto", "none", [1, "a"], {},
                     {"device": "cpu"}, 10**30]
SECTIONS = ("fsdp_config", "deepspeed_config", "parallelism_config", "dynamo_config")
DATA = Path(__file__).parent / "data" / "migrate"


def _key_paths(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for key, value in tree.items():
        found.append((*prefix, key))
        if isinstance(value, dict):
            found += _key_paths(value, (*prefix, key))
    return found


def _source_keys(config: dict[str, Any], deepspeed: bool) -> set[str]:
    sections = ("zero_optimization",) if deepspeed else SECTIONS
    keys = set()
    for key, value in config.items():
        if key in sections and isinstance(value, dict) and value:
            keys |= {f"{key}.{k}" for k in value}
        else:
            keys.add(key)
    return keys


@pytest.mark.parametrize("name", ["accelerate_fsdp2_parallelism.yaml", "accelerate_fsdp1.yaml",
                                  "accelerate_deepspeed.yaml", "ds_zero3.json"])
def test_any_value_in_any_place_is_imported_or_refused_by_name(tmp_path: Path,
                                                               name: str) -> None:
    """Each key of a real config given each kind of value (a list where a section
    belongs, a string where a version does, ...): the import either writes a plan that
    lists every key of the source, or refuses with a finding; nothing else is raised."""
    import yaml

    source = DATA / name
    base = (yaml.safe_load(source.read_text()) if name.endswith(".yaml")
            else json.loads(source.read_text()))
    path = tmp_path / name
    for where in _key_paths(base):
        for value in VALUES:
            config = json.loads(json.dumps(base))
            node = config
            for key in where[:-1]:
                node = node[key]
            node[where[-1]] = value
            path.write_text(yaml.safe_dump(config) if name.endswith(".yaml")
                            else json.dumps(config))
            try:
                result = import_config(path)
            except ImportFailed as exc:
                assert exc.report.errors, (where, value)
                continue
            result.explain()
            json.dumps(result.to_dict())
            listed = {m.key for m in result.mapped}
            missing = _source_keys(config, name.startswith("ds_")) - listed
            assert not missing, (where, value, missing)


def test_any_trainer_argument_or_distributed_config_value_is_imported_or_refused() -> None:
    from composer_par.migrate import import_distributed_config

    calls = [lambda v: import_trainer_args(fsdp=v)]
    for key in ("version", "transformer_layer_cls_to_wrap", "min_num_params", "cpu_offload",
                "xla", "reshard_after_forward", "auto_wrap_policy"):
        calls.append(lambda v, key=key: import_trainer_args(fsdp="full_shard auto_wrap",
                                                            fsdp_config={key: v}))
    for key in ("tp_size", "tp_plan", "fsdp_size", "fsdp_plan", "ep_size", "ep_plan",
                "pp_size", "ep_implementation", "enable_sequence_parallel"):
        calls.append(lambda v, key=key: import_distributed_config({"fsdp_size": 2, key: v}))
    for call in calls:
        for value in VALUES:
            try:
                call(value).explain()
            except ImportFailed as exc:
                assert exc.report.errors
