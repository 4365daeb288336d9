"""Resumes through the trainer adapters, on 2 gloo ranks with an FSDP2 plan.

Lightning: a checkpoint taken mid-epoch (after a step, as ModelCheckpoint takes it) and a
run stopped mid-epoch by max_steps resume at the next batch of that epoch, the user's
ordinary DataLoader made resumable by the plan's strategy; every rank's parameters end
bitwise where the uninterrupted run's do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from composer_par.testing import run_ranks
from tests import resume_workers as workers


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_lightning_resumes_mid_epoch_at_the_next_batch(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    ranks = run_ranks(workers.lightning_resumes, 2, args=(str(tmp_path),), timeout=600)
    for result in ranks:
        whole = result["whole_losses"]
        assert result["whole_steps"] == workers.STEPS and len(whole) == workers.STEPS
        assert result["stopped_steps"] == workers.STOPPED_AT
        assert result["stopped_saved"] == [f"epoch=1-step={workers.STOPPED_AT}.ckpt"]
        for case, at in (("killed", workers.KILLED_AT), ("stopped", workers.STOPPED_AT)):
            resumed: dict[str, Any] = result[case]
            # the batches after the checkpoint's, in the epoch it was taken in
            assert resumed["losses"] == whole[at:], (case, resumed["losses"], whole)
            assert resumed["steps"] == workers.STEPS
            same = resumed["same"]
            assert same["count"] > 0 and same["bitwise"], (case, result["rank"], same)


# -- the resumable loader alone ---------------------------------------------------------


def _loader(batch_sampler: bool = False) -> Any:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

    from composer_par.data import ResumableLoader

    data = TensorDataset(torch.arange(20))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=2, rank=1,
                                                          shuffle=True, seed=0)
    if batch_sampler:
        class Batches(BatchSampler):  # a batch sampler of the user's own
            pass

        loader = DataLoader(data, batch_sampler=Batches(sampler, 2, drop_last=False))
    else:
        loader = DataLoader(data, sampler=sampler, batch_size=2)
    return ResumableLoader(loader), sampler


def _epoch(loader: Any, sampler: Any, epoch: int, count: int | None = None) -> list[list[int]]:
    sampler.set_epoch(epoch)
    batches = []
    for (batch,) in loader:
        batches.append(batch.tolist())
        if count is not None and len(batches) == count:
            break
    return batches


@pytest.mark.parametrize("batch_sampler", [False, True], ids=["batch_size", "batch_sampler"])
def test_a_loader_resumes_at_the_batch_after_its_saved_position(batch_sampler: bool) -> None:
    whole, whole_sampler = _loader(batch_sampler)
    expected = _epoch(whole, whole_sampler, 3)
    stopped, stopped_sampler = _loader(batch_sampler)
    _epoch(stopped, stopped_sampler, 3, count=2)
    state = stopped.state_dict()
    assert state == {"epoch": 3, "batches": 2}
    resumed, sampler = _loader(batch_sampler)
    resumed.load_state_dict(state)
    assert len(resumed) == len(expected) == 5
    assert _epoch(resumed, sampler, 3) == expected[2:]
    # the position is used once: the next pass over the epoch is whole again
    assert _epoch(resumed, sampler, 3) == expected


def test_a_position_of_another_epoch_or_at_an_epochs_end_starts_at_the_first_batch() -> None:
    loader, sampler = _loader()
    fresh = _epoch(loader, sampler, 4)
    loader.load_state_dict({"epoch": 3, "batches": 2})
    assert _epoch(loader, sampler, 4) == fresh
    loader.load_state_dict({"epoch": 4, "batches": 5})  # the whole epoch trained
    assert _epoch(loader, sampler, 4) == fresh
    assert loader.state_dict() == {"epoch": 4, "batches": 0}


# -- the Hugging Face Trainer ---------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_hf_trainer_and_the_plain_loop_resume_from_each_others_checkpoints(
        tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    ranks = run_ranks(workers.hf_resumes, 2, args=(str(tmp_path),), timeout=600)
    for result in ranks:
        assert result["whole_steps"] == workers.HF_STEPS
        # PlanTrainer's checkpoint-3 in the plain loop: every tensor of the model and the
        # AdamW state bitwise the Trainer's after step 3; the step and the scheduler's
        assert result["plain_loaded"] == [], result
        assert result["plain_step"] == result["plain_scheduler_step"] == workers.HF_SAVE_AT
        # checkpoint.save's directory in PlanTrainer: it continues at step 3, mid-epoch,
        # and ends bitwise where the uninterrupted run ends, its schedule too
        assert result["resumed_steps"] == workers.HF_STEPS
        assert result["resumed"] == [], (result["rank"], result["resumed"][:5])
        assert result["resumed_lr"]


def test_the_skipped_batches_are_not_read_with_torchs_batch_sampler() -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from composer_par.data import ResumableLoader

    class Counted(Dataset[Any]):
        def __init__(self) -> None:
            self.read: list[int] = []

        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> Any:
            self.read.append(i)
            return torch.tensor(i)

    data = Counted()
    loader = ResumableLoader(DataLoader(data, batch_size=3))
    loader.load_state_dict({"epoch": None, "batches": 2})
    assert [b.tolist() for b in loader] == [[6, 7, 8], [9, 10, 11]]
    assert data.read == [6, 7, 8, 9, 10, 11]
