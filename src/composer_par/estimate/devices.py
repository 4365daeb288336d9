"""Device kinds: dense peak throughput per compute dtype, memory, and the throughput a
training step achieves on them.

The peaks are the vendors' datasheet figures for dense (not 2:4 sparse) tensor-core math:
``float32`` is TF32, ``bfloat16`` also stands for ``float16``, and ``float8`` falls back to
the 16-bit peak on a device without fp8 tensor cores. The throughput a step achieves is
:data:`ACHIEVED_SHARE` of the peak of the dtype the work runs in (override it with
``achieved_tflops``); docs/estimate.md says where the share comes from and what it leaves
out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from composer_par.estimate.errors import EstimateError

#: The share of a device's dense peak that a training step's math achieves, unless told.
ACHIEVED_SHARE = 0.4

#: The device the estimate assumes when none is named.
DEFAULT_DEVICE = "h100"


@attrs.frozen
class Device:
    """A device kind: dense peak TFLOP/s by compute dtype, and its memory in bytes."""

    name: str
    title: str
    peak_tflops: Mapping[str, float]
    memory: int
    # TFLOP/s the step's matmuls achieve, when given (else ACHIEVED_SHARE of the peak);
    # attention then runs at the same share of its dtype's peak.
    achieved_tflops: float | None = None

    def peak(self, dtype: str) -> float:
        """The dense peak of ``dtype``'s math (a 16-bit dtype's for one without a peak)."""
        key = {"float16": "bfloat16", "float64": "float32"}.get(dtype, dtype)
        return self.peak_tflops.get(key) or self.peak_tflops["bfloat16"]

    def achieved(self, dtype: str, matmul_dtype: str) -> float:
        """TFLOP/s of math in ``dtype`` when the matmuls run in ``matmul_dtype``."""
        share = ACHIEVED_SHARE
        if self.achieved_tflops is not None:
            share = self.achieved_tflops / self.peak(matmul_dtype)
        return share * self.peak(dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "peak_tflops": dict(self.peak_tflops),
                "memory": self.memory, "achieved_tflops": self.achieved_tflops,
                "achieved_share": None if self.achieved_tflops is not None
                else ACHIEVED_SHARE}


_GB = 10**9

DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("a100", "NVIDIA A100 SXM 80GB",
           {"float32": 156.0, "bfloat16": 312.0}, 80 * _GB),
    Device("h100", "NVIDIA H100 SXM 80GB",
           {"float32": 494.7, "bfloat16": 989.4, "float8": 1978.9}, 80 * _GB),
    Device("h800", "NVIDIA H800 SXM 80GB",
           {"float32": 494.7, "bfloat16": 989.4, "float8": 1978.9}, 80 * _GB),
    Device("h200", "NVIDIA H200 SXM 141GB",
           {"float32": 494.7, "bfloat16": 989.4, "float8": 1978.9}, 141 * _GB),
    Device("b200", "NVIDIA B200 180GB",
           {"float32": 1125.0, "bfloat16": 2250.0, "float8": 4500.0}, 180 * _GB),
)}


def device(name: str | Device | None, achieved_tflops: float | None = None) -> Device:
    """The preset ``name`` (:data:`DEVICES`; None: :data:`DEFAULT_DEVICE`), with the
    achieved throughput of its matmuls overridden when ``achieved_tflops`` is given."""
    if isinstance(name, Device):
        found = name
    else:
        key = (name or DEFAULT_DEVICE).lower()
        if key not in DEVICES:
            raise EstimateError(f"unknown device {name!r}; one of {', '.join(DEVICES)}")
        found = DEVICES[key]
    if achieved_tflops is not None:
        if isinstance(achieved_tflops, bool) or not achieved_tflops > 0:
            raise EstimateError(f"achieved TFLOP/s must be > 0; got {achieved_tflops!r}")
        found = attrs.evolve(found, achieved_tflops=float(achieved_tflops))
    return found


__all__ = ["ACHIEVED_SHARE", "DEFAULT_DEVICE", "DEVICES", "Device", "device"]
