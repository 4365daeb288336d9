"""The offload plugin: AdamW state in files under a directory, streamed unit by unit.

Training with it is bitwise equal (torch.equal) to the same plan without it, on one
process and on 2 gloo ranks under FSDP2 (every rank's parameters); a write that fails
(a file size limit, a removed directory) or a file changed behind its back is a clear
error; model + optimizer round-trip through composer_par.checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_par.plugins.offload.optimizer import OffloadedOptimizer, OffloadError
from composer_par.plugins.offload.store import OffloadStorageError

from composer_par import FSDP2, MeshSpec, Offload, ParallelPlan
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ParityCase, parity_result
from tests.test_fsdp2_parity import fsdp_plan

LLAMA = "composer_par.testing.tasks:llama"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _decay_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    # two groups (no weight decay on biases): a unit spans both
    lambda ps: torch.optim.AdamW(_decay_groups(list(ps)), lr=0.01, weight_decay=0.1),
], ids=["adamw", "sgd-momentum", "adam-amsgrad", "adamw-two-groups"])
@pytest.mark.parametrize("unit_bytes", [1024, 1 << 20], ids=["units-per-layer", "one-unit"])
def test_single_process_is_bitwise_equal(tmp_path: Path, make, unit_bytes: int) -> None:
    plain, offloaded = _model(), _model()
    reference = make(plain.parameters())
    # 1024: every Linear's weight is a unit of its own; 1 MiB: one unit, over both groups
    optimizer = Offload(path=str(tmp_path), unit_bytes=unit_bytes).wrap(
        make(offloaded.parameters()), offloaded)
    assert (len(optimizer.units) > 2) == (unit_bytes == 1024)
    _train(plain, reference, 6)
    _train(offloaded, optimizer, 6)
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b), name
    # Between steps no state is held in memory: every unit is a file.
    assert len(optimizer.inner.state) == 0
    assert len(list(optimizer.directory.glob("unit-*.safetensors"))) == len(optimizer.units)
    assert len(optimizer.state) == len(reference.state)
    # The files are safetensors: safetensors' own reader opens them.
    from safetensors import safe_open

    with safe_open(str(optimizer.store.path(0)), framework="pt") as f:
        assert f.metadata()["composer_par.offload"]
        # unit 0 holds the optimizer's first parameters: its index i is the state's i
        state = optimizer.state_dict()["state"]
        keys = list(f.keys())
        assert keys
        for key in keys:
            index, name = key.split("/")
            assert torch.equal(f.get_tensor(key), torch.as_tensor(state[int(index)][name]))
    ours, theirs = optimizer.state_dict(), reference.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for index, values in theirs["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(ours["state"][index][key]),
                               torch.as_tensor(value)), (index, key)


def test_load_state_dict_writes_units_and_close_removes_them(tmp_path: Path) -> None:
    model, twin = _model(), _model()
    reference = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, reference, 2)
    optimizer = Offload(path=str(tmp_path)).wrap(torch.optim.AdamW(twin.parameters()), twin)
    optimizer.load_state_dict(reference.state_dict())
    assert len(optimizer.inner.state) == 0
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.01
    # Training on from the loaded state matches the optimizer it came from.
    twin.load_state_dict(model.state_dict())
    _train(model, reference, 2)
    _train(twin, optimizer, 2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    directory = optimizer.directory
    assert directory.is_dir()
    optimizer.close()
    assert not directory.exists()


def _damage(unit: Path, how: str) -> None:
    data = bytearray(unit.read_bytes())
    if how == "flipped":
        data[-1] ^= 0xFF  # same size, one bit pattern changed
        unit.write_bytes(bytes(data))
    elif how == "truncated":
        unit.write_bytes(bytes(data[:-8]))
    elif how == "deleted":
        unit.unlink()
    elif how == "header":  # a changed length: the header claims more than the file holds
        data[:8] = (1 << 40).to_bytes(8, "little")
        unit.write_bytes(bytes(data))
    else:  # a named pipe in its place: refused at once, never waited on
        unit.unlink()
        os.mkfifo(unit)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "message"), [
    ("flipped", r"CRC-32 differs.*not taken for state"),
    ("truncated", r"\d+ bytes, \d+ written"),
    ("deleted", r"the file is gone"),
    ("header", r"header of \d+ bytes in a file of"),
    ("pipe", r"not a regular file"),
])
def test_damage_then_a_checkpoint_load_into_the_same_optimizer_restores_it(
        tmp_path: Path, how: str, message: str) -> None:
    """After any storage error the optimizer refuses to step until a checkpoint load
    into it refills its state; nothing is read from the damaged files, and training
    then goes on exactly as an optimizer that never lost its state."""
    from composer_par import checkpoint

    model, twin = _model(), _model()
    reference = torch.optim.AdamW(twin.parameters(), lr=0.01)
    (tmp_path / "nvme").mkdir()
    optimizer = Offload(path=str(tmp_path / "nvme")).wrap(
        torch.optim.AdamW(model.parameters(), lr=0.01), model)
    _train(model, optimizer, 2)
    _train(twin, reference, 2)
    root = tmp_path / "ckpt"
    checkpoint.save(root, model, optimizer, step=2)
    _damage(next(optimizer.directory.glob("unit-*.safetensors")), how)
    with pytest.raises(OffloadStorageError, match=message) as caught:
        _train(model, optimizer, 1)  # a backward, then the step that finds the damage
    assert "load the last checkpoint into this optimizer" in str(caught.value)
    with pytest.raises(OffloadStorageError, match="was lost"):
        optimizer.step()  # never a step from dropped state
    checkpoint.load(root, model, optimizer)  # the gradients of the failed step are left
    assert optimizer.lost is None
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    _train(model, optimizer, 2)
    _train(twin, reference, 2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_fresh_offloaded_optimizer_loads_without_zero_grad(tmp_path: Path) -> None:
    """A freshly wrapped optimizer of a model that still holds gradients (a backward ran,
    no zero_grad) takes a checkpoint: the stale gradients are dropped, not taken for
    state the checkpoint lacks."""
    from composer_par import checkpoint

    model = _model()
    optimizer = Offload(path=str(tmp_path)).wrap(
        torch.optim.AdamW(model.parameters(), lr=0.01), model)
    _train(model, optimizer, 2)
    root = tmp_path / "ckpt"
    checkpoint.save(root, model, optimizer, step=2)
    saved = optimizer.state_dict()
    other = _model()
    other(torch.randn(8, 16)).pow(2).mean().backward()  # gradients, never stepped
    fresh = Offload(path=str(tmp_path)).wrap(torch.optim.AdamW(other.parameters()), other)
    checkpoint.load(root, other, fresh)
    loaded = fresh.state_dict()
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][index][key]))


def test_a_read_only_store_is_an_offload_storage_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose file system turned read-only refuses the temporary file and its
    removal (EROFS) alike: the error is still OffloadStorageError, naming the cause, and
    once the store is writable again a checkpoint load into the same optimizer restores
    the state."""
    import errno

    from composer_par.plugins.offload import store

    from composer_par import checkpoint

    model = _model()
    optimizer = Offload(path=str(tmp_path)).wrap(
        torch.optim.AdamW(model.parameters(), lr=0.01), model)
    _train(model, optimizer, 1)
    root = tmp_path / "ckpt"
    checkpoint.save(root, model, optimizer, step=1)
    real_open, real_unlink = os.open, os.unlink
    inside = str(optimizer.directory)

    def read_only(real: Any) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            flags = args[0] if args else kwargs.get("flags", os.O_RDONLY)
            writes = real is real_unlink or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if str(path).startswith(inside) and writes:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(store.os, "open", read_only(real_open))
    monkeypatch.setattr(store.os, "unlink", read_only(real_unlink))
    with pytest.raises(OffloadStorageError, match="read-only file system") as caught:
        _train(model, optimizer, 1)
    assert caught.value.errno == errno.EROFS
    with pytest.raises(OffloadStorageError):  # still read-only: the load cannot store it
        checkpoint.load(root, model, optimizer)
    monkeypatch.undo()
    checkpoint.load(root, model, optimizer)
    assert optimizer.lost is None
    _train(model, optimizer, 1)


def test_the_directory_of_a_killed_run_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """A rank killed outright (SIGKILL: no finalizer runs) leaves its offload directory;
    the next optimizer wrapped over the same path removes it, and never the directory of
    a run that is still alive."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        from composer_par import Offload
        model = torch.nn.Linear(8, 8)
        optimizer = Offload(path={str(tmp_path)!r}).wrap(
            torch.optim.AdamW(model.parameters()), model)
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        print(optimizer.directory, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.read()  # alive until the test closes its stdin
    """)
    alive = subprocess.Popen([sys.executable, "-c", script, "live"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout is not None
        live = Path(alive.stdout.readline().strip())
        assert live.is_dir()
        killed = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True,
                                text=True, timeout=120)
        dead = Path(killed.stdout.strip())
        assert killed.returncode == -9 and dead.is_dir(), killed.stderr
        model = _model()
        optimizer = Offload(path=str(tmp_path)).wrap(torch.optim.AdamW(model.parameters()),
                                                     model)
        assert optimizer.removed_stale == [dead]
        assert not dead.exists() and live.is_dir()
        optimizer.close()
    finally:
        alive.communicate(input="", timeout=60)
    assert not live.exists()  # its own finalizer removed it when it ended


def test_a_removed_directory_is_a_clear_error(tmp_path: Path) -> None:
    model = _model()
    optimizer = Offload(path=str(tmp_path)).wrap(torch.optim.AdamW(model.parameters()), model)
    _train(model, optimizer, 1)
    import shutil

    shutil.rmtree(optimizer.directory)
    with pytest.raises(OffloadStorageError, match=r"unit 0 .*offload directory is gone") as e:
        _train(model, optimizer, 1)
    assert str(optimizer.directory) in str(e.value)


def test_a_full_device_is_a_clear_error_and_leaves_no_partial_file(tmp_path: Path) -> None:
    # A file size limit makes the write fail for real (EFBIG), as a full device would
    # (ENOSPC); in a child process, so the limit stays there.
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from composer_par import Offload
        from composer_par.plugins.offload.store import OffloadStorageError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        optimizer = Offload(path={str(tmp_path)!r}).wrap(
            torch.optim.AdamW(model.parameters()), model)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        model(torch.randn(2, 64)).sum().backward()
        try:
            optimizer.step()
        except OffloadStorageError as e:
            print("ERROR", e)
            print("LEFT", sorted(p.name for p in optimizer.directory.iterdir()
                                 if p.name != "CLAIM"))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "ERROR offload could not write the optimizer state of unit 0 (chunk 0)" in done.stdout
    assert "full or over a size limit" in done.stdout and "free space" in done.stdout
    assert "LEFT []" in done.stdout, done.stdout


def test_an_optimizer_it_cannot_stream_is_refused(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(OffloadError, match=r"ERROR CP955 \[offload\]: offload cannot stream LBFGS"):
        Offload(path=str(tmp_path)).wrap(torch.optim.LBFGS(model.parameters()), model)
    with pytest.raises(OffloadError, match="CP952"):
        OffloadedOptimizer(torch.optim.AdamW(model.parameters()), tmp_path / "missing", [])
    with pytest.raises(OffloadError, match=r"CP953 .*offload cannot make its directory"):
        OffloadedOptimizer(torch.optim.AdamW(model.parameters()), "/proc/sys", [])


class _GlobalState(torch.optim.SGD):
    """An optimizer that keeps state on a parameter it did not step."""

    def __init__(self, params, everything) -> None:
        super().__init__(params, lr=0.1)
        self.everything = list(everything)

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.state[self.everything[-1]]["calls"] = 1
        return super().step(closure)


def test_state_outside_the_unit_is_refused(tmp_path: Path) -> None:
    model = _model()
    params = list(model.parameters())
    optimizer = Offload(path=str(tmp_path), unit_bytes=1).wrap(
        _GlobalState(params, params), model)
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(OffloadError, match=r"CP955 .*_GlobalState keeps state on parameters"):
        optimizer.step()


def _plan(world: int, path: str | None, fsdp_options: str = "") -> str:
    offload = f'\n[[plugins]]\nname = "offload"\npath = "{path}"\n' if path else ""
    return fsdp_plan(world, fsdp_options) + offload


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fsdp_options", ["", 'offload = "cpu"'],
                         ids=["fsdp2", "fsdp2-cpu-offload"])
def test_fsdp2_with_nvme_offload_is_bitwise_equal(tmp_path: Path, fsdp_options: str) -> None:
    # With FSDP2's own CPU offload too (DeepSpeed's offload_param: cpu beside
    # offload_optimizer: nvme): both sides use it, only the optimizer state differs.
    plain = ParityCase(task=LLAMA, plan=_plan(2, None, fsdp_options), world_size=2, steps=5,
                       optimizer="adamw", lr=0.01, reference="accumulate")
    offloaded = ParityCase(task=LLAMA, plan=_plan(2, str(tmp_path), fsdp_options),
                           world_size=2, steps=5, optimizer="adamw", lr=0.01,
                           reference="accumulate")
    from tests.offload_workers import train_both

    results = run_ranks(train_both, 2, args=(plain, offloaded), timeout=240)
    for rank, result in enumerate(results):
        assert result["offload_losses"] == result["losses"], rank
        for name, value in result["params"].items():
            assert torch.equal(result["offload_params"][name], value), (rank, name)
        # FSDP2's units, one file each, and nothing held between steps.
        assert "root" in result["units"] and len(result["units"]) > 2, result["units"]
        assert len(result["files"]) == len(result["units"]), result["files"]
        assert result["held_in_memory"] == 0
    # And the offloaded run is at parity with single-process training.
    parity = parity_result(offloaded, [(r["offload_losses"], r["offload_params"])
                                       for r in results])
    parity.assert_close()
    assert parity.losses[-1] < parity.losses[0], parity.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_checkpoint_round_trip_of_the_offloaded_optimizer(tmp_path: Path) -> None:
    (tmp_path / "offload").mkdir()
    case = ParityCase(task=LLAMA, plan=_plan(2, str(tmp_path / "offload")), world_size=2,
                      optimizer="adamw", lr=0.01)
    from tests.offload_workers import checkpoint_round_trip

    results = run_ranks(checkpoint_round_trip, 2, args=(case, str(tmp_path / "ckpt")),
                        timeout=240)
    for rank, result in enumerate(results):
        assert result["same_state"], rank
        assert result["held_in_memory"] == 0, rank
        assert result["fresh_after"] == result["after"], rank
        for name, value in result["params"].items():
            assert torch.equal(result["fresh_params"][name], value), (rank, name)


def test_plan_describes_offload(tmp_path: Path) -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Offload(path=str(tmp_path)))
    assert plan.validate(world_size=2).ok
    assert "streamed through the step unit by unit" in plan.explain(world_size=2).format()


# -- validation -------------------------------------------------------------------------


def _codes(toml: str, world: int = 2) -> dict[str, str]:
    report = ParallelPlan.from_toml(toml).validate(world_size=world)
    return {f.code: f.message for f in report.findings}


def _offload_plan(options: str, fsdp2: bool = True) -> str:
    mesh = "[mesh]\ndp_shard = 2\n" if fsdp2 else "[mesh]\n"
    data_parallel = '\n[[plugins]]\nname = "fsdp2"\n' if fsdp2 else ""
    return f'{mesh}{data_parallel}\n[[plugins]]\nname = "offload"\n{options}\n'


def test_nvme_without_a_path_is_cp951() -> None:
    codes = _codes(_offload_plan('optimizer = "nvme"'))
    assert set(codes) == {"CP951"}
    assert "has no path" in codes["CP951"]


def test_a_missing_path_is_cp952(tmp_path: Path) -> None:
    codes = _codes(_offload_plan(f'path = "{tmp_path / "missing"}"'))
    assert set(codes) == {"CP952"}
    assert f"{tmp_path / 'missing'} does not exist" in codes["CP952"]
    (tmp_path / "file").write_text("")
    assert "is not a directory" in _codes(_offload_plan(f'path = "{tmp_path / "file"}"'))[
        "CP952"]


def test_a_path_not_writable_is_cp953(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # root writes through file modes: procfs refuses it too
    path = locked if not os.access(locked, os.W_OK) else Path("/proc/sys")
    codes = _codes(_offload_plan(f'path = "{path}"'))
    assert set(codes) == {"CP953"}, codes
    assert "not writable" in codes["CP953"]


def test_cpu_offload_is_fsdp2s_option_cp954(tmp_path: Path) -> None:
    codes = _codes(_offload_plan(f'path = "{tmp_path}"\nparams = "cpu"'))
    assert set(codes) == {"CP954"}
    assert 'offload = "cpu" on fsdp2' in ParallelPlan.from_toml(_offload_plan(
        f'path = "{tmp_path}"\noptimizer = "cpu"')).validate(world_size=2).format()


def test_without_data_parallel_units_are_chunks_cp956(tmp_path: Path) -> None:
    codes = _codes(_offload_plan(f'path = "{tmp_path}"', fsdp2=False), world=1)
    assert set(codes) == {"CP956"}
    assert "unit_bytes" in codes["CP956"]


def test_options_round_trip_and_bad_values_are_refused(tmp_path: Path) -> None:
    plan = ParallelPlan.from_toml(_offload_plan(f'path = "{tmp_path}"\nunit_bytes = 4096'))
    assert ParallelPlan.from_toml(plan.to_toml()).to_toml() == plan.to_toml()
    with pytest.raises(ValueError, match="optimizer must be one of 'nvme', 'cpu'"):
        Offload(optimizer="disk")


def test_the_step_holds_one_unit_at_a_time(tmp_path: Path) -> None:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer = Offload(path=str(tmp_path), unit_bytes=1024).wrap(inner, model)
    seen: list[set[int]] = []
    # Runs inside each unit's step, with that unit's state loaded.
    inner.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        {id(p) for p in opt.state}))
    _train(model, optimizer, 2)
    units = [u.ids for u in optimizer.units]
    assert len(seen) == 2 * len(units)
    assert seen[:len(units)] == [set()] * len(units)  # the first step starts from nothing
    assert seen[len(units):] == units  # then exactly the unit's own state, no other


def test_an_lr_scheduler_drives_the_offloaded_optimizer(tmp_path: Path) -> None:
    plain, offloaded = _model(), _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=0.01)
    optimizer = Offload(path=str(tmp_path)).wrap(
        torch.optim.AdamW(offloaded.parameters(), lr=0.01), offloaded)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step)
                 for o in (reference, optimizer)]
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for model, o, schedule in zip((plain, offloaded), (reference, optimizer), schedules,
                                      strict=True):
            model(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
            schedule.step()
    assert optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.01 / 8
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)


# -- the estimate ------------------------------------------------------------------------


def test_the_estimate_keeps_one_unit_s_optimizer_state_on_the_device(tmp_path: Path) -> None:
    """Offload states its own memory term: the states in files, but for the largest
    unit's that the step holds; FSDP2's offload = "cpu" takes parameters, gradients and
    states off the device."""
    from composer_par.estimate import ModelShape, Workload, estimate_plan

    model = ModelShape.from_numbers(params=1_000_000_000, layers=16, hidden=2048, heads=16)
    work = Workload(seq=2048, dtype="bf16")

    def est(*plugins: Any) -> Any:
        plan = ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2())
        for plugin in plugins:
            plan.use(plugin)
        return estimate_plan(plan, model, work, world_size=8)

    plain, offloaded = est(), est(Offload(path=str(tmp_path)))
    largest = max(g.local_numel(1, 8) for g in model.groups) * 12  # AdamW, mixed: 12 B
    assert offloaded.memory.optimizer == largest < plain.memory.optimizer
    assert (offloaded.memory.params, offloaded.memory.grads) == (plain.memory.params,
                                                                 plain.memory.grads)
    assert "offload: optimizer states in files between steps" in offloaded.format()
    host = estimate_plan(ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2(offload="cpu")), model,
                         work, world_size=8)
    assert (host.memory.params, host.memory.grads, host.memory.optimizer) == (0, 0, 0)
    assert host.memory.comm_buffers == plain.memory.comm_buffers
