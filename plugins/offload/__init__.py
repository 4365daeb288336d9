"""Offload: optimizer state to NVMe files, streamed through the step unit by unit.

DeepSpeed's ZeRO-Infinity ``offload_optimizer: {device: nvme, nvme_path: ...}``: the
optimizer state of each FSDP2 unit lives in a file under ``path`` between steps, and
the step reads, updates, writes and drops one unit at a time
(:class:`~.optimizer.OffloadedOptimizer`), so host memory holds about one unit's state.
The plan's optimizer is the user's own torch optimizer; the plugin wraps it::

    plan = ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()).use(MetaInit()).use(
        Offload(path="/nvme/offload"))
    model = plan.apply(model)
    optimizer = plan.plugin("offload").wrap(torch.optim.AdamW(model.parameters()), model)

Parameters and optimizer state to CPU (DeepSpeed's ``offload_param: {device: cpu}`` and
``offload_optimizer: {device: cpu}``) is FSDP2's own ``offload = "cpu"``
(``CPUOffloadPolicy``: parameters, gradients and the optimizer step on the host): one
way to say it, so this plugin refuses ``"cpu"`` and names that option (CP954).

It claims no mesh dim and acts in no stage: the state files belong to the optimizer,
which exists only after the plan is applied.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    CodeRange,
    Finding,
    Plugin,
    Rule,
    Severity,
    has_data_parallel,
    hookimpl,
    int_option,
)

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plugin import PlanView

    from .optimizer import OffloadedOptimizer

RULES = (
    Rule("CP951", Severity.ERROR, "optimizer state to NVMe without a path",
         "give path = a directory on the NVMe device (DeepSpeed's nvme_path)",
         "[mesh]\n\n[[plugins]]\nname = \"offload\"\noptimizer = \"nvme\"\n"),
    Rule("CP952", Severity.ERROR, "the offload path is not a directory",
         "create the directory (on every node) before training, or fix the path",
         "[mesh]\n\n[[plugins]]\nname = \"offload\"\npath = \"/nvme/no-such-dir\"\n"),
    Rule("CP953", Severity.ERROR, "the offload path is not writable",
         "make the directory writable by the training processes, or choose another",
         "[mesh]\n\n[[plugins]]\nname = \"offload\"\npath = \"/proc/sys\"\n"),
    Rule("CP954", Severity.ERROR, "offload to CPU is FSDP2's offload option",
         "drop params/optimizer = \"cpu\" from offload and set offload = \"cpu\" on fsdp2 "
         "(parameters, gradients and the optimizer step on the host)",
         "[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\n"
         "name = \"offload\"\nparams = \"cpu\"\n"),
    Rule("CP955", Severity.ERROR, "an optimizer whose state offload cannot stream",
         "use a per-parameter optimizer (AdamW, Adam, SGD, ...), or FSDP2's offload = "
         "\"cpu\" for this one",
         "plan.plugin(\"offload\").wrap(torch.optim.LBFGS(model.parameters()), model)"),
    Rule("CP956", Severity.INFO, "no data-parallel plugin: offload units are parameter "
         "chunks", "nothing to do; unit_bytes sets the chunk size (add fsdp2 to stream "
         "its units)",
         "[mesh]\n\n[[plugins]]\nname = \"offload\"\npath = \"/nvme/offload\"\n"),
)

OPTIMIZER_DEVICES = ("nvme", "cpu")
PARAM_DEVICES = ("none", "cpu")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {', '.join(map(repr, choices))}"
                             f"; got {value!r}")
    return check


def _path(value: Any) -> str | None:
    return None if value is None else os.fspath(value)


@attrs.frozen
class Offload(Plugin):
    """Optimizer state to files under ``path`` (``optimizer = "nvme"``).

    Options: ``path`` (a directory, on each node; every rank makes its own directory
    inside it); ``optimizer`` (``"nvme"``; ``"cpu"`` is FSDP2's ``offload``, CP954);
    ``params`` (``"none"``; ``"cpu"`` is FSDP2's ``offload``, CP954); ``unit_bytes``
    (without FSDP2 units, the optimizer's parameters are cut into units of about this
    many bytes of parameters).
    """

    name: ClassVar[str] = "offload"
    rules: ClassVar[tuple[Rule, ...]] = RULES
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CP", 951, 959, "optimizer state offloaded to NVMe"),)

    path: str | None = attrs.field(default=None, converter=_path)
    optimizer: str = attrs.field(default="nvme", validator=_one_of(OPTIMIZER_DEVICES))
    params: str = attrs.field(default="none", validator=_one_of(PARAM_DEVICES))
    unit_bytes: int = int_option(64 << 20, low=1)

    @hookimpl
    def composer_par_validate_plan(self, plan: PlanView) -> list[Finding]:
        found = []
        for option, value in (("optimizer", self.optimizer), ("params", self.params)):
            if value == "cpu":
                found.append(Finding(
                    "CP954", f"offload {option} = \"cpu\": to the host is FSDP2's own "
                    "offload = \"cpu\" (CPUOffloadPolicy: parameters, gradients and the "
                    "optimizer step on the host); offload says NVMe only",
                    fix=f"drop {option} = \"cpu\" from offload and set offload = \"cpu\" on "
                    "fsdp2"))
        if self.optimizer == "nvme":
            found += self._path_findings()
        if not has_data_parallel(plan):
            found.append(Finding(
                "CP956", "no data-parallel plugin: offload cuts the optimizer's parameters "
                f"into units of about unit_bytes = {self.unit_bytes} bytes of parameters",
                fix="nothing to do; unit_bytes sets the unit size (with fsdp2 the units are "
                "its units)"))
        return found

    def _path_findings(self) -> list[Finding]:
        if self.path is None:
            return [Finding("CP951", "offload optimizer = \"nvme\" has no path: the state "
                            "files need a directory",
                            fix="give path = a directory on the NVMe device (DeepSpeed's "
                            "nvme_path)")]
        if not os.path.isdir(self.path):
            what = "does not exist" if not os.path.exists(self.path) else "is not a directory"
            return [Finding("CP952", f"offload path {self.path} {what} (on this machine)",
                            fix="create the directory on every node before training, or fix "
                            "the path")]
        if not os.access(self.path, os.W_OK | os.X_OK):
            return [Finding("CP953", f"offload path {self.path} is not writable by this "
                            "process",
                            fix="make the directory writable by the training processes, or "
                            "choose another")]
        return []

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> Any:
        from .estimate import estimate_part

        if self.optimizer != "nvme":
            return None
        return estimate_part(self.unit_bytes, layout, model, workload, stage)

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        return [("finalize", f"optimizer state of each FSDP unit in files under {self.path}, "
                 "streamed through the step unit by unit (wrap the optimizer: "
                 "plan.plugin(\"offload\").wrap(optimizer, model))")]

    # -- the optimizer ------------------------------------------------------------------

    def wrap(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None
             ) -> OffloadedOptimizer:
        """``optimizer`` with its state in files under ``path``, one file per unit.

        The units are ``model``'s FSDP2 units (each unit's own parameters), else the
        optimizer's parameters cut into runs of about ``unit_bytes`` bytes."""
        from .optimizer import OffloadedOptimizer
        from .units import chunk_units, fsdp_units

        if self.optimizer != "nvme" or self.path is None:
            raise ValueError(f"offload wraps optimizers with optimizer = \"nvme\" and a path "
                             f"(got optimizer={self.optimizer!r}, path={self.path!r})")
        units = fsdp_units(model) if model is not None else []
        if not units:
            units = chunk_units(optimizer, self.unit_bytes)
        names = ({id(p): n for n, p in model.named_parameters()} if model is not None
                 else {})
        return OffloadedOptimizer(optimizer, self.path, units, names,
                                  prefix=f"rank{_rank()}-")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = ["Offload"]
