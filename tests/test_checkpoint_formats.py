"""Checkpoint sources behind one protocol (composer_par.checkpoint.formats): DCP,
safetensors, DeepSpeed ZeRO and FSDP1 are each recognized, opened tensor by tensor,
converted, described and loaded through the same calls, so ``convert``, ``inspect``,
``compare`` and ``load`` take any of them without a branch per format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from composer_par import checkpoint as ck
from composer_par.checkpoint import formats
from composer_par.checkpoint.errors import CheckpointError
from composer_par.cli.main import main
from tests.deepspeed_checkpoint_workers import read_expected

DEEPSPEED = Path(__file__).parent / "data" / "deepspeed" / "zero2"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """One checkpoint of each format, with the tensors it holds."""
    model = _model()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(weights, tmp_path / "model.safetensors")
    torch.save(weights, tmp_path / "pytorch_model_fsdp.bin")  # FSDP1's FULL_STATE_DICT
    step = ck.save(tmp_path / "ckpt", model, step=1)
    expected, _ = read_expected(DEEPSPEED)
    return {"safetensors": (tmp_path / "model.safetensors", weights),
            "fsdp1": (tmp_path / "pytorch_model_fsdp.bin", weights),
            "dcp": (step, weights),
            "deepspeed": (DEEPSPEED, expected["saved"])}


def test_every_format_meets_the_protocol() -> None:
    found = formats.formats()
    assert [f.name for f in found] == ["deepspeed", "fsdp1", "dcp", "safetensors"]
    for fmt in found:
        assert isinstance(fmt, formats.CheckpointFormat), fmt.name
        assert fmt.targets


def test_each_format_is_recognized_and_read_tensor_by_tensor(
        sources: dict[str, tuple[Path, dict[str, torch.Tensor]]]) -> None:
    for name, (path, tensors) in sources.items():
        fmt = formats.detect(path)
        assert fmt.name == name, path
        with fmt.open(path) as source:
            assert set(source.specs) == set(tensors), name
            for key, value in tensors.items():
                read = source.read(key)
                assert tuple(source.specs[key].shape) == tuple(value.shape)
                assert torch.equal(read, value.to(read.dtype)), (name, key)
        described = fmt.describe(path, verify=False)
        checkpoint = described.get("checkpoint", described)
        # (DCP lists its stored keys: the model's under "model.")
        assert {k["name"].removeprefix("model.") for k in checkpoint["keys"]} == set(tensors)


def test_one_convert_call_for_every_format(
        sources: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    for name, (path, tensors) in sources.items():
        fmt = formats.detect(path)
        out = tmp_path / f"out-{name}"
        fmt.convert(path, out, to=fmt.targets[0], tag=None, dtype=None, max_file_bytes=None,
                    progress=None)
        with formats.open_source(out) as converted:
            assert set(converted.specs) == set(tensors), name
            key = sorted(tensors)[0]
            assert torch.equal(converted.read(key), tensors[key].to(converted.read(key).dtype))


def test_compare_and_inspect_take_another_tools_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare a DeepSpeed checkpoint with the weights DeepSpeed held (element by element)
    and inspect it: neither command has a branch for DeepSpeed."""
    expected, _ = read_expected(DEEPSPEED)
    save_file({k: v.contiguous() for k, v in expected["saved"].items()},
              tmp_path / "held.safetensors")
    assert main(["compare", str(DEEPSPEED), str(tmp_path / "held.safetensors"),
                 "--assert-equal", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameter_method"] == "elementwise" and data["equal"]
    assert main(["inspect", str(DEEPSPEED), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "deepspeed" and data["tensors"] == len(expected["saved"])


def test_one_load_call_for_every_format(
        sources: dict[str, tuple[Path, dict[str, torch.Tensor]]]) -> None:
    for name in ("safetensors", "fsdp1", "dcp"):
        path, tensors = sources[name]
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        formats.load(path, model)
        for key, value in model.state_dict().items():
            assert torch.equal(value, tensors[key]), (name, key)


def test_what_no_format_recognizes_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes\.txt: not a checkpoint of any known"):
        formats.detect(tmp_path / "notes.txt")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        formats.detect(tmp_path / "missing")
