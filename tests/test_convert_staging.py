"""``convert`` stages beside its destination: a convert killed mid-write leaves a hidden
staging directory that no reader takes for a checkpoint, and the next convert into the
same parent removes it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from composer_par import checkpoint as ck
from composer_par.checkpoint.convert import float_dtype
from composer_par.checkpoint.errors import CheckpointError, UncommittedError
from composer_par.cli.main import main
from tests.test_checkpoint_io import assert_same, reference, state, write_weights

REPO = Path(__file__).parent.parent

# Killed (SIGKILL: no handler, no clean-up runs) as the first tensor is written.
_KILLED_MID_WRITE = """
import os, signal, sys
from composer_par.checkpoint import convert

def die(done, total):
    os.kill(os.getpid(), signal.SIGKILL)

getattr(convert, sys.argv[1])(sys.argv[2], sys.argv[3], progress=die)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("direction", ["dcp_to_safetensors", "safetensors_to_dcp"])
def test_a_killed_convert_leaves_nothing_usable_and_the_next_one_removes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], direction: str) -> None:
    model = reference()
    if direction == "dcp_to_safetensors":
        source = ck.save(tmp_path / "ckpt", model, step=1)
    else:
        source = write_weights(tmp_path / "weights.safetensors", state(model))
    parent = tmp_path / "out"
    parent.mkdir()
    destination = parent / "converted"
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, direction, str(source),
                             str(destination)], cwd=REPO, capture_output=True, text=True,
                            timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    [left] = list(parent.iterdir())
    assert left.name.startswith(".converted.") and not destination.exists()
    # Before, its safetensors had their headers: inspect showed every tensor, unwritten
    # ones all zeros. Now no reader takes it for a checkpoint.
    capsys.readouterr()
    code = main(["--json", "inspect", str(left)])
    shown = capsys.readouterr()
    if direction == "dcp_to_safetensors":
        assert code == 2 and "model.safetensors" in shown.err, shown
        with pytest.raises(CheckpointError):
            ck.load_safetensors(reference(seed=9), left)
    else:
        assert json.loads(shown.out)["committed"] is False, shown
        with pytest.raises(UncommittedError):
            ck.load(left, reference(seed=9))
    # The next convert into the same parent removes the leftover and succeeds.
    assert main(["convert", str(source), str(destination), "--no-progress"]) == 0
    assert [p.name for p in parent.iterdir()] == ["converted"]
    fresh = reference(seed=9)
    if direction == "dcp_to_safetensors":
        ck.load_safetensors(fresh, destination)
    else:
        ck.load(destination, fresh)
    assert_same(state(fresh), state(model))


@pytest.mark.parametrize(("name", "why"), [
    ("int8", "a cast to an integer dtype truncates"),
    ("bool", "a cast to bool keeps only whether each value is zero"),
    ("float8_e4m3fn", "float8 weights need scales"),
    ("bf16", "write bfloat16 for bf16"),
    ("complex64", "weights convert only between these floating-point dtypes"),
])
def test_a_refused_dtype_says_why_for_its_kind(name: str, why: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # Before, every refusal said "a cast to an integer dtype truncates".
    with pytest.raises(ValueError) as err:
        float_dtype(name)
    assert why in str(err.value) and "truncates" not in str(err.value).replace(why, "")
    capsys.readouterr()
    assert main(["convert", "a", "b", "--dtype", name]) == 2
    assert why in capsys.readouterr().err
