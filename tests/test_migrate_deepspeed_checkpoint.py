"""DeepSpeed ZeRO-2 and ZeRO-3 checkpoints, written by real DeepSpeed (0.19.8, on 2 gloo
ranks on CPU: the files under tests/data/deepspeed/, see tests/deepspeed_checkpoint_workers.py),
read without DeepSpeed: the rebuilt fp32 weights and AdamW moments are what DeepSpeed's own
accessors gave, bit for bit; ``load_deepspeed`` puts them into a plan on 2 ranks, which then
trains as DeepSpeed went on training; ``convert`` makes safetensors and DCP of them that a
plan loads exactly. Two more (bf16, two parameter groups, stage 3 sub-groups, a frozen
layer, a tied head, a buffer) check the rest of the layout. With DeepSpeed installed, one
test also writes fresh checkpoints of both kinds and reads them."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from composer_par.checkpoint.errors import CheckpointError, KeyMismatchError
from composer_par.cli.main import main
from composer_par.migrate import read_zero_checkpoint
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ATOL, RTOL, assert_params_close
from tests.deepspeed_checkpoint_workers import MOMENTS, STEPS_BEFORE, TAG, read_expected

pytestmark = [pytest.mark.timeout(300)]

WORKERS = "tests.deepspeed_checkpoint_workers"
FIXTURES = Path(__file__).parent / "data" / "deepspeed"
STAGES = (2, 3)


def _assert_reads_as_deepspeed_held(directory: Path) -> None:
    expected, meta = read_expected(directory)
    ckpt = read_zero_checkpoint(directory)
    assert ckpt.stage == meta["stage"] and ckpt.world_size == 2
    assert ckpt.global_steps == STEPS_BEFORE
    assert sorted(ckpt.names) == sorted(expected["saved"])
    for name, value in expected["saved"].items():
        assert ckpt.tensor(name).equal(value), name
        state = ckpt.optimizer_state(name)
        assert float(state["step"]) == STEPS_BEFORE
        for moment in MOMENTS:
            assert state[moment].equal(expected[moment][name]), (name, moment)


@pytest.mark.parametrize("stage", STAGES)
def test_the_reader_rebuilds_what_deepspeed_held(stage: int) -> None:
    _assert_reads_as_deepspeed_held(FIXTURES / f"zero{stage}")


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_a_plan_loads_the_checkpoint_and_resumes_as_deepspeed_did(stage: int) -> None:
    directory = FIXTURES / f"zero{stage}"
    expected, meta = read_expected(directory)
    views = run_ranks(f"{WORKERS}:plan_load_and_resume", 2, args=(str(directory), "deepspeed"))
    for rank, view in enumerate(views):
        assert view["stage"] == stage
        assert view["step"] == {float(STEPS_BEFORE)}
        for name, value in expected["saved"].items():  # the load is exact
            assert view["loaded"][name].equal(value), (rank, name)
            for moment in MOMENTS:
                assert view[moment][name].equal(expected[moment][name]), (rank, name, moment)
        # Adam's state matters here: with fresh moments or step the resumed run differs.
        assert view["losses"] == pytest.approx(meta["losses"], rel=RTOL, abs=ATOL)
        assert_params_close(view["final"], expected["final"], rtol=RTOL, atol=ATOL)
    moved = max(float((views[0]["final"][n] - v).abs().max())
                for n, v in expected["saved"].items())
    assert moved > 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("to", ["safetensors", "dcp"])
def test_convert_writes_what_a_plan_loads_exactly(tmp_path: Path, stage: int, to: str) -> None:
    """Both hold the weights; DCP holds the optimizer's state too, so a plan resumes from
    it as from the DeepSpeed checkpoint itself."""
    directory = FIXTURES / f"zero{stage}"
    expected, meta = read_expected(directory)
    converted = tmp_path / "converted"
    assert main(["convert", str(directory), str(converted), "--to", to,
                 "--no-progress"]) == 0
    views = run_ranks(f"{WORKERS}:plan_load_and_resume", 2, args=(str(converted), to))
    for rank, view in enumerate(views):
        assert set(view["loaded"]) == set(expected["saved"])
        for name, value in expected["saved"].items():
            assert view["loaded"][name].equal(value), (rank, name)
        if to == "dcp":
            assert view["step"] == {float(STEPS_BEFORE)}
            for name in expected["saved"]:
                for moment in MOMENTS:
                    assert view[moment][name].equal(expected[moment][name]), (rank, name)
            assert view["losses"] == pytest.approx(meta["losses"], rel=RTOL, abs=ATOL)
            assert_params_close(view["final"], expected["final"], rtol=RTOL, atol=ATOL)


def test_convert_takes_a_tag_and_a_dtype(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    assert main(["convert", str(FIXTURES / "zero3"), str(out), "--tag", TAG,
                 "--dtype", "bfloat16", "--no-progress"]) == 0
    expected, _ = read_expected(FIXTURES / "zero3")
    loaded = load_file(str(out / "model.safetensors"))
    for name, value in expected["saved"].items():
        assert loaded[name].dtype == torch.bfloat16
        assert loaded[name].equal(value.to(torch.bfloat16)), name


@pytest.mark.parametrize("stage", STAGES)
def test_groups_frozen_and_tied_parameters_and_buffers(tmp_path: Path, stage: int) -> None:
    """bf16 training with two parameter groups (stage 3: several flat sub-groups per
    rank), a frozen layer (saved as DeepSpeed holds it, in bf16), a tied head and a
    buffer: the reader and convert give what DeepSpeed held."""
    from safetensors.torch import load_file

    directory = FIXTURES / f"zero{stage}_mixed"
    expected, _ = read_expected(directory)
    _assert_mixed_reads_as_deepspeed_held(directory)
    out = tmp_path / "weights"
    assert main(["convert", str(directory), str(out), "--no-progress"]) == 0
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == expected["saved"].keys()
    for name, value in expected["saved"].items():
        assert converted[name].equal(value), name


def _assert_mixed_reads_as_deepspeed_held(directory: Path) -> None:
    expected, _ = read_expected(directory)
    ckpt = read_zero_checkpoint(directory)
    assert sorted(ckpt.names) == sorted(expected["saved"])
    assert sorted(ckpt.trainable) == ["embed.weight", "head.weight", "proj.bias",
                                      "proj.weight"]
    for name, value in expected["saved"].items():
        assert ckpt.tensor(name).dtype == value.dtype, name
        assert ckpt.tensor(name).equal(value), name
    state = ckpt.optimizer_state("proj.bias")  # the second group
    assert float(state["step"]) == STEPS_BEFORE
    assert state["exp_avg_sq"].shape == (5,) and bool((state["exp_avg_sq"] > 0).all())


def test_load_deepspeed_fills_a_plain_model_with_tied_and_frozen_parameters() -> None:
    """Without a plan (one process, plain tensors): tied parameters load once, frozen
    ones load though the optimizer does not hold them."""
    from composer_par.migrate import load_deepspeed
    from tests.deepspeed_checkpoint_workers import Mixed

    directory = FIXTURES / "zero3_mixed"
    expected, _ = read_expected(directory)
    model = Mixed()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    info = load_deepspeed(directory, model, optimizer)
    assert (info.stage, info.world_size) == (3, 2)
    assert info.optimizer_keys == 3 * 3  # embed/head, proj.weight, proj.bias: 3 keys each
    for name, value in model.state_dict().items():
        assert value.equal(expected["saved"][name].to(value.dtype)), name
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("stage", STAGES)
def test_dcp_from_deepspeed_keeps_the_parameter_groups(tmp_path: Path, stage: int) -> None:
    """Two groups with their own weight decay: ``load`` gives the optimizer DeepSpeed's
    groups and state (frozen parameters are not the optimizer's)."""
    from composer_par import checkpoint as ck
    from tests.deepspeed_checkpoint_workers import Mixed

    directory = FIXTURES / f"zero{stage}_mixed"
    assert main(["convert", str(directory), str(tmp_path / "dcp"), "--to", "dcp",
                 "--no-progress"]) == 0
    model = Mixed()
    optimizer = torch.optim.AdamW([
        {"params": [model.embed.weight, model.proj.weight], "weight_decay": 0.5},
        {"params": [model.proj.bias], "weight_decay": 0.5}])
    ck.load(tmp_path / "dcp", model, optimizer)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    ckpt = read_zero_checkpoint(directory)
    for name, param in model.named_parameters():
        assert param.equal(ckpt.tensor(name).to(param.dtype)), name
        if param.requires_grad:
            for key, value in ckpt.optimizer_state(name).items():
                assert optimizer.state[param][key].equal(value), (name, key)


def test_convert_refuses_options_that_do_not_apply(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    source = str(FIXTURES / "zero2")
    cases = [
        ([source, str(tmp_path / "a"), "--to", "dcp", "--max-file-size", "1GB"],
         "--max-file-size applies only when converting to safetensors"),
        ([source, str(tmp_path / "b"), "--tag", "global_step9"],
         "global_step9: no such DeepSpeed checkpoint directory"),
        ([str(FIXTURES / "zero2" / "expected.safetensors"), str(tmp_path / "c"), "--tag", TAG],
         "--tag applies only to DeepSpeed checkpoints"),
        ([str(FIXTURES / "zero2" / "expected.safetensors"), str(tmp_path / "d"), "--to",
          "safetensors"], "converts to dcp only"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["--json", "convert", *argv, "--no-progress"]) == 2, argv
        assert message in json.loads(capsys.readouterr().out)["error"], argv
    assert not any(tmp_path.iterdir())
    capsys.readouterr()
    assert main(["convert", "--help"]) == 0
    assert "--tag" in capsys.readouterr().out


def _copy(stage: int, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / f"zero{stage}", tmp_path / f"zero{stage}"))


def test_a_truncated_optim_states_file_is_named(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(2, tmp_path)
    bad = root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=str(bad)):
        read_zero_checkpoint(root)
    code = main(["--json", "convert", str(root), str(tmp_path / "out"), "--no-progress"])
    assert code == 2 and bad.name in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


class _RunsCode:
    """A pickle that would run a command when loaded by a plain unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_file_naming_another_class_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    root = _copy(3, tmp_path)
    path = root / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    marker = tmp_path / "ran"
    state["lr_scheduler"] = _RunsCode(marker)
    torch.save(state, path)
    with pytest.raises(CheckpointError,
                       match=rf"{path.name}: cannot read it .*names (posix|nt)\.system"):
        read_zero_checkpoint(root)
    assert not marker.exists()


def test_a_missing_rank_is_named(tmp_path: Path) -> None:
    root = _copy(3, tmp_path)
    (root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"partition_count says 2 .* 1 optim-states"):
        read_zero_checkpoint(root)


def test_a_file_without_the_expected_key_names_file_and_key(tmp_path: Path) -> None:
    root = _copy(2, tmp_path)
    path = root / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    del state["param_shapes"]
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt: no key "
                                              r"'param_shapes'"):
        read_zero_checkpoint(root)


def test_partitions_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    """A model-states file from another model than the optim-states files."""
    root = _copy(3, tmp_path)
    path = root / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    first = next(iter(state["param_shapes"][0]))
    state["param_shapes"][0][first] = torch.Size([1, 1])
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"fp32_flat_groups hold .* param_shapes give"):
        read_zero_checkpoint(root)


def test_a_tag_never_leads_out_of_the_checkpoint(tmp_path: Path) -> None:
    root = _copy(2, tmp_path)
    shutil.copytree(root / TAG, tmp_path / "elsewhere")
    (root / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match=r"latest names the tag '\.\./elsewhere'"):
        read_zero_checkpoint(root)
    with pytest.raises(CheckpointError, match=r"given the tag '\.\.'"):
        read_zero_checkpoint(root, tag="..")
    assert read_zero_checkpoint(root, tag=TAG).stage == 2


def test_not_a_deepspeed_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a DeepSpeed ZeRO checkpoint"):
        read_zero_checkpoint(tmp_path)


@pytest.mark.distributed
def test_a_mismatched_model_names_the_keys() -> None:
    [message, _] = run_ranks(f"{WORKERS}:load_into_another_model", 2,
                             args=(str(FIXTURES / "zero2"),))
    assert message.startswith(KeyMismatchError.__name__), message
    assert "tok_embeddings.weight" in message or "output.weight" in message, message


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_fresh_checkpoints_of_installed_deepspeed_read_as_it_held(tmp_path: Path,
                                                                   stage: int) -> None:
    """The fixtures' maker, run now: DeepSpeed (if installed) trains and saves on 2 gloo
    ranks, and the reader rebuilds what DeepSpeed's accessors give."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install deepspeed); the committed "
                    "fixtures are tested without it")
    from tests.deepspeed_checkpoint_workers import write_fixture, write_mixed_fixture

    write_fixture(str(tmp_path / "fresh"), stage)
    _assert_reads_as_deepspeed_held(tmp_path / "fresh")
    write_mixed_fixture(str(tmp_path / "mixed"), stage)
    _assert_mixed_reads_as_deepspeed_held(tmp_path / "mixed")
