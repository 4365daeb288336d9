"""The compress plugin on real gloo ranks: bytes over the replicate dim, training quality
over 200 steps, and bitwise identity when configured off -- with HSDP (x FSDP2, 2 x 2) and
with replicate-only plans (HSDP alone, 2 ranks).

Uses the ``parity`` fixture of composer_par.testing: ``parity.comm`` counts each rank's
collectives per mesh dim, ``parity.check`` trains side by side with a single-process
reference, which is what the uncompressed plan computes (the core's parity tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from composer_par.testing.parity import ParityCase

from compress_workers import SMALL, WIDE, compress, hsdp, replicate_only

LAYOUTS: dict[str, tuple[Callable[..., str], int]] = {
    "hsdp_x_fsdp2": (hsdp, 4),
    "replicate_only": (replicate_only, 2),
}


# -- bytes over dp_replicate ----------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bytes_over_the_replicate_dim(layout: str, parity: Any) -> None:
    """256 x 256 matrices, one training step, rank 0's collectives over dp_replicate.

    Wire bytes (what a rank sends, bandwidth-optimal algorithms) are the unit that compares
    an all-reduce with the all-to-all + all-gather that bf16 needs for fp32 accumulation;
    logical payload counts the all-reduce once and its two halves twice (so bf16 shows
    1.0x there, and PowerSGD, all-reduces only, the same ratio in both units).
    """
    make, world = LAYOUTS[layout]

    def measure(*extra: str) -> Any:
        return parity.comm(task=WIDE, plan=make(*extra), world_size=world, steps=1)

    fp32, bf16, powersgd = measure(), measure(compress("bf16")), measure(
        compress("powersgd", rank=4))
    dim = "dp_replicate"
    assert set(fp32.summary[0][dim]) == {"all_reduce"}
    assert set(bf16.summary[0][dim]) == {"all_to_all", "all_gather"}
    bf16_ratio = fp32.wire_bytes(dim) / bf16.wire_bytes(dim)
    powersgd_ratio = fp32.wire_bytes(dim) / powersgd.wire_bytes(dim)
    assert bf16_ratio >= 1.9, bf16_ratio
    assert powersgd_ratio >= 10, powersgd_ratio
    assert fp32.bytes(dim) / powersgd.bytes(dim) >= 10
    # Compression touches dp_replicate only: FSDP2's collectives over dp_shard are as before.
    if layout == "hsdp_x_fsdp2":
        assert bf16.summary[0]["dp_shard"] == fp32.summary[0]["dp_shard"]
        assert powersgd.summary[0]["dp_shard"] == fp32.summary[0]["dp_shard"]
    # The first step's loss does not depend on the reduction.
    assert bf16.losses == fp32.losses == powersgd.losses


# -- training quality over 200 steps --------------------------------------------------------

LLAMA = "composer_par.testing.tasks:llama"
# (method, layout, task, lr, tolerance). The MLP (64 x 64 weights) is quick but easy:
# even PowerSGD at rank 1 stays within 2% there. The small Llama tells methods apart
# (measured over 200 steps on 2 ranks, final loss / uncompressed: rank 4 with error
# feedback 1.06, rank 1 1.37, rank 4 without error feedback 5.4), so PowerSGD's bound is
# checked there too.
QUALITY = [
    ("bf16", "hsdp_x_fsdp2", SMALL, 0.05, 0.05),
    ("bf16", "replicate_only", SMALL, 0.05, 0.05),
    ("fp16", "replicate_only", SMALL, 0.05, 0.05),
    ("powersgd", "hsdp_x_fsdp2", SMALL, 0.05, 0.15),
    ("powersgd", "replicate_only", LLAMA, 0.5, 0.15),
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("method", "layout", "task", "lr", "tolerance"), QUALITY)
def test_final_loss_within_tolerance_of_uncompressed(method: str, layout: str, task: str,
                                                     lr: float, tolerance: float,
                                                     parity: Any) -> None:
    make, world = LAYOUTS[layout]
    # PowerSGD at rank 4 compresses the 64 x 64 weights (32 x 64 shards under FSDP2) once
    # the size threshold lets them through.
    options = {"rank": 4, "min_compress_numel": 1024} if method == "powersgd" else {}
    result = parity.check(task=task, plan=make(compress(method, **options)),
                          world_size=world, steps=200, lr=lr)
    final, reference = result.losses[-1], result.reference_losses[-1]
    last10 = sum(result.losses[-10:]) / sum(result.reference_losses[-10:])
    assert abs(final / reference - 1) <= tolerance, (final, reference)
    assert abs(last10 - 1) <= tolerance, last10
    assert final < 0.2 * result.losses[0], result.losses[::20]  # it did learn
    # Compression did act: the weights are not those of uncompressed training, on every
    # rank (each rank's view holds its own copy of what is replicated over dp_replicate).
    for rank in range(world):
        assert result.max_param_diff(rank)[1] > 1e-5, rank


# -- configured off: the plan without the plugin, bit for bit --------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_configured_off_is_bitwise_the_plan_without_it(layout: str, parity: Any) -> None:
    make, world = LAYOUTS[layout]

    def train(*extra: str) -> Any:
        case = ParityCase(task=SMALL, plan=make(*extra), world_size=world, steps=10, lr=0.05)
        return parity.check(case)

    off, without = train(compress("none")), train()
    assert off.losses == without.losses
    # Every rank's view: the parameters are replicated over dp_replicate, each rank's view
    # holds its own copy.
    assert len(off.rank_params) == len(without.rank_params) == world
    for rank, (a, b) in enumerate(zip(off.rank_params, without.rank_params, strict=True)):
        assert a.keys() == b.keys(), rank
        assert all(torch.equal(a[n], b[n]) for n in b), f"rank {rank}"
    without.assert_close()  # and that plan is at parity with one process
