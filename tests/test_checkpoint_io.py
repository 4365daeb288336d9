"""Checkpoints and weights in one process: safetensors I/O, sources, commit markers, DCP
save/load, the loader plugins and their rules (CP414-CP419), export, convert, bad input."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from composer_par import LoadCheckpoint, LoadSafetensors, MeshSpec, MetaInit, ParallelPlan
from composer_par import checkpoint as ck
from composer_par.checkpoint import safetensors_io as sio
from composer_par.checkpoint import steps
from composer_par.checkpoint.errors import (
    CheckpointError,
    CorruptFileError,
    KeyMismatchError,
    UncommittedError,
    dcp_errors,
)
from composer_par.checkpoint.safetensors_io import read_header, save_file
from composer_par.checkpoint.sources import WeightsSource
from composer_par.findings import PlanError
from composer_par.plugin import Plugin, hookimpl
from composer_par.testing.tasks import LlamaTask, llama

#: Our Llama's names -> Hugging Face Llama's (model name -> file key), as a rename.
HF_RENAME = [
    [r"^tok_embeddings\.", "model.embed_tokens."],
    [r"^norm\.", "model.norm."],
    [r"^output\.", "lm_head."],
    [r"^layers\.", "model.layers."],
    [r"\.attention\.w([qkvo])\.", r".self_attn.\1_proj."],
    [r"\.attention_norm\.", ".input_layernorm."],
    [r"\.ffn_norm\.", ".post_attention_layernorm."],
    [r"\.feed_forward\.w1\.", ".mlp.gate_proj."],
    [r"\.feed_forward\.w3\.", ".mlp.up_proj."],
    [r"\.feed_forward\.w2\.", ".mlp.down_proj."],
]


def reference(seed: int = 3, task: LlamaTask = llama) -> torch.nn.Module:
    with torch.device("meta"):
        model = task.build()
    return ParallelPlan(MeshSpec()).use(MetaInit(seed=seed)).apply(model)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def meta_model(task: LlamaTask = llama) -> torch.nn.Module:
    with torch.device("meta"):
        return task.build()


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path)
    return path


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# -- safetensors I/O ------------------------------------------------------------------------


@pytest.mark.parametrize("scratch", [sio.SCRATCH_BYTES, 24])
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_read_region_equals_slicing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    scratch: int, file_dtype: torch.dtype) -> None:
    monkeypatch.setattr(sio, "SCRATCH_BYTES", scratch)  # 24 bytes: the piecewise paths
    full = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(0)).to(file_dtype)
    path = write_weights(tmp_path / "t.safetensors", {"x": full})
    entry = read_header(path).entries["x"]
    regions = [((0, 0, 0), (5, 6, 7)), ((2, 0, 0), (2, 6, 7)), ((0, 3, 0), (5, 3, 7)),
               ((1, 2, 3), (3, 2, 4)), ((4, 5, 6), (1, 1, 1)), ((0, 0, 0), (0, 6, 7))]
    fd = os.open(path, os.O_RDONLY)
    try:
        for offsets, lengths in regions:
            expected = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
            for out_dtype in (file_dtype, torch.float32):
                out = torch.empty(lengths, dtype=out_dtype)
                sio.read_region(fd, entry, offsets, lengths, out)
                assert torch.equal(out, expected.to(out_dtype)), (offsets, lengths, out_dtype)
            strided = torch.empty(tuple(reversed(lengths)), dtype=file_dtype).permute(2, 1, 0)
            sio.read_region(fd, entry, offsets, lengths, strided)
            assert torch.equal(strided, expected)
    finally:
        os.close(fd)


def test_files_we_write_are_read_by_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
               "c": torch.tensor([1, 2], dtype=torch.int64)}
    path = write_weights(tmp_path / "w.safetensors", tensors)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert_same({k: f.get_tensor(k) for k in f.keys()}, tensors)  # noqa: SIM118


def _raw_file(path: Path, header: Any, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("case, expected", [
    ("short", "shorter than the 8-byte header"),
    ("huge header", "does not fit the file"),
    ("not json", "not valid JSON"),
    ("nested too deep", "not valid JSON"),
    ("not an object", "not a JSON object"),
    ("dtype", "key w: unknown dtype 'F33'"),
    ("offsets", "key w: data_offsets span 8 bytes, but shape [3] of F32 needs 12"),
    ("truncated", "truncated: key w ends at byte"),
    ("overlap", "tensors v and w overlap"),
])
def test_corrupt_headers_name_the_file_and_key(tmp_path: Path, case: str, expected: str) -> None:
    path = tmp_path / "bad.safetensors"
    entry = {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    if case == "short":
        path.write_bytes(b"abc")
    elif case == "huge header":
        path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    elif case == "not json":
        _raw_file(path, b"{not json")
    elif case == "nested too deep":
        _raw_file(path, b"[" * 100_000)
    elif case == "not an object":
        _raw_file(path, [1, 2])
    elif case == "dtype":
        _raw_file(path, {"w": {**entry, "dtype": "F33"}}, bytes(12))
    elif case == "offsets":
        _raw_file(path, {"w": {**entry, "data_offsets": [0, 8]}}, bytes(12))
    elif case == "truncated":
        _raw_file(path, {"w": entry}, bytes(7))
    elif case == "overlap":
        _raw_file(path, {"v": entry, "w": {**entry, "data_offsets": [8, 20]}}, bytes(20))
    with pytest.raises(CorruptFileError) as err:
        read_header(path)
    assert str(path) in str(err.value) and expected in str(err.value)


def test_truncated_file_found_by_the_loader_too(tmp_path: Path) -> None:
    good = write_weights(tmp_path / "w.safetensors", state(reference()))
    data = good.read_bytes()
    good.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptFileError, match=r"w\.safetensors: truncated: key output\.weight"):
        WeightsSource.open(good)


# -- sources: file, directory, index ----------------------------------------------------------


def _split_with_index(directory: Path, tensors: dict[str, torch.Tensor], parts: int) -> None:
    keys = list(tensors)
    weight_map = {}
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {k: tensors[k] for k in keys[i::parts]}
        write_weights(directory / name, chunk)
        weight_map.update(dict.fromkeys(chunk, name))
    (directory / sio.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_directory_follows_its_index_not_every_file(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(2), "b": torch.ones(3), "c": torch.full((4,), 2.0)}
    _split_with_index(tmp_path, tensors, 2)
    # A stray file the index does not name (DCP's reader would load it too).
    write_weights(tmp_path / "optimizer.safetensors", {"a": torch.ones(2), "junk": torch.ones(1)})
    for path in (tmp_path, tmp_path / sio.INDEX_NAME):
        source = WeightsSource.open(path)
        assert set(source.entries) == {"a", "b", "c"}
        assert torch.equal(sio.read_tensor(source.entries["c"]), tensors["c"])
        assert len(source.files) == 2


def test_index_problems_name_the_file_and_key(tmp_path: Path) -> None:
    _split_with_index(tmp_path, {"a": torch.zeros(2), "b": torch.ones(3)}, 2)
    index = tmp_path / sio.INDEX_NAME
    data = json.loads(index.read_text())
    data["weight_map"]["z"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"key z is in model-00009-of-00009\.safetensors"):
        WeightsSource.open(index)
    data["weight_map"]["z"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"key z should be in .*model-00001-of-00002"):
        WeightsSource.open(tmp_path)
    index.write_text("{oops")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        WeightsSource.open(index)
    index.write_text("[]")
    with pytest.raises(CorruptFileError, match="safetensors index is not a JSON object"):
        WeightsSource.open(index)


def test_a_key_in_two_files_is_ambiguous(tmp_path: Path) -> None:
    write_weights(tmp_path / "a.safetensors", {"w": torch.zeros(2)})
    write_weights(tmp_path / "b.safetensors", {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"key w is in both .*a\.safetensors and .*b\."):
        WeightsSource.open(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        WeightsSource.open(tmp_path / "missing.safetensors")


# -- step directories and commit markers ----------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(child.stdout)


def write_claim(directory: Path, *, pid: int | None = None, host: str | None = None) -> None:
    """A claim of another job on this machine (``pid``: default, this process: live)."""
    from composer_par.checkpoint.claims import CLAIM, Job

    me = Job.current(world_size=2)
    data = attrs.evolve(me, id="other-job", pid=pid or os.getpid(),
                        pid_start=None if pid else me.pid_start,
                        host=host or me.host).to_dict()
    (directory / CLAIM).write_text(json.dumps(data))


def _fake_step(root: Path, step: int, committed: bool, claim: str | None = None) -> Path:
    """A step directory; ``claim``: None (no claim file), "dead" or "live" (its job)."""
    d = root / steps.step_name(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"")
    if claim is not None:
        write_claim(d, pid=dead_pid() if claim == "dead" else None)
    if committed:
        steps.commit(d, step)
    return d


def test_latest_skips_uncommitted_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    for step, committed, claim in [(1, True, None), (2, False, "dead"), (3, True, None),
                                   (4, True, None), (5, False, None), (0, False, "live")]:
        _fake_step(tmp_path, step, committed, claim)
    assert steps.latest(tmp_path) == tmp_path / "step-000000004"
    removed = steps.retain(tmp_path, keep_last=2, current=4)
    # Retention drops old committed steps, and unfinished ones whose writer is provably
    # gone; an unfinished step that a live job (0) or an unknown one may write stays.
    assert sorted(d.name for d in removed) == ["step-000000001", "step-000000002"]
    assert [(s, ok) for s, _, ok in steps.step_dirs(tmp_path)] == [(0, False), (3, True),
                                                                   (4, True), (5, False)]
    with pytest.raises(UncommittedError, match=r"step-000000005: uncommitted"):
        steps.resolve(tmp_path / "step-000000005")
    assert steps.resolve(tmp_path) == tmp_path / "step-000000004"
    with pytest.raises(CheckpointError, match="no committed checkpoint; uncommitted"):
        steps.resolve(_fake_step(tmp_path / "other", 7, False).parent)


def test_commit_marker_is_written_atomically(tmp_path: Path) -> None:
    steps.commit(tmp_path, 3)
    assert json.loads((tmp_path / steps.MARKER).read_text())["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [steps.MARKER]  # no temporary left


def test_dcp_checkpoint_exception_becomes_a_normal_exception() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    assert not issubclass(CheckpointException, Exception)  # why the bridge exists
    disk_full = r"saving x failed: rank 1: OSError: disk full"
    with pytest.raises(CheckpointError, match=disk_full), dcp_errors("saving x"):
        raise CheckpointException("boom", {1: (OSError("disk full"), None)})
    with pytest.raises(CheckpointError, match="model expects"), dcp_errors("loading y"):
        raise CheckpointException("boom", {0: (KeyMismatchError(
            "f", mismatched=[("w", "[2] float32", "[3] float32")]), None)})


# -- DCP save / load in one process ---------------------------------------------------------


def _trained(seed: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = reference(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        llama.loss(model, llama.batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_save_load_round_trip_with_optimizer_rng_extra_and_plan(tmp_path: Path) -> None:
    model, optimizer = _trained()
    plan = ParallelPlan(MeshSpec()).use(MetaInit(seed=3))
    torch.manual_seed(123)
    directory = ck.save(tmp_path, model, optimizer, extra={"epoch": 2, "seen": [1, 2]},
                        step=2, plan=plan)
    expected_draw = torch.rand(3)
    assert directory == tmp_path / "step-000000002" and ck.is_committed(directory)
    fresh = reference(seed=50)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    info = ck.load(tmp_path, fresh, fresh_opt)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG stream continues
    assert (info.step, info.extra, info.rng_restored) == (2, {"epoch": 2, "seen": [1, 2]}, True)
    assert info.plan == plan.to_toml()
    assert_same(state(fresh), state(model))
    a, b = optimizer.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for index, entry in a["state"].items():
        assert_same(entry, b["state"][index])
    # Only tensors go through DCP: nothing is read back with a pickle (torch.load of objects).
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = ck.dcp.read_metadata(directory)
    assert all(isinstance(m, TensorStorageMetadata)
               for m in metadata.state_dict_metadata.values())


def _grouped(model: torch.nn.Module, *, swapped: bool = False) -> torch.optim.Optimizer:
    """AdamW with decay and no-decay groups (matrices, then vectors; or the other way)."""
    matrices = [p for p in model.parameters() if p.ndim > 1]
    vectors = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": matrices, "lr": 0.01, "weight_decay": 0.1},
              {"params": vectors, "lr": 0.001, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups[::-1] if swapped else groups)


def test_optimizer_groups_load_by_parameter_or_are_refused(tmp_path: Path) -> None:
    """Each parameter keeps its saved group's settings, whatever the order of the groups;
    an optimizer whose one group held parameters of two saved groups is refused (torch
    would give it one saved group's lr and weight decay for all of them, silently)."""
    model = reference(3)
    optimizer = _grouped(model)
    llama.loss(model, llama.batch(0)).backward()
    optimizer.step()
    ck.save(tmp_path, model, optimizer)
    fresh = reference(5)
    swapped = _grouped(fresh, swapped=True)
    for group in swapped.param_groups:
        group["lr"] = 0.5
    ck.load(tmp_path, fresh, swapped)
    assert [(g["lr"], g["weight_decay"]) for g in swapped.param_groups] == [(0.001, 0.0),
                                                                          (0.01, 0.1)]
    one = reference(5)
    before = state(one)
    with pytest.raises(KeyMismatchError, match=r"optim\.param_groups\[0\]: the model "
                       r"expects its parameters in one group, .* has them in 2 groups"):
        ck.load(tmp_path, one, torch.optim.AdamW(one.parameters(), lr=0.5))
    assert_same(state(one), before)


def test_steps_are_fresh_directories_numbered_on(tmp_path: Path) -> None:
    model = reference()
    first = ck.save(tmp_path, model)
    assert first.name == "step-000000000"
    assert ck.save(tmp_path, model).name == "step-000000001"
    with pytest.raises(CheckpointError, match="already a committed checkpoint"):
        ck.save(tmp_path, model, step=1)
    # An unfinished save of the same step whose job is gone (a crash, then a restart) is
    # replaced; one without a claim is not (whoever wrote it may still be writing).
    partial = _fake_step(tmp_path, 5, committed=False, claim="dead")
    (partial / "garbage").write_text("x")
    assert ck.save(tmp_path, model, step=5, keep_last=2) == partial
    assert not (partial / "garbage").exists()
    assert [s for s, _, _ in ck.step_dirs(tmp_path)] == [1, 5]
    unclaimed = _fake_step(tmp_path, 6, committed=False)
    with pytest.raises(CheckpointError, match="step-000000006 is an unfinished save without "
                       "a claim"):
        ck.save(tmp_path, model, step=6)
    assert (unclaimed / ".metadata").exists()


def test_load_refuses_an_uncommitted_directory(tmp_path: Path) -> None:
    directory = ck.save(tmp_path, reference())
    (directory / steps.MARKER).unlink()
    model = reference(9)
    before = state(model)
    with pytest.raises(UncommittedError, match=r"step-000000000: uncommitted checkpoint"):
        ck.load(directory, model)
    with pytest.raises(CheckpointError, match="no committed checkpoint; uncommitted"):
        ck.load(tmp_path, model)
    assert_same(state(model), before)


def test_a_checkpoint_of_another_model_is_refused_naming_keys(tmp_path: Path) -> None:
    ck.save(tmp_path, reference())
    other = reference(task=LlamaTask(n_layers=3, dim=32))
    before = state(other)
    with pytest.raises(KeyMismatchError) as err:
        ck.load(tmp_path, other)
    text = str(err.value)
    assert "missing from" in text and "model.layers.2.attention.wq.weight" in text
    assert "model.tok_embeddings.weight: the model expects [256, 32] float32" in text
    assert "step-000000000 has [256, 64] float32" in text
    assert_same(state(other), before)
    same = reference()
    with pytest.raises(KeyMismatchError, match="optimizer state"):
        ck.load(tmp_path, same, torch.optim.SGD(same.parameters(), lr=0.1))


def test_load_reports_unexpected_keys_unless_not_strict(tmp_path: Path) -> None:
    model = reference()
    model.extra = torch.nn.Linear(2, 2)  # type: ignore[assignment]
    ck.save(tmp_path, model)
    smaller = reference(9)
    unexpected = r"not in the model: model\.extra\.weight, model\.extra\.bias"
    with pytest.raises(KeyMismatchError, match=unexpected):
        ck.load(tmp_path, smaller)
    ck.load(tmp_path, smaller, strict=False)
    assert_same(state(smaller), {k: v for k, v in state(model).items()
                                 if not k.startswith("extra")})


# -- the loader plugins in one process ------------------------------------------------------


def test_load_safetensors_with_hugging_face_names_and_an_index(tmp_path: Path) -> None:
    ref = state(reference())
    renamed = {ck.Rename(HF_RENAME).to_file(k): v for k, v in ref.items()}
    assert "model.layers.1.self_attn.k_proj.weight" in renamed
    _split_with_index(tmp_path, renamed, 3)
    plan = ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path, rename=HF_RENAME))
    assert plan.validate(meta_model()).ok
    model = plan.apply(meta_model())
    assert_same(state(model), ref)
    reference_buffers = dict(reference().named_buffers())  # RoPE tables recomputed
    assert_same(dict(model.named_buffers()), reference_buffers)
    report = plan.notes["load_safetensors_report"]
    assert len(report.loaded) == len(ref) and report.bytes_read == sum(
        v.numel() * v.element_size() for v in ref.values())


def test_bf16_file_into_fp32_model_and_back(tmp_path: Path) -> None:
    ref = state(reference())
    bf16 = {k: v.to(torch.bfloat16) for k, v in ref.items()}
    write_weights(tmp_path / "bf16.safetensors", bf16)
    model = ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path / "bf16.safetensors")).apply(
        meta_model())
    assert_same(state(model), {k: v.float() for k, v in bf16.items()})
    out = ck.export_safetensors(model, tmp_path / "out", dtype="bfloat16")
    again = {k: sio.read_tensor(e) for k, e in WeightsSource.open(out).entries.items()}
    assert_same(again, bf16)


def test_validation_finds_missing_unexpected_and_mismatched_keys(tmp_path: Path) -> None:
    ref = state(reference())
    broken = dict(ref)
    del broken["layers.0.attention.wq.weight"]
    broken["layers.0.attention.extra"] = torch.zeros(2)
    broken["norm.weight"] = torch.zeros(3)
    broken["output.weight"] = broken["output.weight"].to(torch.int32)
    write_weights(tmp_path / "w.safetensors", broken)
    model = meta_model()
    with pytest.raises(PlanError) as err:
        ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path / "w.safetensors")).apply(model)
    report = err.value.report
    assert sorted(set(report.codes())) == ["CP414", "CP415", "CP416"]
    text = str(err.value)
    assert "1 model key(s) are missing from" in text and "layers.0.attention.wq.weight" in text
    assert "not in the model: layers.0.attention.extra" in text
    assert "norm.weight: the model expects [64] float32" in text and "has [3] float32" in text
    assert "output.weight: the model expects [256, 64] float32" in text and "int32" in text
    assert all(p.is_meta for p in model.parameters())  # refused before anything changed


def test_unreadable_weights_are_cp417(tmp_path: Path) -> None:
    path = write_weights(tmp_path / "w.safetensors", state(reference()))
    path.write_bytes(path.read_bytes()[:-10])
    report = ParallelPlan(MeshSpec()).use(LoadSafetensors(path)).validate(meta_model())
    assert report.codes() == ["CP417"]
    assert "truncated: key output.weight" in report.errors[0].message
    report = ParallelPlan(MeshSpec()).use(LoadCheckpoint(tmp_path / "nope")).validate(
        meta_model())
    assert report.codes() == ["CP417"] and "no such checkpoint" in report.errors[0].message


class Scaled(torch.nn.Module):
    """Owns a non-persistent buffer and no reset_parameters: nothing can compute it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_buffer_nothing_provides_is_cp418(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = Scaled()
    write_weights(tmp_path / "w.safetensors", {"lin.weight": torch.ones(2, 2),
                                               "lin.bias": torch.zeros(2)})
    report = ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path / "w.safetensors")).validate(
        model)
    assert report.codes() == ["CP418"]
    assert "module <root> (Scaled) owns scale" in report.errors[0].message


def test_lossy_conversion_is_a_cp419_warning(tmp_path: Path) -> None:
    write_weights(tmp_path / "w.safetensors", state(reference()))
    with torch.device("meta"):
        model = llama.build().to(torch.bfloat16)
    plan = ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path / "w.safetensors"))
    report = plan.validate(model)
    assert report.ok and report.codes() == ["CP419"]
    assert "float32 in" in report.warnings[0].message and "bfloat16 model" in \
        report.warnings[0].message
    plan.apply(model)
    assert_same(state(model), {k: v.to(torch.bfloat16) for k, v in state(reference()).items()})


def test_not_strict_initializes_what_is_missing_and_skips_the_rest(tmp_path: Path) -> None:
    ref = state(reference(seed=3))
    partial = {k: v for k, v in ref.items() if not k.startswith("output.")}
    partial["unrelated"] = torch.zeros(1)
    write_weights(tmp_path / "w.safetensors", partial)
    plan = ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path / "w.safetensors",
                                                        strict=False, seed=3))
    model = plan.apply(meta_model())
    # Loaded keys from the file, the missing head initialized as MetaInit(seed=3) would.
    assert_same(state(model), ref)
    report = plan.notes["load_safetensors_report"]
    assert report.missing == ("output.weight",) and report.unexpected == ("unrelated",)


@attrs.frozen
class HFNames(Plugin):
    """A third-party plugin contributing the name mapping through the hook."""

    name = "hf_names"  # type: ignore[assignment]

    @hookimpl
    def composer_par_state_dict_adapter(self, plan: Any, model: Any) -> Any:
        return ck.Rename(HF_RENAME)


def test_a_plugin_contributes_the_name_mapping_through_the_hook(tmp_path: Path) -> None:
    ref = state(reference())
    write_weights(tmp_path / "hf.safetensors",
                  {ck.Rename(HF_RENAME).to_file(k): v for k, v in ref.items()})
    plan = ParallelPlan(MeshSpec()).use(HFNames()).use(LoadSafetensors(tmp_path / "hf.safetensors"))
    model = plan.apply(meta_model())
    assert_same(state(model), ref)
    exported = ck.export_safetensors(model, tmp_path / "out", plan=plan)
    names = set(WeightsSource.open(exported).entries)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names


def test_load_checkpoint_plugin_in_one_process(tmp_path: Path) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path, model, optimizer)
    plan = ParallelPlan(MeshSpec()).use(LoadCheckpoint(tmp_path))
    assert "load the model from DCP checkpoint" in plan.explain().format()
    loaded = plan.apply(meta_model())
    assert_same(state(loaded), state(model))


# -- export and convert ---------------------------------------------------------------------


def test_export_splits_with_an_index_and_refuses_an_existing_directory(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = reference()
    out = ck.export_safetensors(model, tmp_path / "out", max_file_bytes=50_000)
    index = json.loads((out / sio.INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == sorted(p.name for p in out.glob("*.safetensors"))
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        merged.update(load_file(out / name))
    assert_same(merged, state(model))
    with pytest.raises(CheckpointError, match="already exists"):
        ck.export_safetensors(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left behind


def test_convert_round_trip_and_nothing_half_written(tmp_path: Path) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path / "ckpt", model, optimizer)
    seen: list[tuple[int, int]] = []
    result = ck.dcp_to_safetensors(tmp_path / "ckpt", tmp_path / "st", progress=lambda d, t:
                                   seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == result.bytes
    back = ck.safetensors_to_dcp(tmp_path / "st", tmp_path / "dcp2")
    assert ck.is_committed(back.destination)
    loaded = ParallelPlan(MeshSpec()).use(LoadCheckpoint(tmp_path / "dcp2")).apply(meta_model())
    assert_same(state(loaded), state(model))
    # A corrupt source: an error naming it, and no destination or staging directory.
    bad = tmp_path / "st" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:-1])
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CorruptFileError, match=r"model\.safetensors: truncated"):
        ck.safetensors_to_dcp(tmp_path / "st", tmp_path / "dcp3")
    with pytest.raises(UncommittedError):
        ck.dcp_to_safetensors(_fake_step(tmp_path / "r", 1, False), tmp_path / "st2")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "r"])


def test_tied_weights_load_from_either_name_and_export_once(tmp_path: Path) -> None:
    def tied() -> torch.nn.Module:
        with torch.device("meta"):
            model = llama.build()
        model.output.weight = model.tok_embeddings.weight
        return model

    ref = state(reference())
    ref.pop("output.weight")  # as Hugging Face saves tied weights: once
    write_weights(tmp_path / "w.safetensors", ref)
    plan = ParallelPlan(MeshSpec()).use(LoadSafetensors(tmp_path / "w.safetensors"))
    assert plan.validate(tied()).ok
    model = plan.apply(tied())
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, ref["tok_embeddings.weight"])
    out = ck.export_safetensors(model, tmp_path / "out")
    assert set(WeightsSource.open(out).entries) == set(ref)
