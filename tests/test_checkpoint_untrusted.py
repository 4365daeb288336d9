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
from composer_par.checkpoint import steps
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


# -- a named pipe (or a directory) where a file belongs -------------------------------------


def unjam(fifo: Path, after: float = 10.0) -> None:
    """Should a reader block on ``fifo``, give it an empty write end after ``after``
    seconds, so that a test of code that hangs fails instead of hanging."""
    def run() -> None:
        time.sleep(after)
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader is waiting: nothing to unblock
            return
        os.close(fd)

    threading.Thread(target=run, daemon=True).start()


def fifo_in_place_of(path: Path) -> Path:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    os.mkfifo(path)
    unjam(path)
    return path


#: A whole load (state dicts, every check) on a machine shared with other work: well
#: below the time after which :func:`unjam` unblocks a reader that waited for the pipe.
LOAD_SECONDS = 5.0


def quickly(call: Callable[[], Any], expected: type[BaseException], match: str,
            limit: float = 1.0) -> None:
    """``call`` raises ``expected`` matching ``match`` within ``limit`` seconds."""
    started = time.monotonic()
    with pytest.raises(expected, match=match):
        call()
    assert time.monotonic() - started < limit


@pytest.mark.timeout(120)
@pytest.mark.parametrize("digests", [True, False])
def test_a_pipe_in_place_of_a_shard_is_named_at_once_and_no_thread_stays(
        digests: bool, saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not digests:
        _digest_less(saved)
    shard = fifo_in_place_of(saved / "__0_0.distcp")
    named = f"{shard}: not a regular file"
    model, optimizer, before = fresh()
    quickly(lambda: ck.load(saved, model, optimizer), CheckpointError, named, LOAD_SECONDS)
    assert_same(state(model), before)
    assert no_verify_threads()
    quickly(lambda: ParallelPlan(MeshSpec()).use(LoadCheckpoint(saved)).apply(meta_model()),
            CheckpointError, named, LOAD_SECONDS)
    assert no_verify_threads()
    quickly(lambda: ck.dcp_to_safetensors(saved, tmp_path / "out"), CheckpointError, named,
            LOAD_SECONDS)
    assert no_verify_threads()
    if digests:
        started = time.monotonic()
        code, out, _ = cli(["inspect", str(saved), "--verify"], capsys)
        assert code == 1 and named in out and time.monotonic() - started < LOAD_SECONDS


@pytest.mark.timeout(120)
def test_a_pipe_or_a_directory_where_weights_belong_is_named_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from composer_par.checkpoint.safetensors_io import save_file
    from composer_par.checkpoint.sources import WeightsSource

    weights = tmp_path / "w"
    weights.mkdir()
    save_file({"a": torch.ones(2)}, weights / "a.safetensors")
    # The weights file given directly, an entry of a weights directory, a file an index
    # names, the index itself; then a directory where a weights file belongs.
    given = fifo_in_place_of(tmp_path / "given.safetensors")
    quickly(lambda: WeightsSource.open(given), CheckpointError, f"{given}: not a regular")
    code, _, err = cli(["inspect", str(given)], capsys)
    assert code == 2 and f"{given}: not a regular file" in err
    entry = fifo_in_place_of(weights / "b.safetensors")
    quickly(lambda: WeightsSource.open(weights), CheckpointError, f"{entry}: not a regular")
    index = weights / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    quickly(lambda: WeightsSource.open(weights), CheckpointError, f"{entry}: not a regular")
    fifo_in_place_of(index)
    quickly(lambda: WeightsSource.open(index), CheckpointError, f"{index}: not a regular")
    index.unlink()
    entry.unlink()
    entry.mkdir()
    quickly(lambda: WeightsSource.open(weights), CheckpointError, f"{entry}: not a regular")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [steps.INFO, ".metadata", "rng/rank-00000.safetensors"])
def test_a_pipe_in_place_of_a_small_checkpoint_file_is_named_at_once(
        name: str, saved: Path) -> None:
    path = fifo_in_place_of(saved / name)
    model, optimizer, before = fresh()
    quickly(lambda: ck.load(saved, model, optimizer), CheckpointError, f"{path}: not a regular",
            LOAD_SECONDS)
    assert_same(state(model), before)


# -- the random state --------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["deleted", "truncated", "re-digested garbage"])
def test_a_missing_or_damaged_rng_file_is_an_error_or_with_warn_a_loud_warning(
        damage: str, saved: Path) -> None:
    rng = saved / "rng" / "rank-00000.safetensors"
    if damage == "deleted":
        rng.unlink()
    elif damage == "truncated":
        rng.write_bytes(rng.read_bytes()[:100])
    else:
        rng.write_bytes(b"\x10" + b"\x00" * 7 + b"{}" + b" " * 14)
        recommit(saved, "rng/rank-00000.safetensors")
    model, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=f"{rng}: .*missing_rng='warn'"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    with pytest.warns(RuntimeWarning, match=f"random state NOT restored: {rng}: .*bit-exact"):
        info = ck.load(saved, model, optimizer, missing_rng="warn")
    assert not info.rng_restored
    assert not torch.equal(state(model)["output.weight"], before["output.weight"])


def test_a_deleted_rng_file_of_a_digest_less_checkpoint_is_an_error(saved: Path) -> None:
    _digest_less(saved)
    rng = saved / "rng" / "rank-00000.safetensors"
    rng.unlink()
    model, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=f"{rng}: missing"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    assert ck.load(saved, model, optimizer, restore_random=False).rng_restored is False


# -- nested or malformed JSON ------------------------------------------------------------------


DOCUMENTS = {
    "nested 500 deep": '{"x": ' + "[" * 500 + "]" * 500 + "}",
    "nested 100000 deep": '{"x": ' + "[" * 100000 + "]" * 100000 + "}",
    "a 5000-digit number": '{"x": ' + "7" * 5000 + "}",
}


@pytest.mark.parametrize("document", list(DOCUMENTS))
@pytest.mark.parametrize("kind", [steps.MARKER, steps.INFO])
def test_malformed_json_in_a_checkpoint_file_is_named_with_exit_2(
        kind: str, document: str, saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = saved / kind
    path.write_text(DOCUMENTS[document])
    model, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=f"{path}: the .* is not valid JSON"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    for target in (saved, saved.parent):
        code, _, err = cli(["inspect", str(target)], capsys)
        assert code == 2 and f"{path}: the" in err and "not valid JSON" in err, (code, err)


@pytest.mark.parametrize("document", list(DOCUMENTS))
@pytest.mark.parametrize("kind", ["header", "index"])
def test_malformed_json_in_weights_is_named_with_exit_2(
        kind: str, document: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import struct

    from composer_par.checkpoint.sources import WeightsSource

    if kind == "header":
        path = tmp_path / "model.safetensors"
        raw = DOCUMENTS[document].encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    else:
        path = tmp_path / "model.safetensors.index.json"
        path.write_text(DOCUMENTS[document])
    with pytest.raises(CheckpointError, match=f"{path}: the .* is not valid JSON"):
        WeightsSource.open(tmp_path)
    code, _, err = cli(["inspect", str(path)], capsys)
    assert code == 2 and f"{path}: the" in err and "not valid JSON" in err, (code, err)


# -- optimizer fields ----------------------------------------------------------------------------


def _first_group(o: dict[str, Any]) -> dict[str, Any]:
    return o["param_groups"][0]  # type: ignore[no-any-return]


BAD_OPTIMIZER_FIELDS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "a group without params": (lambda o: _first_group(o).pop("params"),
                               r"param_groups\[0\]\.params must be a list"),
    "params not a list": (lambda o: _first_group(o).__setitem__("params", 5),
                          r"param_groups\[0\]\.params must be a list"),
    "a parameter in no group": (lambda o: _first_group(o)["params"].pop(),
                                r"param_groups: \S+"),
    "a bad tuple": (lambda o: o["scalars"].__setitem__("output.weight\x00q", {"__tuple__": 5}),
                    "cannot be read back"),
    "a bad tensor dtype": (lambda o: o["scalars"].__setitem__(
        "output.weight\x00q", {"__tensor__": 1, "dtype": "load"}), "unknown dtype 'load'"),
    "a string learning rate": (lambda o: _first_group(o).__setitem__("lr", "x"),
                               "hyperparameter lr must be a number"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIMIZER_FIELDS))
def test_bad_optimizer_fields_are_named_before_the_model_is_touched(case: str,
                                                                    saved: Path) -> None:
    _digest_less(saved)  # nothing but the fields' own checks stands in the way
    path = saved / steps.INFO
    info = json.loads(path.read_text())
    edit, expected = BAD_OPTIMIZER_FIELDS[case]
    edit(info["optimizer"])
    path.write_text(json.dumps(info))
    model, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=f"{path}: field optimizer: .*{expected}"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    # The optimizer holds at most the zero state torch's state-dict helpers give it.
    assert all(not v.any() for entry in optimizer.state.values()
               for k, v in entry.items() if k != "step")


# -- inspect --verify names the key ------------------------------------------------------------


def test_inspect_verify_names_the_key_of_a_damaged_chunk(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from composer_par.checkpoint.dcp import read_metadata
    from tests.test_checkpoint_integrity import flip

    shard = saved / "__0_0.distcp"
    chunks = read_metadata(saved).storage_data
    index, info = max(chunks.items(), key=lambda item: item[1].length)  # the largest chunk
    flip(shard, info.offset + info.length // 2)
    assert f"{shard}: bytes" in ck.verify(saved)[0] and f"({index.fqn})" in ck.verify(saved)[0]
    code, out, _ = cli(["inspect", str(saved), "--verify"], capsys)
    assert code == 1 and f"({index.fqn}) differ from what was committed" in out, out
    code, out, _ = cli(["inspect", str(saved.parent), "--verify", "--json"], capsys)
    assert code == 1 and f"({index.fqn}) differ" in json.loads(out)["checkpoint"]["commit"]


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_load_stays_ctrl_c_and_ends_the_check_thread(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_par.checkpoint import direct_read

    def interrupted(*args: Any, **kwargs: Any) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(direct_read, "read_into", interrupted)
    model, optimizer, _ = fresh()
    with pytest.raises(KeyboardInterrupt):
        ck.load(saved, model, optimizer)
    assert no_verify_threads()
