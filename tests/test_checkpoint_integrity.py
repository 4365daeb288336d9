"""Integrity: every file of a step is digested in its commit and checked on use; names read
from indexes and metadata stay inside their directory; inputs are read with bounds; and
the smaller refusals (a corrupt info file, a truncating dtype, a full disk)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_par import LoadCheckpoint, LoadSafetensors, MeshSpec, ParallelPlan
from composer_par import checkpoint as ck
from composer_par.checkpoint import steps
from composer_par.checkpoint.errors import CheckpointError, CorruptFileError
from composer_par.checkpoint.integrity import _aligned, digest_ranges
from composer_par.checkpoint.safetensors_io import read_header, save_file
from composer_par.checkpoint.sources import WeightsSource
from composer_par.cli.main import main
from composer_par.findings import PlanError
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import assert_every_rank
from tests import checkpoint_io_workers as workers
from tests.test_checkpoint_dist import assert_bitwise
from tests.test_checkpoint_io import _trained, assert_same, meta_model, reference, state


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A committed step of a trained model and its optimizer (one shard file)."""
    model, optimizer = _trained()
    return ck.save(tmp_path / "ckpt", model, optimizer, step=3)


def flip(path: Path, at: int, count: int = 4) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    model = reference(seed=9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), state(model)


# -- digests -------------------------------------------------------------------------------


def test_the_commit_records_every_file_and_a_clean_step_verifies(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = json.loads((saved / steps.MARKER).read_text())
    assert record["digest"] == "crc32"
    assert set(record["files"]) == {".metadata", "__0_0.distcp", "composer_par.json",
                                    "rng/rank-00000.safetensors"}
    shard = record["files"]["__0_0.distcp"]
    assert shard["size"] == (saved / "__0_0.distcp").stat().st_size
    # Every stored chunk starts and ends on a segment boundary (a loader checks exactly what
    # it reads), and the digests taken as the file was written are what reading it gives.
    metadata = pickle.loads((saved / ".metadata").read_bytes())
    chunks = [(i.offset, i.length) for i in metadata.storage_data.values()]
    manifest = steps.read_manifest(saved)
    assert manifest is not None
    written = manifest.files["__0_0.distcp"]
    assert _aligned(written, chunks) and len(written.segments) >= len(chunks)
    assert written == digest_ranges(saved / "__0_0.distcp",
                                    [(o, n) for o, n, _ in written.segments])
    assert ck.verify(saved) == []
    code, out, _ = cli(["inspect", str(saved), "--verify"], capsys)
    assert code == 0 and "commit: committed and verified: every byte of its 4 file(s)" in out
    code, out, _ = cli(["inspect", str(saved.parent), "--verify", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["steps"][0]["state"] == "verified"


def test_digests_do_not_depend_on_torch_s_own_crcs(tmp_path: Path) -> None:
    """With torch.save's per-record CRC-32 switched off, the save hashes the tensor bytes
    itself; the digests still match the files, and a flipped byte is still found."""
    from torch.serialization import get_crc32_options, set_crc32_options

    model, optimizer = _trained()
    previous = get_crc32_options()
    set_crc32_options(False)
    try:
        directory = ck.save(tmp_path, model, optimizer, step=1)
    finally:
        set_crc32_options(previous)
    assert ck.verify(directory) == []
    flip(directory / "__0_0.distcp", 5000)
    assert "differ from what was committed" in ck.verify(directory)[0]


def test_the_crc32_used_is_zlib_s_function_computed_by_zlib_ng() -> None:
    """The digests are zlib's CRC-32, whatever computes them: zlib-ng's (the declared
    dependency, several times faster) must give zlib's values, for small inputs (hashed
    holding the GIL) and large ones, and continued across pieces."""
    import random
    import zlib

    from zlib_ng import zlib_ng

    from composer_par.checkpoint import integrity

    assert integrity.crc32 is zlib_ng.crc32
    rng = random.Random(5)
    for size in (0, 1, 5 * 1024 - 1, 5 * 1024 + 1, 3 * 2**20 + 7):
        data = rng.randbytes(size)
        assert integrity.crc32(data) == zlib.crc32(data), size
        cut = size // 3
        assert integrity.crc32(data[cut:], integrity.crc32(data[:cut])) == zlib.crc32(data)


def test_a_checkpoint_digested_by_zlib_itself_loads_and_verifies(saved: Path) -> None:
    """A commit record written by an older version (stdlib zlib's CRC-32) is read as it
    always was: every segment recomputed with zlib, the step still verifies and loads, and
    a flipped byte is still found."""
    import zlib

    from composer_par.checkpoint.integrity import FileRecord, Manifest

    manifest = steps.read_manifest(saved)
    assert manifest is not None
    files = {}
    for name, record in manifest.files.items():
        data = (saved / name).read_bytes()
        files[name] = FileRecord(record.size, tuple(
            (o, n, zlib.crc32(data[o:o + n])) for o, n, _ in record.segments))
    assert files == manifest.files
    steps.commit(saved, 3, Manifest(saved, files))
    assert ck.verify(saved) == []
    model, optimizer, _ = fresh()
    ck.load(saved, model, optimizer)
    flip(saved / "__0_0.distcp", 3000)
    model, optimizer, _ = fresh()
    with pytest.raises(CorruptFileError, match="differ from what was committed"):
        ck.load(saved, model, optimizer)


def _verify_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("composer-par-verify")]


def _wait_for_no_verify_thread() -> None:
    deadline = time.monotonic() + 10
    while _verify_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _verify_threads() == []


@pytest.mark.parametrize("prepared", ["none", "part"])
def test_chunks_not_checked_ahead_are_checked_before_they_are_read(
        saved: Path, prepared: str) -> None:
    """The checks start from the rank's own plan, before DCP exchanges the plans; a reader
    whose read plan holds chunks it did not check ahead (no plan prepared, or only part of
    it) checks those before reading them, and no checking thread or open file is left."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from composer_par.checkpoint.dcp import read_metadata
    from composer_par.checkpoint.errors import dcp_errors
    from composer_par.checkpoint.integrity import verifying_reader

    key = "model.layers.1.attention.wq.weight"
    metadata = read_metadata(saved)
    (chunk,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    flip(saved / "__0_0.distcp", chunk.offset + chunk.length // 2)
    manifest = steps.read_manifest(saved)
    assert manifest is not None
    model, _, before = fresh()
    reader = verifying_reader(saved, metadata, manifest)

    def prepare(plan: Any) -> Any:
        plan = FileSystemReader.prepare_local_plan(reader, plan)
        if prepared == "part":  # everything but the corrupt chunk
            reader._start(manifest, [i for i in plan.items if i.storage_index.fqn != key])
        return plan

    reader.prepare_local_plan = prepare
    open_files = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CorruptFileError, match=rf"__0_0\.distcp: bytes {chunk.offset}-.* "
                       rf"\({key}\) differ"), dcp_errors("loading"):
        dcp.load({"model": model.state_dict()}, storage_reader=reader, no_dist=True)
    assert torch.equal(state(model)["layers.1.attention.wq.weight"],
                       before["layers.1.attention.wq.weight"])
    _wait_for_no_verify_thread()
    assert len(os.listdir("/proc/self/fd")) == open_files


def test_checks_started_for_a_load_that_never_reads_end_by_themselves(saved: Path) -> None:
    """A load that fails after this rank's plan was made (another rank's plan, say) never
    reaches read_data: the checks started for it finish, close their files and end."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from composer_par.checkpoint.dcp import read_metadata
    from composer_par.checkpoint.integrity import verifying_reader

    metadata = read_metadata(saved)
    model, _, _ = fresh()
    open_files = len(os.listdir("/proc/self/fd"))
    reader = verifying_reader(saved, metadata, steps.read_manifest(saved))
    reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"model": model.state_dict()}, metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    assert plan.items and reader.checker is not None
    _wait_for_no_verify_thread()
    assert len(os.listdir("/proc/self/fd")) == open_files


def test_flipped_bytes_in_a_shard_are_found_by_every_reader(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = saved / "__0_0.distcp"
    key = "model.layers.1.attention.wq.weight"
    metadata = pickle.loads((saved / ".metadata").read_bytes())
    (chunk,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    flip(shard, chunk.offset + chunk.length // 2)  # in the middle of that tensor's bytes
    model, optimizer, before = fresh()
    with pytest.raises(CorruptFileError, match=rf"__0_0\.distcp: bytes {chunk.offset}-"
                       rf"{chunk.offset + chunk.length - 1} \({key}\) differ from what was "
                       r"committed \(crc32"):
        ck.load(saved, model, optimizer)
    # The corrupt chunk was checked before DCP read it: its tensor kept its old value.
    assert torch.equal(state(model)[key.removeprefix("model.")], before[key.removeprefix(
        "model.")])
    with pytest.raises(CorruptFileError, match=r"__0_0\.distcp: bytes"):
        ck.load_checkpoint_weights(model, saved)
    with pytest.raises(CorruptFileError, match=r"__0_0\.distcp: bytes"):
        ParallelPlan(MeshSpec()).use(LoadCheckpoint(saved)).apply(meta_model())
    assert ck.verify(saved)[0].startswith(f"{shard}: bytes")
    code, out, _ = cli(["inspect", str(saved), "--verify", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and not data["ok"] and data["state"] == "corrupt"
    assert data["commit"].startswith(f"CORRUPT: {shard}: bytes")
    code, out, err = cli(["convert", str(saved), str(tmp_path / "st")], capsys)
    assert code == 2 and f"{shard}: bytes" in err and not (tmp_path / "st").exists()


def test_swapped_entries_in_the_metadata_are_found(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = saved / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    a, b = [k for k in metadata.storage_data if k.fqn.startswith("model.layers.0")][:2]
    metadata.storage_data[a], metadata.storage_data[b] = (metadata.storage_data[b],
                                                          metadata.storage_data[a])
    path.write_bytes(pickle.dumps(metadata))
    model, optimizer, before = fresh()
    with pytest.raises(CorruptFileError, match=r"\.metadata: bytes 0-\d+ differ from what was "
                       "committed"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    report = ParallelPlan(MeshSpec()).use(LoadCheckpoint(saved)).validate(meta_model())
    assert report.codes() == ["CP417"] and ".metadata: bytes 0-" in report.errors[0].message
    code, out, _ = cli(["inspect", str(saved)], capsys)  # found without --verify
    assert code == 1 and "commit: CORRUPT:" in out and ".metadata: bytes 0-" in out


def test_a_truncated_shard_names_the_file_and_inspect_says_corrupt(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = saved / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    model, optimizer, _ = fresh()
    with pytest.raises(CorruptFileError, match=rf"{shard}: truncated: {size - 100} bytes, "
                       rf"the commit recorded {size}"):
        ck.load(saved, model, optimizer)
    code, out, _ = cli(["inspect", str(saved.parent)], capsys)
    assert code == 1 and "step         3  CORRUPT" in out and "committed" not in out.split(
        "\n")[1]
    # A checkpoint committed before digests existed: the size check still names the file.
    record = json.loads((saved / steps.MARKER).read_text())
    (saved / steps.MARKER).write_text(json.dumps({"step": 3,
                                                  "committed_at": record["committed_at"]}))
    with pytest.raises(CorruptFileError, match=rf"{shard}: truncated: {size - 100} bytes, "
                       r"\.metadata places data up to byte"):
        ck.load(saved, model, optimizer)
    assert "no digests recorded" in ck.describe(saved)["commit"]


def test_a_corrupt_info_field_is_named_before_any_weight_is_set(saved: Path) -> None:
    path = saved / steps.INFO
    info = json.loads(path.read_text())
    info["world_size"] = "abc"
    path.write_text(json.dumps(info))
    model, optimizer, before = fresh()
    with pytest.raises(CorruptFileError, match=rf"{path}: field world_size must be a positive "
                       r"integer; found 'abc'"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    info["world_size"], info["optimizer"] = 1, {"param_groups": "x"}
    path.write_text(json.dumps(info))
    with pytest.raises(CorruptFileError, match="field optimizer must be an object with "
                       "param_groups"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)


def test_a_loaded_checkpoint_is_bitwise_and_files_added_later_are_not_trusted(
        saved: Path) -> None:
    model, optimizer, _ = fresh()
    ck.load(saved, model, optimizer)
    shutil.copy(saved / "__0_0.distcp", saved / "__1_0.distcp")
    metadata = pickle.loads((saved / ".metadata").read_bytes())
    assert {i.relative_path for i in metadata.storage_data.values()} == {"__0_0.distcp"}
    manifest = steps.read_manifest(saved)
    assert manifest is not None
    with pytest.raises(CorruptFileError, match=r"__1_0\.distcp: not part of the commit"):
        manifest.check_size("__1_0.distcp")


def test_convert_keeps_the_digests_and_checks_them(tmp_path: Path) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path / "ckpt", model, optimizer)
    ck.dcp_to_safetensors(tmp_path / "ckpt", tmp_path / "st")
    back = Path(ck.safetensors_to_dcp(tmp_path / "st", tmp_path / "dcp").destination)
    assert ck.verify(back) == []
    assert set(json.loads((back / steps.MARKER).read_text())["files"]) == {
        ".metadata", "__0_0.distcp", "composer_par.json"}


# -- a full disk -------------------------------------------------------------------------


@contextlib.contextmanager
def small_disk(directory: Path, size: str) -> Iterator[bool]:
    """A tmpfs of ``size`` mounted at ``directory`` (True), or False where mounting is not
    allowed (then the caller simulates the full disk)."""
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(directory)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], check=False)


def test_a_full_disk_is_said_plainly_and_the_previous_step_survives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _trained()
    with small_disk(tmp_path / "disk", "1m") as mounted:
        root = tmp_path / "disk" / "ckpt"
        first = ck.save(root, model, step=1)  # the model alone fits, with its optimizer not
        if not mounted:  # no permission to mount: a writer that finds no space
            from torch.distributed.checkpoint import FileSystemWriter

            def no_space(self: Any, plan: Any, planner: Any) -> Any:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(FileSystemWriter, "write_data", no_space)
        with pytest.raises(CheckpointError) as err:
            ck.save(root, model, optimizer, step=2)
        text = str(err.value)
        assert f"the disk is full at {root / 'step-000000002'}" in text, text
        assert "free space or write elsewhere" in text
        assert ck.latest(root) == first and [s for s, _, _ in ck.step_dirs(root)] == [1]
        loaded = reference(seed=9)
        ck.load(root, loaded)
        assert_same(state(loaded), state(model))


# -- convert --dtype ------------------------------------------------------------------------


def test_convert_refuses_a_truncating_dtype_and_keeps_integer_tensors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "w.safetensors"
    save_file({"w": torch.full((3,), 1.75), "count": torch.tensor([7, 300], dtype=torch.int64)},
              source)
    for dtype in ("int8", "uint8", "bool", "float8_e4m3fn"):
        code, out, err = cli(["convert", str(source), str(tmp_path / "out"), "--dtype", dtype,
                              "--json"], capsys)
        assert code == 2 and json.loads(out)["ok"] is False, dtype
        assert "float16, bfloat16, float32, float64" in err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="target dtype must be one of"):
        ck.safetensors_to_dcp(source, tmp_path / "out", dtype="int8")
    code, _, _ = cli(["convert", str(source), str(tmp_path / "out"), "--dtype", "bfloat16"],
                     capsys)
    assert code == 0
    back = tmp_path / "back"
    ck.dcp_to_safetensors(tmp_path / "out", back)
    entries = WeightsSource.open(back).entries
    assert entries["w"].dtype == "BF16" and entries["count"].dtype == "I64"
    assert main(["convert", "--help"]) == 0
    assert "float16, bfloat16, float32, float64" in " ".join(capsys.readouterr().out.split())


# -- paths stay inside ----------------------------------------------------------------------


def _index(directory: Path, weight_map: dict[str, str]) -> Path:
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("case", ["climbs", "absolute", "symlink"])
def test_index_entries_that_leave_the_directory_are_refused(
        tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    ref = state(reference())
    outside = tmp_path / "outside.safetensors"
    save_file(ref, outside)
    weights = tmp_path / "a" / "b"
    weights.mkdir(parents=True)
    name = {"climbs": "../../outside.safetensors", "absolute": str(outside),
            "symlink": "inner.safetensors"}[case]
    if case == "symlink":
        (weights / name).symlink_to(outside)
    index = _index(weights, dict.fromkeys(ref, name))
    expected = "absolute path" if case == "absolute" else "outside"
    with pytest.raises(CheckpointError, match=f"key .*: entry '{name}' .*{expected}"):
        WeightsSource.open(index)
    with pytest.raises(PlanError, match="CP417"):
        ParallelPlan(MeshSpec()).use(LoadSafetensors(index)).apply(meta_model())
    code, _, err = cli(["inspect", str(index)], capsys)
    assert code == 2 and name in err
    code, _, err = cli(["convert", str(weights), str(tmp_path / "out")], capsys)
    assert code == 2 and name in err and not (tmp_path / "out").exists()


def test_a_hugging_face_cache_snapshot_may_point_into_its_blobs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = state(reference())
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    (snapshot / "sub").mkdir(parents=True)
    keys = list(ref)
    for i, part in enumerate(("sub/part-1.safetensors", "part-2.safetensors")):
        save_file({k: ref[k] for k in keys[i::2]}, repo / "blobs" / f"blob{i}")
        (snapshot / part).symlink_to(repo / "blobs" / f"blob{i}")
    _index(snapshot, {k: ("sub/part-1.safetensors", "part-2.safetensors")[i % 2]
                      for i, k in enumerate(keys)})
    model = ParallelPlan(MeshSpec()).use(LoadSafetensors(snapshot)).apply(meta_model())
    assert_same(state(model), ref)
    code, out, _ = cli(["inspect", str(snapshot), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and {k["file"] for k in data["keys"]} == {"sub/part-1.safetensors",
                                                               "part-2.safetensors"}
    code, out, _ = cli(["inspect", str(snapshot)], capsys)
    assert "files: sub/part-1.safetensors, part-2.safetensors" in out


def test_metadata_naming_a_file_outside_the_step_is_refused(saved: Path,
                                                            tmp_path: Path) -> None:
    path = saved / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    shutil.copy(saved / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    path.write_bytes(pickle.dumps(metadata))
    # Recommit with digests of the edited metadata: the path check alone must refuse it.
    manifest = steps.read_manifest(saved)
    assert manifest is not None
    from composer_par.checkpoint.integrity import Manifest, digest_file

    files = dict(manifest.files)
    files[".metadata"] = digest_file(path)
    steps.commit(saved, 3, Manifest(saved, files))
    model, optimizer, before = fresh()
    with pytest.raises(CheckpointError, match=r"\.metadata: entry '\.\./\.\./elsewhere\.distcp' "
                       "resolves to .* outside"):
        ck.load(saved, model, optimizer)
    assert_same(state(model), before)
    assert "outside" in ck.describe(saved)["commit"]


# -- bounded reads ---------------------------------------------------------------------------


def test_a_huge_header_length_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    started = time.perf_counter()
    with pytest.raises(CorruptFileError, match="header length 1152921504606846976 does not fit"):
        read_header(path)
    assert time.perf_counter() - started < 1.0


def test_endless_inputs_are_refused_without_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors.index.json"
    os.mkfifo(fifo)  # a writer could feed it forever
    with pytest.raises(CorruptFileError, match="not a regular file"):
        WeightsSource.open(fifo)
    with pytest.raises(CorruptFileError, match="not a regular file"):
        read_header("/dev/zero")
    directory = tmp_path / "step-000000001"
    directory.mkdir()
    os.mkfifo(directory / steps.INFO)
    (directory / ".metadata").write_bytes(b"")
    with pytest.raises(CorruptFileError, match="not a regular file"):
        steps.read_info(directory)


# -- real ranks -------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_corrupt_shard_of_one_rank_is_named_on_every_rank(tmp_path: Path) -> None:
    views = run_ranks(workers.save_and_load_verified, 2, args=(str(tmp_path), "tp_2"),
                      timeout=300)
    # Each rank loaded what it saved, its copies of the replicated norms included.
    assert_every_rank(views, lambda got: assert_bitwise(got["saved"], got["loaded"],
                                                        "a verified load on 2 ranks"))
    directory = tmp_path / "step-000000001"
    shard = directory / "__1_0.distcp"
    flip(shard, 1000)  # in its first stored chunk, a model tensor
    for plugin in (False, True):
        errors = run_ranks(workers.load_expecting_error, 2,
                           args=(str(tmp_path), "tp_2", plugin), timeout=300)
        for rank, error in enumerate(errors):
            assert f"{shard}: bytes" in error and "differ from what was committed" in error, (
                plugin, rank, error)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_export_onto_a_full_disk_names_the_rank_and_the_disk_on_every_rank(
        tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "128k") as mounted:
        if not mounted:
            pytest.skip("mounting a small tmpfs needs root")
        target = tmp_path / "disk" / "out"
        errors = run_ranks(workers.export_expecting_error, 2, args=(str(target),),
                           timeout=200)
        assert errors[0] == errors[1], errors  # every rank says the same
        assert f"exporting to {target} failed, nothing written: rank " in errors[0]
        assert f"the disk is full at {target}" in errors[0]
        assert "another rank" not in errors[0]
        assert list((tmp_path / "disk").iterdir()) == []  # the staging directory is gone
