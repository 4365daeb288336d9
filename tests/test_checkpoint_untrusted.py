"""Files that are not what they claim to be: a ``.metadata`` pickle that would run code,
a named pipe or a directory where a file belongs, a missing or damaged RNG file, nested
or malformed JSON, and bad optimizer fields. Each is refused with an error naming the
file, before anything is written into the model, and nothing hangs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_par import LoadCheckpoint, MeshSpec, ParallelPlan
from composer_par import checkpoint as ck
from composer_par.checkpoint import claims, steps
from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.integrity import Manifest, digest_file
from composer_par.findings import PlanError
from tests.test_checkpoint_integrity import cli, fresh
from tests.test_checkpoint_io import _trained, assert_same, meta_model, state


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, optimizer = _trained()
    return ck.save(tmp_path / "ckpt", model, optimizer, step=3)


def recommit(directory: Path, *names: str) -> None:
    """Record the current digests of ``names`` in the commit, as someone who edits the
    files on purpose would."""
    manifest = steps.read_manifest(directory)
    assert manifest is not None
    files = dict(manifest.files)
    for name in names:
        files[name] = digest_file(directory / name)
    steps.commit(directory, steps.step_of(directory) or 0, Manifest(directory, files))


def no_verify_threads() -> bool:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if not any(t.name.startswith("composer-par-verify") for t in threading.enumerate()):
            return True
        time.sleep(0.02)
    return False


# -- a .metadata that would run code ---------------------------------------------------------


class _Payload:
    """Unpickling this writes ``marker``: what a malicious ``.metadata`` would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "code ran"))


def poison(directory: Path, marker: Path, *, digests: bool) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    if digests:
        recommit(directory, ".metadata")


def _digest_less(directory: Path) -> None:
    steps.commit(directory, steps.step_of(directory) or 0)  # a commit without digests


def _bare(directory: Path) -> None:
    # A DCP directory written by other tools: no info file, no commit marker.
    (directory / steps.INFO).unlink()
    (directory / steps.MARKER).unlink()
    (directory / ".claim").unlink(missing_ok=True)


@pytest.mark.parametrize("kind", ["re-digested", "digest-less", "bare"])
def test_a_metadata_pickle_that_would_run_code_runs_nothing_anywhere(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, optimizer = _trained()
    directory = ck.save(tmp_path / "ckpt", model, optimizer, step=3)
    if kind == "bare":
        directory = directory.rename(tmp_path / "bare")
        _bare(directory)
    elif kind == "digest-less":
        _digest_less(directory)
    marker = tmp_path / "marker"
    poison(directory, marker, digests=kind == "re-digested")
    refused = "refers to pathlib.Path.write_text"
    target, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=refused):
        ck.load(directory, target, optimizer)
    assert_same(state(target), before)
    with pytest.raises(PlanError, match=refused):
        ParallelPlan(MeshSpec()).use(LoadCheckpoint(directory)).apply(meta_model())
    commands = [["inspect", str(directory)], ["inspect", str(directory), "--verify"],
                ["convert", str(directory), str(tmp_path / "out"), "--no-progress"]]
    if kind != "bare":
        commands.append(["inspect", str(directory.parent)])  # the root: its latest step
    for argv in commands:
        code, out, err = cli(argv, capsys)
        assert code == 2, (argv, code, out, err)
        assert f"{directory / '.metadata'}: refers to pathlib" in err, (argv, err)
    assert not (tmp_path / "out").exists()
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_unpickler_reads_what_dcp_writes(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from composer_par.checkpoint import dcp_metadata

    tensors = {"w": torch.randn(3, 3, dtype=torch.bfloat16),
               "f8": torch.ones(2, dtype=torch.float8_e4m3fn),
               "c": torch.ones(2, 2, 1, 1).to(memory_format=torch.channels_last),
               "z": torch.ones(2, dtype=torch.complex64), "b": torch.ones(2, dtype=torch.bool)}
    dcp.save({**tensors, "bytes": b"xy", "n": 5}, checkpoint_id=tmp_path / "bare",
             no_dist=True)
    raw = (tmp_path / "bare" / ".metadata").read_bytes()
    assert dcp_metadata.loads(raw, "m") == pickle.loads(raw)
