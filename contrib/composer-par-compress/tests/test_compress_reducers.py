"""The reducers on their own: Gram-Schmidt, what PowerSGD compresses, and each reducer on
real gloo ranks against the exact mean (the ``ranks`` fixture of composer_par.testing)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from composer_par_compress.powersgd import compressible, orthonormalize

WORKERS = "compress_workers"


def test_orthonormalize_gives_orthonormal_columns() -> None:
    p = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    orthonormalize(p)
    torch.testing.assert_close(p.t() @ p, torch.eye(4), atol=1e-5, rtol=0)


def test_orthonormalize_zeroes_a_dependent_column_instead_of_amplifying_noise() -> None:
    base = torch.randn(30, 1, generator=torch.Generator().manual_seed(1))
    p = torch.cat([base, 2 * base, torch.randn(30, 1)], dim=1)
    orthonormalize(p)
    assert float(p[:, 1].abs().max()) == 0.0
    torch.testing.assert_close(float(p[:, 0].norm()), 1.0)
    torch.testing.assert_close(float(p[:, 0] @ p[:, 2]), 0.0, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("shape", "rank", "min_numel", "expected"), [
    ((256, 256), 4, 4096, True),       # 65536 numbers -> (256 + 256) * 4
    ((256,), 4, 0, False),             # vectors are sent as they are
    ((32, 32), 4, 4096, False),        # under the size threshold
    ((32, 32), 4, 256, True),
    ((8, 512), 4, 0, False),           # (8 + 512) * 4 * 2 > 4096: not 2x smaller
    ((64, 3, 3, 3), 2, 0, True),       # conv weights: rows x (the rest)
    ((0, 16), 1, 0, False),            # an empty FSDP shard
])
def test_what_powersgd_compresses(shape: tuple[int, ...], rank: int, min_numel: int,
                                  expected: bool) -> None:
    assert compressible(shape, rank, min_numel) is expected


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_bf16_sums_in_fp32_and_every_rank_gets_the_same_result(ranks: Any) -> None:
    results = ranks.run(f"{WORKERS}:low_precision_sums", 4, args=("bfloat16",), timeout=90)
    first = results[0]["result"]
    assert all(torch.equal(r["result"], first) for r in results)  # replicas stay identical
    torch.testing.assert_close(first, results[0]["exact"], rtol=2**-7, atol=2**-7)
    # 1 + 3 * 2^-8 summed in fp32 rounds once, to 1 + 2^-6; bf16 partial sums (what the
    # collective does with bf16 tensors) lose the 2^-8 terms in some summation orders.
    assert first[:4].tolist() == [1.015625] * 4
    assert results[0]["sixteen_bit_sum"][:4].tolist() != [1.015625] * 4


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fp16_close_to_the_exact_mean(ranks: Any) -> None:
    results = ranks.run(f"{WORKERS}:low_precision_sums", 2, args=("float16",), timeout=90)
    assert torch.equal(results[0]["result"], results[1]["result"])
    torch.testing.assert_close(results[0]["result"], results[0]["exact"], rtol=2**-10,
                               atol=2**-10)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_powersgd_error_feedback_loses_nothing_over_steps(ranks: Any) -> None:
    """sum of applied updates + mean of the ranks' final errors == sum of mean gradients:
    what compression holds back at one step is sent at a later one."""
    steps = 6
    results = ranks.run(f"{WORKERS}:powersgd_steps", 2, args=(2, steps), timeout=90)
    mine, other = results
    for step in range(steps):
        assert torch.equal(mine["applied"][step], other["applied"][step])
        # The bias is sent uncompressed: its mean is exact.
        torch.testing.assert_close(mine["applied"][step][960:], mine["mean"][step][960:])
    applied = sum(a[:960].view(24, 40) for a in mine["applied"])
    owed = (mine["error"][-1] + other["error"][-1]) / 2
    true = sum(m[:960].view(24, 40) for m in mine["mean"])
    torch.testing.assert_close(applied + owed, true, rtol=1e-5, atol=1e-5)
    # And rank 2 of a 24 x 40 random matrix does hold something back.
    assert float(owed.abs().max()) > 0.1


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_powersgd_is_exact_for_rank_one_gradients(ranks: Any) -> None:
    for result in ranks.run(f"{WORKERS}:powersgd_rank_one_is_exact", 2, timeout=90):
        assert result["max_error"] <= 1e-5 * result["scale"], result  # every rank's result
