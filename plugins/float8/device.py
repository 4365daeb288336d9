"""Whether a device runs float8 matmuls in hardware: NVIDIA from SM89 (Ada, Hopper and
later), AMD from gfx942 (MI300). Elsewhere torchao emulates them (numerics only)."""

from __future__ import annotations

from typing import Any

#: The CUDA compute capability float8 matmuls need.
SM = (8, 9)


def float8_hardware(device: Any) -> tuple[bool, str]:
    """``(whether device runs float8 matmuls, the device in words)``."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False, f"a {device.type} device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if torch.version.hip is not None:
        arch = str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", ""))
        return arch.startswith(("gfx942", "gfx95")), f"{name} ({arch or 'ROCm'})"
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor) >= SM, f"{name} (SM{major}{minor})"


def where_it_runs() -> Any:
    """This rank's device when a process group is up (CUDA if it has one), else None: a
    plan validated away from its ranks does not know their devices."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["SM", "float8_hardware", "where_it_runs"]
