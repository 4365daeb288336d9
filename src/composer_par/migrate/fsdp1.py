"""FSDP1's sharding strategies, wrap policies, mixed precision and CPU offload as plan
settings: the one table every importer (accelerate, the Trainer's ``--fsdp``, FSDP1's
Python arguments) goes through.

| FSDP1 strategy | mesh | plugins |
|---|---|---|
| ``FULL_SHARD`` | ``dp_shard = -1`` | fsdp2, ``reshard_after_forward = true`` |
| ``SHARD_GRAD_OP`` | ``dp_shard = -1`` | fsdp2, ``reshard_after_forward = false`` |
| ``HYBRID_SHARD`` | ``dp_replicate = nodes``, ``dp_shard = -1`` | hsdp + fsdp2 (true) |
| ``_HYBRID_SHARD_ZERO2`` | ``dp_replicate = nodes``, ``dp_shard = -1`` | hsdp + fsdp2 (false) |
| ``NO_SHARD`` | ``dp_replicate = -1`` | hsdp alone (replicates, DDP-like) |

FSDP1's hybrid strategies shard inside a node and replicate across nodes, so the
replicate size is the node count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from composer_par.migrate.draft import Draft, ImportResult, shown


@attrs.frozen
class Strategy:
    """What one FSDP1 strategy shards: ``shard`` (parameters, gradients and optimizer state
    over dp_shard), ``reshard`` (parameters freed after forward), ``hybrid`` (replicated
    across nodes)."""

    shard: bool
    reshard: bool
    hybrid: bool


STRATEGIES: Mapping[str, Strategy] = {
    "FULL_SHARD": Strategy(shard=True, reshard=True, hybrid=False),
    "SHARD_GRAD_OP": Strategy(shard=True, reshard=False, hybrid=False),
    "NO_SHARD": Strategy(shard=False, reshard=False, hybrid=False),
    "HYBRID_SHARD": Strategy(shard=True, reshard=True, hybrid=True),
    "_HYBRID_SHARD_ZERO2": Strategy(shard=True, reshard=False, hybrid=True),
}
# torch.distributed.fsdp.ShardingStrategy's values (older accelerate configs write them).
_BY_NUMBER = dict(enumerate(STRATEGIES, 1))


def strategy_name(value: Any) -> str | None:
    """The canonical FSDP1 strategy name of ``value`` (a ``ShardingStrategy``, its name in
    any case, accelerate's ``HYBRID_SHARD_ZERO2``, or its number), or None."""
    name = getattr(value, "name", value)  # a ShardingStrategy member
    if isinstance(name, int) and not isinstance(name, bool):
        return _BY_NUMBER.get(name)
    if not isinstance(name, str):
        return None
    name = name.strip().upper()
    if name.isdigit():
        return _BY_NUMBER.get(int(name))
    if name == "HYBRID_SHARD_ZERO2":
        return "_HYBRID_SHARD_ZERO2"
    return name if name in STRATEGIES else None


def apply_strategy(draft: Draft, key: str, value: Any, *, nodes: int | None) -> None:
    """The mesh and plugins of an FSDP1 strategy; CP902 for an unknown one, CP913 for a
    hybrid one without the node count."""
    name = strategy_name(value)
    if name is None:
        draft.refuse("CP902", key, value, "not an FSDP1 sharding strategy",
                     f"use one of {', '.join(STRATEGIES)}")
        return
    strategy = STRATEGIES[name]
    value = getattr(value, "name", value)  # a ShardingStrategy shown by its name
    if not strategy.shard:
        draft.map(key, value, draft.dim("dp_replicate", -1), draft.use("hsdp"))
        return
    lines = []
    if strategy.hybrid:
        if nodes is None:
            draft.refuse("CP913", key, value, f"{name} shards inside a node and replicates "
                         "across nodes, and the source does not say how many nodes",
                         "give the node count (composer-par import --nodes N, or "
                         "num_machines in the accelerate config)")
            return
        lines += [draft.dim("dp_replicate", nodes), draft.use("hsdp")]
    lines += [draft.dim("dp_shard", -1),
              draft.option("fsdp2", "reshard_after_forward", strategy.reshard)]
    draft.map(key, value, *lines)


def mixed_precision_table(param: str | None, reduce: str | None) -> dict[str, str]:
    return {k: v for k, v in (("param_dtype", param), ("reduce_dtype", reduce)) if v}


def apply_precision(draft: Draft, key: str, value: Any, precision: str) -> None:
    """accelerate's / DeepSpeed's / the Trainer's ``bf16`` / ``fp16`` / ``no`` as FSDP2's
    mixed precision: parameters computed in the low precision, gradients reduced in fp32."""
    precision = precision.lower()
    if precision in ("no", "fp32", "none", ""):
        draft.map(key, value)
        return
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision)
    if dtype is None:
        draft.find("CP908", key, value, f"{precision} training has no equal in a plan (FSDP2 "
                   "computes in bf16 or fp16 only)", "use bf16, or a float8 conversion "
                   "plugin when one is installed")
        return
    sharder = "fsdp2" if draft.has("fsdp2") or not draft.has("hsdp") else "hsdp"
    if sharder != "fsdp2":
        draft.find("CP908", key, value, "the plan only replicates (no FSDP2), and "
                   "replication has no mixed precision option", "autocast in the training "
                   "loop, or shard with FSDP2 and give it mixed_precision")
        return
    line = draft.option("fsdp2", "mixed_precision", mixed_precision_table(dtype, "float32"))
    if precision == "fp16":
        draft.find("CP907", key, value, "fp16 needs loss scaling, which is no part of a plan: "
                   "FSDP2 computes in float16 and reduces gradients in float32",
                   "scale the loss in the training loop with "
                   "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, or train "
                   "in bf16", line)
        return
    draft.map(key, value, line)


# -- FSDP1's Python arguments ---------------------------------------------------------------


def _wrap_classes(policy: Any) -> list[str] | None:
    """Class names of an FSDP1 transformer / module wrap policy, or None for another."""
    classes = getattr(policy, "_module_classes", None)  # ModuleWrapPolicy
    keywords = getattr(policy, "keywords", None)  # partial(transformer_auto_wrap_policy, ...)
    if classes is None and isinstance(keywords, Mapping):
        classes = keywords.get("transformer_layer_cls")
    if classes is None:
        return None
    return sorted(c if isinstance(c, str) else c.__name__ for c in classes)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def fsdp1_plan(sharding_strategy: Any = "FULL_SHARD", *, auto_wrap_policy: Any = None,
               mixed_precision: Any = None, cpu_offload: Any = None,
               activation_checkpointing: bool = False, nodes: int | None = None,
               world_size: int | None = None) -> ImportResult:
    """The plan equal to ``FullyShardedDataParallel(model, sharding_strategy=...,
    auto_wrap_policy=..., mixed_precision=..., cpu_offload=...)``: ``.plan()`` is the
    :class:`~composer_par.ParallelPlan`, ``.report`` the findings (FSDP1 settings with no
    equal), ``.explain()`` what each argument became. Takes torch's own objects
    (``ShardingStrategy``, ``ModuleWrapPolicy`` or a ``transformer_auto_wrap_policy``
    partial, ``MixedPrecision``, ``CPUOffload``) or their names; ``nodes`` is needed by
    the hybrid strategies (they replicate across nodes)."""
    draft = Draft("FSDP1")
    apply_strategy(draft, "sharding_strategy", sharding_strategy, nodes=nodes)
    if auto_wrap_policy is not None:
        classes = _wrap_classes(auto_wrap_policy)
        if classes and draft.has("fsdp2"):
            draft.map("auto_wrap_policy", f"wrap {', '.join(classes)}",
                      draft.option("fsdp2", "blocks", classes))
        elif classes:
            draft.map("auto_wrap_policy", f"wrap {', '.join(classes)}",
                      draft.option("hsdp", "blocks", classes))
        else:
            policy = getattr(auto_wrap_policy, "func", auto_wrap_policy)  # a partial's
            draft.find("CP905", "auto_wrap_policy", getattr(policy, "__name__",
                       type(policy).__name__), "a wrap policy by size or a custom "
                       "function has no equal: the plan makes one FSDP unit per block "
                       "(detected, or named by blocks)", "name the block classes: "
                       "FSDP2(blocks=[\"LlamaDecoderLayer\"]); units= shards other modules "
                       "as units of their own")
    if mixed_precision is not None:
        param = _dtype_name(getattr(mixed_precision, "param_dtype", None))
        reduce = _dtype_name(getattr(mixed_precision, "reduce_dtype", None))
        value = f"MixedPrecision(param_dtype={param}, reduce_dtype={reduce})"
        if not draft.has("fsdp2"):
            draft.find("CP908", "mixed_precision", value, "the plan only replicates (NO_SHARD) "
                       "and replication has no mixed precision option",
                       "autocast in the training loop, or shard with FSDP2")
        elif param or reduce:
            draft.map("mixed_precision", value, draft.option(
                "fsdp2", "mixed_precision", mixed_precision_table(param, reduce)))
        buffers = getattr(mixed_precision, "buffer_dtype", None)
        if buffers is not None:
            draft.find("CP908", "mixed_precision.buffer_dtype", _dtype_name(buffers),
                       "FSDP2 keeps buffers in their own dtype", "cast the buffers when "
                       "the model is built")
    if cpu_offload is not None:
        on = bool(getattr(cpu_offload, "offload_params", cpu_offload))
        if on and draft.has("fsdp2"):
            draft.map("cpu_offload", "CPUOffload(offload_params=True)",
                      draft.option("fsdp2", "offload", "cpu"))
        elif on:
            draft.find("CP906", "cpu_offload", "CPUOffload(offload_params=True)",
                       "the plan only replicates (NO_SHARD): CPU offload needs FSDP2",
                       "shard with FSDP2 (FULL_SHARD) to offload")
        else:
            draft.map("cpu_offload", "CPUOffload(offload_params=False)")
    if activation_checkpointing:
        draft.map("activation_checkpointing", True, draft.use("activation_checkpoint"))
    name = strategy_name(sharding_strategy) or shown(sharding_strategy)
    return draft.finish(f"FullyShardedDataParallel(sharding_strategy={name})", world_size)
