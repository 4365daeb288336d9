"""A DeepSpeed config (the JSON of ``--deepspeed ds.json``) as a plan.

ZeRO stages (docs/migration.md has the table):

* 0, nothing sharded: ``dp_replicate = -1``, hsdp alone;
* 1, optimizer state: as stage 2, gradients sharded too (CP908: no optimizer-only mode);
* 2, gradients and optimizer state: ``dp_shard = -1``, fsdp2 ``reshard_after_forward =
  false``;
* 3, parameters too: ``dp_shard = -1``, fsdp2 ``reshard_after_forward = true``.

ZeRO++ hpZ (``zero_hpz_partition_size = k``: a second copy of each parameter sharded
over ``k`` ranks for the backward all-gather) is FSDP2's ``reshard_after_forward = k``;
MiCS (``mics_shard_size = k``: shard inside groups of ``k``, replicate across them) is
HSDP with ``dp_shard = k``. ``"auto"`` values are the Trainer's to fill (CP914).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from composer_par.migrate.draft import Draft
from composer_par.migrate.fsdp1 import apply_precision

AUTO = "auto"

# Settings FSDP2 does without: it overlaps communication with compute, keeps gradients
# contiguous per unit and reduce-scatters them always.
UNNEEDED = frozenset({
    "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
    "round_robin_gradients", "load_from_fp32_weights", "elastic_checkpoint",
    "ignore_unused_parameters", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
    "mics_hierarchical_params_gather", "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params", "log_trace_cache_warnings",
})
# Sizes of DeepSpeed's communication buckets and parameter prefetch: FSDP2 communicates
# one unit (block) at a time, so the unit is the bucket.
BUCKETS = frozenset({
    "allgather_bucket_size", "reduce_bucket_size", "prefetch_bucket_size",
    "stage3_prefetch_bucket_size", "param_persistence_threshold",
    "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance", "sub_group_size",
    "module_granularity_threshold",
})
SAVE_16BIT = frozenset({"stage3_gather_16bit_weights_on_model_save",
                        "gather_16bit_weights_on_model_save",
                        "stage3_gather_fp16_weights_on_model_save"})
NO_EQUAL = {
    "zero_quantized_weights": "ZeRO++ quantized weight all-gather (qwZ)",
    "zero_quantized_gradients": "ZeRO++ quantized gradient reduce-scatter (qgZ)",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantized frozen weights",
    "zeropp_loco_param": "ZeRO++ LoCo error feedback",
    "offload_optimizer_ratio": "partial optimizer offload",
}
# Top-level keys of the training loop (the Trainer or the user's loop sets them).
LOOP = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
    "gradient_predivide_factor", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comet", "comms_logger", "memory_breakdown", "dump_state", "seed", "dataloader_drop_last",
    "checkpoint", "aio", "communication_data_type", "data_types", "timers", "monitor_config",
    "gradient_accumulation_dtype",
})
TOP_NO_EQUAL = {
    "amp": "NVIDIA apex amp",
    "activation_checkpointing": "DeepSpeed's activation partitioning and CPU checkpointing "
    "(the plan's activation_checkpoint plugin recomputes blocks instead; add it)",
    "sparse_attention": "DeepSpeed sparse attention",
    "pipeline": "DeepSpeed's pipeline engine, whose stages its PipelineModule in the "
    "training code makes, not this config (the plan's pp plugin splits the model itself; "
    "add it with a pp dim)",
    "moe": "DeepSpeed MoE",
    "curriculum_learning": "curriculum learning", "data_efficiency": "data efficiency",
    "compression_training": "compression training", "eigenvalue": "eigenvalue",
    "progressive_layer_drop": "progressive layer drop", "elasticity": "elastic training",
    "autotuning": "the autotuner", "fp8": "fp8 training", "quantize_training": "MoQ",
    "hybrid_engine": "the RLHF hybrid engine",
}


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _auto(draft: Draft, key: str, value: Any, what: str, fix: str) -> None:
    draft.find("CP914", key, value, f"DeepSpeed leaves it to the Trainer, which fills it from "
               f"its own arguments; the plan takes {what}", fix)


#: What a loop setting left "auto" is in the Trainer's arguments.
_LOOP_ARGUMENTS = {
    "train_batch_size": "per_device_train_batch_size (times the ranks and accumulation)",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm", "optimizer": "optim, learning_rate",
    "scheduler": "lr_scheduler_type, warmup_steps",
}


def read_deepspeed(draft: Draft, config: Mapping[str, Any], *, prefix: str = "",
                   label: Callable[[str], str] | None = None) -> None:
    """Every key of a DeepSpeed config into ``draft``; a key is shown as ``label(path)``
    (default: ``prefix`` and its dotted path)."""
    from composer_par.migrate.keys import unknown_key

    name = label or (lambda path: prefix + path)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        draft.refuse("CP902", name("zero_optimization"), zero, "must be a JSON object",
                     "write \"zero_optimization\": {\"stage\": 3, ...}")
        zero = {}
    elif "zero_optimization" in config and not zero:
        draft.map(name("zero_optimization"), zero)  # present and empty: DeepSpeed's defaults
    _stage(draft, name("zero_optimization.stage"), zero.get("stage", 0), zero,
           explicit="stage" in zero)
    for key, value in zero.items():
        if key == "stage":
            continue
        full = name("zero_optimization." + key)
        if key in ("offload_optimizer", "offload_param"):
            _offload(draft, full, value, optimizer=key == "offload_optimizer")
        elif key == "cpu_offload":  # DeepSpeed's old spelling of offload_optimizer: cpu
            _offload(draft, full, {"device": "cpu" if value else "none"}, optimizer=True)
        elif key == "zero_hpz_partition_size":
            _hpz(draft, full, value)
        elif key == "mics_shard_size":
            _mics(draft, full, value)
        elif key in UNNEEDED:
            draft.find("CP903", full, value, "FSDP2 does without it: it overlaps each unit's "
                       "communication with compute and reduce-scatters gradients per unit",
                       "nothing to do")
        elif key in BUCKETS:
            draft.find("CP904", full, value, "FSDP2 gathers and reduces one unit (a block) at "
                       "a time: the unit is the bucket, and the next block's all-gather is "
                       "prefetched", "choose the units (FSDP2 blocks / units) to change the "
                       "granularity")
        elif key in SAVE_16BIT:
            draft.find("CP911", full, value, "a plan's checkpoints are sharded DCP; full "
                       "weights are exported as safetensors", "export with "
                       "composer_par.checkpoint.export_safetensors or composer-par convert")
        elif key in NO_EQUAL:
            draft.find("CP908", full, value, f"{NO_EQUAL[key]} has no equal in composer_par",
                       "leave it out: the plan communicates in the parameters' dtype")
        else:
            unknown_key(draft, full, value, (*UNNEEDED, *BUCKETS, *SAVE_16BIT, *NO_EQUAL,
                                             "stage", "offload_optimizer", "offload_param",
                                             "zero_hpz_partition_size", "mics_shard_size"))
    for key, value in config.items():
        full = name(key)
        if key == "zero_optimization":
            continue
        if key in ("bf16", "fp16", "bfloat16"):
            _precision(draft, full, value, "fp16" if key == "fp16" else "bf16")
        elif key == "compile":
            _compile(draft, full, value)
        elif key == "sequence_parallel_size":
            _ulysses(draft, full, value)
        elif key == "tensor_parallel":
            _autotp(draft, full, value)
        elif key in LOOP:
            if is_auto(value):
                where = _LOOP_ARGUMENTS.get(key, key)
                _auto(draft, full, value, "none: it belongs to the training loop",
                      f"set it in the training loop: the Trainer's {where}, or your own "
                      "loop's")
            else:
                draft.find("CP909", full, value, "a setting of the training loop, not of a "
                           "plan", "set it in the training loop (TrainingArguments, or your "
                           "own loop's optimizer, scheduler and clipping)")
        elif key in TOP_NO_EQUAL:
            draft.find("CP908", full, value, f"{TOP_NO_EQUAL[key]} has no equal here",
                       "leave it out, or add the plan's own plugin where the message names one")
        else:
            unknown_key(draft, full, value, (*LOOP, *TOP_NO_EQUAL, "bf16", "fp16", "compile",
                                             "zero_optimization", "sequence_parallel_size",
                                             "tensor_parallel"))


def _stage(draft: Draft, key: str, stage: Any, zero: Mapping[str, Any], *,
           explicit: bool) -> None:
    if is_auto(stage) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        draft.refuse("CP902", key, stage, "a ZeRO stage is 0, 1, 2 or 3",
                     "give the stage as a number")
        return
    if stage == 0 and "mics_shard_size" in zero:
        draft.map(key, stage)  # MiCS decides the layout
        return
    shown_value = stage if explicit else f"{stage} (DeepSpeed's default)"
    if stage == 0:
        draft.map(key, shown_value, draft.dim("dp_replicate", -1), draft.use("hsdp"))
        return
    lines = [draft.dim("dp_shard", -1),
             draft.option("fsdp2", "reshard_after_forward", stage == 3)]
    if stage == 1:
        draft.find("CP908", key, shown_value, "ZeRO-1 shards only the optimizer state, and "
                   "FSDP2 has no such mode: the plan shards gradients too (ZeRO-2), the same "
                   "training with less memory, a reduce-scatter in place of an all-reduce",
                   "nothing to do; for ZeRO-1's exact communication replicate instead "
                   "(stage 0: hsdp alone)", *lines)
        return
    draft.map(key, shown_value, *lines)


def _offload(draft: Draft, key: str, value: Any, *, optimizer: bool) -> None:
    if not isinstance(value, Mapping):
        draft.refuse("CP902", key, value, "must be a JSON object with \"device\"",
                     "write {\"device\": \"cpu\"}")
        return
    device = str(value.get("device", "none")).lower()
    if device not in ("none", "cpu", "nvme"):
        draft.refuse("CP902", key, value, f"device {device!r} is none of none, cpu, nvme",
                     "use \"cpu\", \"nvme\" or \"none\"")
        return
    if device == "none":
        draft.map(key, value)
        return
    if not draft.has("fsdp2"):
        draft.find("CP906", key, value, "offloading needs sharding (ZeRO stage 1 or more); "
                   "the plan only replicates", "use ZeRO stage 3 (FSDP2) to offload")
        return
    line = draft.option("fsdp2", "offload", "cpu")
    if device == "nvme" and optimizer:
        path = value.get("nvme_path", "DIR")
        draft.find("CP906", key, value, "NVMe optimizer state is the offload plugin's, which "
                   "needs the training loop to wrap its optimizer; so the plan offloads "
                   "parameters, gradients and the optimizer step to CPU memory instead",
                   f"to keep the optimizer state in files instead, add [[plugins]] name = "
                   f"\"offload\" with path = \"{path}\" and wrap the optimizer: "
                   "plan.plugin(\"offload\").wrap(optimizer, model) (docs/offload.md)", line)
    elif device == "nvme":
        draft.find("CP906", key, value, "offloading the parameters to NVMe has no equal: the "
                   "plan offloads parameters, gradients and the optimizer step to CPU memory "
                   "instead", "make sure the host memory holds them, or keep DeepSpeed for "
                   "parameter offload to NVMe", line)
    elif optimizer:
        draft.find("CP906", key, value, "FSDP2 offloads parameters, gradients and the "
                   "optimizer step to CPU together: offloading the optimizer state alone has "
                   "no equal, so the plan offloads parameters too", "nothing to do; leave "
                   "offload out to keep everything on the device", line)
    else:
        draft.map(key, value, line)


def _hpz(draft: Draft, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        draft.refuse("CP902", key, value, "the hpZ partition size is an int >= 1",
                     "give the number of ranks per node, e.g. 8")
        return
    if value == 1:
        draft.map(key, value)
        return
    if not draft.has("fsdp2") or draft.plugins["fsdp2"].get("reshard_after_forward") is not True:
        draft.find("CP908", key, value, "hpZ applies to ZeRO stage 3 only", "use stage 3")
        return
    draft.map(key, value, draft.option("fsdp2", "reshard_after_forward", value))


def _mics(draft: Draft, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        draft.refuse("CP902", key, value, "the MiCS shard size is an int >= 1",
                     "give the ranks of a shard group, e.g. 8")
        return
    draft.mesh.pop("dp_shard", None)
    draft.map(key, value, draft.dim("dp_replicate", -1), draft.use("hsdp"),
              draft.dim("dp_shard", value),
              draft.option("fsdp2", "reshard_after_forward", True))


def _precision(draft: Draft, key: str, value: Any, precision: str) -> None:
    enabled = value.get("enabled", False) if isinstance(value, Mapping) else value
    if is_auto(enabled):
        dtype = "bfloat16" if precision == "bf16" else "float16"
        _auto(draft, key, value, "no mixed precision (add mixed_precision to fsdp2 for "
              f"{precision})", "to train in " + precision + " add to the fsdp2 plugin: "
              f"mixed_precision = {{param_dtype = \"{dtype}\", reduce_dtype = "
              "\"float32\"}")
        return
    if enabled is True:
        apply_precision(draft, key, value, precision)
        extra = sorted(set(value) - {"enabled"}) if isinstance(value, Mapping) else []
        if precision == "fp16" and extra:  # loss-scaler settings: already said by CP907
            return
    else:
        draft.map(key, value)


def _ulysses(draft: Draft, key: str, value: Any) -> None:
    """DeepSpeed-Ulysses (``sequence_parallel_size``): each rank holds a part of every
    sequence, and attention trades heads for sequence by all-to-all: the cp plugin's
    all-to-all mode over a cp dim of that size."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        draft.refuse("CP902", key, value, "the sequence-parallel size is an int >= 1",
                     "give the number of ranks each sequence is split over, e.g. 2")
        return
    if value == 1:
        draft.map(key, value)
        return
    draft.map(key, value, draft.dim("cp", value), draft.use("cp"),
              draft.option("cp", "mode", "alltoall"))


# AutoTP's own layer rules: the tp plugin takes the model's tp plan (or, without one, the
# Llama names) instead.
AUTOTP_RULES = ("preset_model", "partition_config", "use_default_specs")


def _autotp(draft: Draft, key: str, section: Any) -> None:
    """DeepSpeed's AutoTP for training (``tensor_parallel.autotp_size = N``, with ZeRO 0 to
    2): each block's linear layers split over N ranks that read the same samples, the
    rest data parallel: a tp dim of N with the tp plugin, under the ZeRO stage's data
    parallelism over the remaining ranks."""
    from composer_par.migrate.keys import unknown_key

    if not isinstance(section, Mapping):
        draft.refuse("CP902", key, section, "must be a JSON object",
                     "write \"tensor_parallel\": {\"autotp_size\": 2}")
        return
    for sub, value in section.items():
        full = f"{key}.{sub}"
        if sub == "autotp_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                draft.refuse("CP902", full, value, "the AutoTP size is an int >= 0 (0: off)",
                             "give the number of ranks each layer is split over, e.g. 2")
            elif value > 1:
                draft.map(full, value, draft.dim("tp", value), draft.use("tp"))
            else:
                draft.map(full, value)
        elif sub in AUTOTP_RULES:
            draft.find("CP918", full, value, "AutoTP's layer rules: the tp plugin splits "
                       "by the model's own tp plan (or, without one, its Llama-style "
                       "names)", "leave it out, or give the tp plugin a plan table "
                       "(module pattern = style) for other rules")
        elif sub == "tp_overlap_comm":
            if value:
                draft.find("CP908", full, value, "overlapping AutoTP's all-reduces with "
                           "compute has no equal in composer_par: the tp plugin's "
                           "collectives run in the layers' order", "leave it out")
            else:
                draft.map(full, value)
        elif sub == "dtype":
            draft.find("CP908", full, value, "AutoTP's layer dtype has no equal: the "
                       "plan computes in the model's dtype, or the fsdp2 plugin's mixed "
                       "precision", "leave it out; set mixed precision on the fsdp2 plugin")
        else:
            unknown_key(draft, full, value, ("autotp_size", "tp_overlap_comm", "dtype",
                                             *AUTOTP_RULES))


def _compile(draft: Draft, key: str, value: Any) -> None:
    enabled = value.get("enabled", False) if isinstance(value, Mapping) else value
    if enabled is True:
        backend = value.get("backend", "inductor") if isinstance(value, Mapping) else "inductor"
        line = draft.use("compile")
        if str(backend).lower() != "inductor":
            line = draft.option("compile", "backend", str(backend).lower())
        draft.map(key, value, line)
    else:
        draft.map(key, value)
