"""The Hugging Face Trainer's ``--fsdp`` / ``--fsdp_config`` / ``--deepspeed`` values as a
plan.

``--fsdp "full_shard auto_wrap offload"`` and ``--fsdp_config`` become accelerate's FSDP
settings exactly as ``TrainingArguments`` turns them into accelerate's FSDP plugin
(FSDP2 by default, ``fsdp_config {"version": 1}`` for FSDP1), then go through the
accelerate importer; ``--deepspeed ds.json`` through the DeepSpeed importer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from composer_par.migrate.accelerate_config import fsdp_version, read_fsdp
from composer_par.migrate.deepspeed_config import read_deepspeed
from composer_par.migrate.draft import Draft
from composer_par.migrate.fsdp1 import STRATEGIES, apply_precision, strategy_name

ITEMS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2",
         "offload", "auto_wrap")
# fsdp_config keys with no accelerate twin: XLA's FSDP.
XLA = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")


def _items(fsdp: str | Sequence[str] | bool) -> list[str]:
    if isinstance(fsdp, bool) or not isinstance(fsdp, (str, list, tuple)):
        return []
    return fsdp.split() if isinstance(fsdp, str) else [str(i) for i in fsdp]


def read_trainer(draft: Draft, *, fsdp: str | Sequence[str] | bool | None = None,
                 fsdp_config: Mapping[str, Any] | None = None,
                 deepspeed: Mapping[str, Any] | None = None, bf16: bool = False,
                 fp16: bool = False, gradient_checkpointing: bool = False,
                 nodes: int | None = None) -> None:
    """The Trainer's sharding arguments into ``draft``."""
    if deepspeed is not None:
        read_deepspeed(draft, deepspeed, prefix="--deepspeed ")
    elif fsdp:
        _fsdp(draft, fsdp, dict(fsdp_config or {}), nodes=nodes)
    else:
        draft.map("--fsdp", "(not given)", draft.dim("dp_replicate", -1), draft.use("hsdp"))
    for flag, on, precision in (("--bf16", bf16, "bf16"), ("--fp16", fp16, "fp16")):
        if on:
            apply_precision(draft, flag, True, precision)
    if gradient_checkpointing:
        draft.map("--gradient_checkpointing", True, draft.use("activation_checkpoint"))


def _fsdp(draft: Draft, fsdp: str | Sequence[str] | bool, config: dict[str, Any], *,
          nodes: int | None) -> None:
    # TrainingArguments accepts the keys with or without their fsdp_ prefix.
    config = {k.removeprefix("fsdp_"): v for k, v in config.items()}
    version = fsdp_version(draft, "--fsdp_config version", config.get("version", 2))
    accelerate: dict[str, Any] = {"fsdp_version": version}
    labels = {"fsdp_version": "--fsdp_config version"}
    if not isinstance(fsdp, (str, bool, list, tuple)):
        draft.refuse("CP902", "--fsdp", fsdp, "the Trainer's --fsdp is a string of options "
                     "or a list of them", "write e.g. \"full_shard auto_wrap\"")
    for item in _items(fsdp):
        label = f"--fsdp {item}"
        name = strategy_name(item)
        if item not in ITEMS:
            draft.refuse("CP902", "--fsdp", item, "not an --fsdp option of the Trainer",
                         f"use {', '.join(ITEMS)}")
        elif name is not None and version == 2 and name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            draft.refuse("CP902", "--fsdp", item, "the Trainer accepts it with FSDP1 only "
                         "(fsdp_config version 1)", "give --fsdp_config '{\"version\": 1}', "
                         "or use full_shard (with the plan's hsdp for hybrid sharding)")
        elif name is not None:
            accelerate.setdefault("fsdp_reshard_after_forward",
                                  STRATEGIES[name].reshard if version == 2 else name)
            labels["fsdp_reshard_after_forward"] = label
        elif item == "offload":
            accelerate.setdefault("fsdp_offload_params", True)
            labels["fsdp_offload_params"] = label
        else:  # auto_wrap: the Trainer wraps by its default policy anyway
            draft.map(label, True)
    for key, value in config.items():
        if key in XLA:
            if value:
                draft.find("CP908", f"--fsdp_config {key}", value, "XLA's FSDP has no equal "
                           "here", "leave it out")
            else:
                draft.map(f"--fsdp_config {key}", value)
            continue
        if key == "version":
            continue  # read above, shown as fsdp_version
        if key == "cpu_offload":
            key, value = "offload_params", value
        if key == "transformer_layer_cls_to_wrap" and not isinstance(value, str):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                draft.refuse("CP902", f"--fsdp_config {key}", value, "the Trainer takes "
                             "class names (a string or a list of strings)",
                             "write e.g. [\"LlamaDecoderLayer\"]")
                continue
            value = ",".join(value)
        if key == "min_num_params" and not value:
            draft.map(f"--fsdp_config {key}", value)  # the Trainer's default: no size wrap
            continue
        labels[f"fsdp_{key}"] = f"--fsdp_config {key}"
        accelerate[f"fsdp_{key}"] = value
    read_fsdp(draft, accelerate, {}, nodes=nodes,
              label=lambda key: labels.get(key, f"--fsdp_config {key.removeprefix('fsdp_')}"))
