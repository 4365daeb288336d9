"""The random state initialization draws from: one seed per module, from the plan's seed
and the module's name, so the values do not depend on the layout."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# What initialization on a device draws from: the devices ``fork_rng`` must save (the
# CPU's generator is always saved), and the generator to seed.
Rng = tuple[list[torch.device], torch.Generator]


def module_seed(seed: int, path: str) -> int:
    """A per-module seed that depends on the module's name only, not on the layout."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def rng_of(device: torch.device) -> Rng:
    """The random state that init ops on ``device`` draw from, and no other.

    ``torch.manual_seed`` would also seed every accelerator, lazily: each call queues a
    seeding per accelerator and records its stack, for every module, and the
    accelerators' states would change behind fork_rng, which saves only the devices it
    is given.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [device], torch.cuda.default_generators[index]
    return [], torch.random.default_generator


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Init ops on ``device`` draw from ``seed`` inside; the caller's random state is put
    back after."""
    devices, generator = rng_of(device)
    with torch.random.fork_rng(devices=devices):
        generator.manual_seed(seed)
        yield
