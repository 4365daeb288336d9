"""How long a step takes: compute, the communication nothing hides, and a pipeline's
bubble; from it tokens per second per device and model FLOPs utilization (MFU).

* **compute**: the model's FLOPs per rank (:mod:`.compute`) and those the plugins add
  (recomputation), the matmuls at the throughput the device achieves in the matmul
  dtype (the plan's, or a plugin's such as float8) and attention at that of the
  activations' dtype (:mod:`.devices`);
* **communication**: each collective's time (:mod:`.timing`); those that run behind
  compute (overlap ``"compute"``: FSDP2's prefetched all-gathers and its
  reduce-scatters, a replicate all-reduce in backward, a pipeline's sends) show only by
  what they exceed the compute by; the others (overlap ``"none"``: tensor parallelism's
  activation collectives, an all-to-all whose output the next op waits for) add up;
* **bubble**: a pipeline's idle share ``b`` stretches the busy time to ``busy / (1-b)``.

MFU is the model's FLOPs per rank (no recomputation) over the step time and the
device's dense 16-bit peak, as torchtitan and Meta's Llama 3 report it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from composer_par.estimate.compute import StepFlops
from composer_par.estimate.devices import Device
from composer_par.estimate.parts import ComputeTerm
from composer_par.estimate.timing import DimTraffic


@attrs.frozen
class StepTime:
    """One step's predicted time on one rank (the slowest, with a pipeline)."""

    device: Device
    flops: StepFlops
    extra_flops: float  # per rank: what the plugins add (recomputation)
    compute_seconds: float
    exposed_seconds: float  # communication nothing hides
    overlapped_seconds: float  # communication that may run behind compute
    bubble: float
    matmul_dtype: str

    @property
    def hidden_seconds(self) -> float:
        """The communication compute hides."""
        return min(self.overlapped_seconds, self.compute_seconds)

    @property
    def busy_seconds(self) -> float:
        return (self.compute_seconds + self.exposed_seconds
                + max(0.0, self.overlapped_seconds - self.compute_seconds))

    @property
    def seconds(self) -> float:
        if self.bubble >= 1:
            return float("inf")
        return self.busy_seconds / (1 - self.bubble)

    @property
    def idle_seconds(self) -> float:
        """The seconds a pipeline's bubble leaves each rank idle."""
        return self.seconds - self.busy_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.flops.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_second / self.flops.world

    @property
    def mfu(self) -> float:
        """Model FLOPs per rank over the step time and the device's dense 16-bit peak."""
        peak = self.device.peak("bfloat16") * 1e12
        return self.flops.per_rank / (self.seconds * peak) if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device.to_dict(), "matmul_dtype": self.matmul_dtype,
                "tokens_per_step": self.flops.tokens,
                "flops_per_token": self.flops.per_token,
                "model_flops_per_rank": self.flops.per_rank,
                "extra_flops_per_rank": self.extra_flops,
                "compute_seconds": self.compute_seconds,
                "exposed_communication_seconds": self.exposed_seconds,
                "overlapped_communication_seconds": self.overlapped_seconds,
                "hidden_communication_seconds": self.hidden_seconds,
                "bubble": self.bubble, "idle_seconds": self.idle_seconds,
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "tokens_per_second_per_device": self.tokens_per_second_per_device,
                "mfu": self.mfu}


def step_time(
    device: Device, flops: StepFlops, extra: Sequence[ComputeTerm],
    traffic: Sequence[DimTraffic], *, dtype: str, matmul_dtype: str, bubble: float = 0.0,
) -> StepTime:
    """The step time of a rank computing ``flops`` (and ``extra``) and sending
    ``traffic`` (see the module docstring)."""
    matmul_rate = device.achieved(matmul_dtype, matmul_dtype) * 1e12
    attention_rate = device.achieved(dtype, matmul_dtype) * 1e12
    # a forward is a third of a forward and backward
    extra_matmul = sum(t.flops + t.forward_share * flops.matmul_per_rank / 3 for t in extra)
    extra_other = sum(t.attention_share * flops.attention_per_rank / 3 for t in extra)
    compute = ((flops.matmul_per_rank + extra_matmul) / matmul_rate
               + (flops.attention_per_rank + extra_other) / attention_rate)
    overlapped = sum(t.overlapped_seconds for t in traffic)
    exposed = sum(t.exposed_seconds for t in traffic)
    return StepTime(device, flops, extra_matmul + extra_other, compute, exposed, overlapped,
                    bubble, matmul_dtype)


__all__ = ["StepTime", "step_time"]
