"""Plans from other tools' configs: accelerate's YAML (FSDP1 and FSDP2, its
``parallelism_config`` with context and sequence parallelism), DeepSpeed's JSON, the
Hugging Face Trainer's ``--fsdp`` / ``--fsdp_config`` / ``--deepspeed``, transformers'
``DistributedConfig``, and FSDP1's Python arguments.

    result = import_config("accelerate_fsdp.yaml")
    print(result.text())            # the plan file
    print(result.report.format())   # a finding for every setting with no equal (CP9xx)
    plan = result.plan()

Every key of the source is either mapped to plan lines or reported with a rule code
that names what the plan does instead (:meth:`ImportResult.explain` lists both). The
mapping tables are in docs/migration.md. Nothing here imports torch, accelerate or
DeepSpeed. :func:`load_fsdp1` loads FSDP1's checkpoints (full and sharded state dicts,
with the optimizer) into a model a plan applied, to resume training; :func:`load_deepspeed`
DeepSpeed ZeRO's (stages 1-3, with the optimizer), read without DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_par.migrate.accelerate_config import read_accelerate
from composer_par.migrate.deepspeed_checkpoint import (
    DeepSpeedLoad,
    load_deepspeed,
    read_zero_checkpoint,
)
from composer_par.migrate.deepspeed_config import read_deepspeed
from composer_par.migrate.distributed_config import read_distributed
from composer_par.migrate.draft import Draft, ImportFailed, ImportResult, Mapped
from composer_par.migrate.fsdp1 import STRATEGIES, fsdp1_plan, strategy_name
from composer_par.migrate.fsdp1_checkpoint import Fsdp1Load, load_fsdp1
from composer_par.migrate.reading import (
    ACCELERATE,
    DEEPSPEED,
    KINDS,
    TRAINER,
    TRANSFORMERS,
    load_json,
    read_config,
    read_text,
)
from composer_par.migrate.trainer_args import read_trainer


def import_config(path: str | Path, *, kind: str | None = None, nodes: int | None = None,
                  world_size: int | None = None) -> ImportResult:
    """The plan of an accelerate config YAML, a DeepSpeed JSON or a transformers
    DistributedConfig JSON (``kind`` one of ``"accelerate"``, ``"deepspeed"``,
    ``"transformers"``; else told by the file). ``nodes`` and ``world_size`` override what
    the file says. Raises :class:`ImportFailed` when no plan can be written (CP901, CP902,
    CP913)."""
    path = Path(path)
    kind, data = read_config(path, kind)
    draft = Draft(kind)
    if kind == DEEPSPEED:
        read_deepspeed(draft, data)
        said = None
    elif kind == TRANSFORMERS:
        read_distributed(draft, data)
        said = None
    else:
        said = read_accelerate(draft, data, base=path.parent, nodes=nodes)
    return draft.finish(str(path), world_size if world_size is not None else said)


def import_trainer_args(*, fsdp: str | Sequence[str] | bool | None = None,
                        fsdp_config: Mapping[str, Any] | str | Path | None = None,
                        deepspeed: Mapping[str, Any] | str | Path | None = None,
                        bf16: bool = False, fp16: bool = False,
                        gradient_checkpointing: bool = False, nodes: int | None = None,
                        world_size: int | None = None) -> ImportResult:
    """The plan of the Trainer's ``--fsdp`` (a string such as ``"full_shard auto_wrap
    offload"``, or a list), ``--fsdp_config`` (a dict or a JSON file) and
    ``--deepspeed`` (a dict or a JSON file), with ``--bf16`` / ``--fp16`` /
    ``--gradient_checkpointing``."""
    draft = Draft(TRAINER)
    read_trainer(draft, fsdp=fsdp, fsdp_config=_json(fsdp_config),
                 deepspeed=_json(deepspeed), bf16=bf16, fp16=fp16,
                 gradient_checkpointing=gradient_checkpointing, nodes=nodes)
    given = [f"--fsdp {fsdp!r}" if fsdp else "", "--deepspeed" if deepspeed else ""]
    return draft.finish("Trainer " + " ".join(g for g in given if g), world_size)


def import_distributed_config(config: Any, *, world_size: int | None = None) -> ImportResult:
    """The plan of transformers' ``DistributedConfig`` (the object, its ``to_dict()``, or
    the path of its JSON file or of a model's config.json holding one)."""
    if isinstance(config, (str, Path)):
        return import_config(config, kind=TRANSFORMERS, world_size=world_size)
    data = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(data, Mapping):
        from composer_par.migrate.reading import cannot

        raise cannot("DistributedConfig", f"a {type(config).__name__}, not a "
                     "DistributedConfig or its dict", "give DistributedConfig(...) or its "
                     "to_dict()")
    draft = Draft(TRANSFORMERS)
    read_distributed(draft, data)
    return draft.finish(f"DistributedConfig({_sizes(data)})", world_size)


def _sizes(data: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={data[k]}" for k in ("pp_size", "dp_replicate_size", "fsdp_size",
                                                "tp_size", "ep_size")
                     if isinstance(data.get(k), int) and data[k] > 1) or "one device"


def _json(value: Mapping[str, Any] | str | Path | None) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value
    path = Path(value)
    data = load_json(read_text(path), str(path))
    if not isinstance(data, Mapping):
        from composer_par.migrate.reading import cannot

        raise cannot(str(path), f"{path} holds a {type(data).__name__}, not a JSON object",
                     "give the config as a JSON object")
    return data


__all__ = ["ACCELERATE", "DEEPSPEED", "KINDS", "STRATEGIES", "TRAINER", "TRANSFORMERS",
           "DeepSpeedLoad", "Fsdp1Load", "ImportFailed", "ImportResult", "Mapped", "fsdp1_plan",
           "import_config", "import_distributed_config", "import_trainer_args",
           "load_deepspeed", "load_fsdp1", "read_zero_checkpoint", "strategy_name"]
