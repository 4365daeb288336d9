"""A plan from what a trainer is configured with: a plan file, an accelerate config, a
DeepSpeed JSON, or the Trainer's own ``--fsdp`` / ``--fsdp_config`` / ``--deepspeed``
arguments (through :mod:`composer_par.migrate`), with the import's findings printed on
rank 0.

The arguments a plan replaces are cleared from the Trainer's (the plan shards, checkpoints
and casts instead), so the adapters' CP714 / CP717 / CP712 checks see nothing left to
refuse. An imported plan has no materializer: add ``MetaInit`` (or a loader) for a model
built on meta.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import transformers

    from composer_par.migrate import ImportResult
    from composer_par.plan import ParallelPlan

RAM_EFFICIENT_ENV = "FSDP_CPU_RAM_EFFICIENT_LOADING"
#: The Trainer's arguments an imported plan replaces, and the value that turns each off.
TRAINER_SETTINGS: dict[str, Any] = {
    "fsdp": "", "fsdp_config": None, "deepspeed": None, "bf16": False, "fp16": False,
    "gradient_checkpointing": False, "activation_checkpointing": False}


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def print_findings(result: ImportResult) -> None:
    """The import's findings on stderr, once (rank 0)."""
    if result.report.findings and _rank() == 0:
        print(f"composer_par: the plan imported from {result.source}:\n"
              f"{result.report.format()}", file=sys.stderr)


def load_plan(source: ParallelPlan | str | os.PathLike[str]) -> ParallelPlan:
    """``source`` as a plan: a plan as it is, a ``.toml`` plan file, or an accelerate
    config / DeepSpeed JSON imported (its findings printed)."""
    from composer_par.migrate import import_config
    from composer_par.plan import ParallelPlan

    if isinstance(source, ParallelPlan):
        return source
    path = Path(source)
    if path.suffix.lower() == ".toml":
        return ParallelPlan.from_toml(path)
    result = import_config(path)
    print_findings(result)
    return result.plan()


def plan_from_training_args(args: transformers.TrainingArguments
                            ) -> tuple[ParallelPlan, transformers.TrainingArguments,
                                       ImportResult]:
    """``(plan, args, result)``: the plan the Trainer's ``--fsdp`` / ``--fsdp_config`` /
    ``--deepspeed`` / ``--bf16`` / ``--fp16`` / ``--activation_checkpointing`` (or its old
    name ``--gradient_checkpointing``) describe
    (``--fsdp "full_shard auto_wrap offload"``: FSDP2 over every rank, resharded after
    forward, offloaded to CPU), ``args`` with those settings turned off (the plan does
    them now), and the import (``result.report`` its findings, printed on rank 0)."""
    from composer_par.migrate import import_trainer_args

    deepspeed = getattr(args, "deepspeed", None)
    result = import_trainer_args(
        fsdp=getattr(args, "fsdp", None) or None,
        fsdp_config=getattr(args, "fsdp_config", None) or None,
        deepspeed=(deepspeed if isinstance(deepspeed, (str, dict)) else
                   Path(deepspeed) if isinstance(deepspeed, os.PathLike) else None),
        bf16=bool(getattr(args, "bf16", False)), fp16=bool(getattr(args, "fp16", False)),
        gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False)
                                    or getattr(args, "activation_checkpointing", False)))
    print_findings(result)
    # TrainingArguments exported fsdp_config's cpu_ram_efficient_loading for accelerate;
    # the plan materializes instead (CP910 said how), so the variable goes with it.
    if (getattr(args, "fsdp_config", None) or {}).get("cpu_ram_efficient_loading") is not None:
        os.environ.pop(RAM_EFFICIENT_ENV, None)
    cleared = dataclasses.replace(args, **{k: v for k, v in TRAINER_SETTINGS.items()
                                           if hasattr(args, k)})
    return result.plan(), cleared, result


__all__ = ["TRAINER_SETTINGS", "load_plan", "plan_from_training_args", "print_findings"]
