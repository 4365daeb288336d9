"""An accelerate config (the YAML ``accelerate config`` writes) as a plan.

FSDP1's keys (``fsdp_sharding_strategy``, or ``fsdp_reshard_after_forward`` holding a
strategy name) go through :mod:`composer_par.migrate.fsdp1`'s table; FSDP2's
(``fsdp_version: 2``, ``fsdp_reshard_after_forward: true``) and ``parallelism_config``'s
sizes map one to one. ``distributed_type: DEEPSPEED`` reads ``deepspeed_config`` (its
``deepspeed_config_file``, or accelerate's own ``zero_stage`` / ``offload_*_device``
keys) through :mod:`composer_par.migrate.deepspeed_config`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from composer_par.migrate.deepspeed_config import read_deepspeed
from composer_par.migrate.draft import Draft, ImportFailed
from composer_par.migrate.fsdp1 import apply_precision, apply_strategy, strategy_name
from composer_par.migrate.keys import unknown_key
from composer_par.migrate.reading import cannot, load_json, read_text

# Keys of the launch (torchrun's flags, the machines), not of the plan.
LAUNCH = frozenset({
    "compute_environment", "debug", "gpu_ids", "machine_rank", "main_process_ip",
    "main_process_port", "main_training_function", "rdzv_backend", "same_network",
    "enable_cpu_affinity", "use_cpu", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "mpirun_config", "ipex_config", "mpirun_hostfile",
})
FSDP_UNNEEDED = {
    "fsdp_use_orig_params": "FSDP2's parameters are the model's own (DTensors): there are "
    "no flat parameters to keep the originals of",
    "fsdp_sync_module_states": "the plan materializes every rank's shards from one seeded "
    "init or from the weights (MetaInit, LoadSafetensors): nothing to broadcast",
    "fsdp_backward_prefetch": "FSDP2 prefetches the next unit's all-gather in backward "
    "always (BACKWARD_PRE)",
    "fsdp_forward_prefetch": "FSDP2 prefetches the next unit's all-gather in forward",
    "fsdp_limit_all_gathers": "FSDP2 bounds its in-flight all-gathers itself",
}
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                     "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON", "FSDP",
                     "DEEPSPEED", "MEGATRON_LM", "XLA", "TP")
PARALLELISM = "parallelism_config_"
#: The nested sections of an accelerate config; each is read when its distributed type
#: uses it (parallelism_config by FSDP and DeepSpeed).
SECTIONS = ("fsdp_config", "deepspeed_config", "parallelism_config")
# accelerate's deepspeed_config keys (not a DeepSpeed JSON) and their DeepSpeed places.
DS_ACCELERATE = ("zero_stage", "offload_optimizer_device", "offload_param_device",
                 "offload_optimizer_nvme_path", "offload_param_nvme_path",
                 "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
                 "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_hostfile",
                 "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                 "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names")


def section(draft: Draft, config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The nested section ``key`` of ``config`` ({} when absent or empty); CP902 when it
    is not a mapping of settings."""
    value = config.get(key)
    if key in config and not value and (value is None or isinstance(value, Mapping)):
        draft.map(key, value)  # present and empty: nothing in it to set
        return {}
    if value is None or isinstance(value, Mapping):
        return value or {}
    draft.refuse("CP902", key, value, "must be a mapping of settings",
                 f"write {key}: followed by its settings, one per line, indented")
    return {}


def fsdp_version(draft: Draft, key: str, value: Any) -> int:
    """FSDP's version, 1 or 2 (CP902 otherwise; then 2, to go on reading)."""
    if value is None:
        return 1
    if isinstance(value, str) and value.strip() in ("1", "2"):
        return int(value)
    if isinstance(value, bool) or value not in (1, 2):
        draft.refuse("CP902", key, value, "FSDP's version is 1 or 2", "write 1 or 2")
        return 2
    return int(value)


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "on")


def read_accelerate(draft: Draft, config: Mapping[str, Any], *, base: Path | None = None,
                    nodes: int | None = None) -> int | None:
    """Every key of an accelerate config into ``draft``; returns the world size it says
    (``num_processes``), or None."""
    kind = str(config.get("distributed_type", "NO")).upper()
    machines = config.get("num_machines", 1)
    processes = config.get("num_processes", -1)
    nodes = nodes if nodes is not None else (
        machines if isinstance(machines, int) and machines >= 1 else None)
    world = processes if isinstance(processes, int) and processes >= 1 else None
    if kind not in DISTRIBUTED_TYPES:
        draft.refuse("CP902", "distributed_type", kind, "not a distributed type of "
                     "accelerate", f"use one of {', '.join(DISTRIBUTED_TYPES)}")
        return world
    if kind == "FSDP":
        draft.map("distributed_type", kind)
        read_fsdp(draft, section(draft, config, "fsdp_config"),
                  section(draft, config, PARALLELISM[:-1]),
              nodes=nodes)
    elif kind == "DEEPSPEED":
        draft.map("distributed_type", kind)
        _deepspeed(draft, section(draft, config, "deepspeed_config"), base=base)
        # accelerate's sequence parallelism under DeepSpeed (Ulysses): sp_size.
        _parallelism(draft, section(draft, config, PARALLELISM[:-1]), sharded_by="deepspeed")
    elif kind in ("MEGATRON_LM", "XLA"):
        draft.find("CP908", "distributed_type", kind, f"{kind} has no equal in composer_par",
                   "describe the parallelism with the plan's plugins (fsdp2, tp, pp)",
                   draft.dim("dp_shard", -1), draft.use("fsdp2"))
    else:  # plain data parallel (DDP), or one process
        draft.map("distributed_type", kind, draft.dim("dp_replicate", -1), draft.use("hsdp"))
    launch: list[str] = []
    used = {"FSDP": ("fsdp_config", "parallelism_config"),
            "DEEPSPEED": ("deepspeed_config", "parallelism_config")}.get(kind, ())
    for key, value in config.items():
        if key in used or key == "distributed_type":
            continue
        if key in SECTIONS:
            _ignored_section(draft, key, value, kind)
        elif key == "num_processes" or key == "num_machines":
            draft.map(key, value, *_topology(draft, world, nodes, key))
        elif key == "mixed_precision":
            apply_precision(draft, key, value, str(value))
        elif key == "dynamo_config":
            _dynamo(draft, section(draft, config, key))
        elif key in ("megatron_lm_config", "fp8_config"):
            if value:
                draft.find("CP908", key, value, f"{key} has no equal in composer_par",
                           "leave it out")
            else:
                draft.map(key, value)
        elif key in LAUNCH:
            launch.append(key)
            draft.note("CP909", key, value)
        else:
            unknown_key(draft, key, value, (*LAUNCH, *SECTIONS, "distributed_type",
                                            "num_processes", "num_machines", "mixed_precision",
                                            "dynamo_config", "megatron_lm_config",
                                            "fp8_config"))
    if launch:
        draft.report("CP909", f"{', '.join(launch)}: settings of the launch, not of a plan",
                     "give them to the launcher (torchrun --nnodes, --node-rank, "
                     "--master-addr, CUDA_VISIBLE_DEVICES)")
    return world


def _topology(draft: Draft, world: int | None, nodes: int | None, key: str) -> list[str]:
    if key != "num_processes" or world is None or nodes is None or world % nodes:
        return []
    draft.topology = {"nodes": nodes, "devices_per_node": world // nodes}
    return [f"[topology] nodes = {nodes}, devices_per_node = {world // nodes}"]


def read_fsdp(draft: Draft, fsdp: Mapping[str, Any], parallelism: Mapping[str, Any], *,
              nodes: int | None, label: Callable[[str], str] | None = None) -> None:
    """accelerate's ``fsdp_config`` (and FSDP2's ``parallelism_config``) into ``draft``;
    ``label`` gives the name a key is shown by (default ``fsdp_config.<key>``)."""
    name = label or (lambda key: "fsdp_config." + key)
    version = fsdp_version(draft, name("fsdp_version"), fsdp.get("fsdp_version", 1))
    strategy_key = next((k for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")
                         if k in fsdp and (version == 1 or k == "fsdp_sharding_strategy")), None)
    if version == 1 and parallelism:
        for key, value in parallelism.items():
            draft.find("CP917", "parallelism_config." + str(key), value, "accelerate reads "
                       "parallelism_config with FSDP2 only (fsdp_version: 2)",
                       "nothing to do; set fsdp_version: 2 to use it")
    if version == 1:
        apply_strategy(draft, name(strategy_key or "fsdp_sharding_strategy"),
                       fsdp.get(strategy_key, "FULL_SHARD") if strategy_key else "FULL_SHARD",
                       nodes=nodes)
    elif parallelism:
        _parallelism(draft, parallelism)
    else:  # FSDP2 without sizes: accelerate shards over every process
        draft.map(name("fsdp_version"), version, draft.dim("dp_shard", -1), draft.use("fsdp2"))
    if version != 1:
        reshard = fsdp.get("fsdp_reshard_after_forward", True)
        draft.map(name("fsdp_reshard_after_forward"), reshard,
                  draft.option("fsdp2", "reshard_after_forward", _flag(reshard)))
    sharding = draft.has("fsdp2")
    policy = str(fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    for key, value in fsdp.items():
        full = name(key)
        if key in ("fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            if key == "fsdp_version" and (version == 1 or parallelism):
                draft.map(full, value)
            elif version == 1 and key != "fsdp_version" and strategy_key is not None \
                    and key != strategy_key:
                # Both spellings of the strategy: the second must say the same.
                said = fsdp.get(strategy_key)
                if strategy_name(value) == strategy_name(said):
                    draft.map(full, value)
                else:
                    draft.refuse("CP902", full, value, f"says another strategy than "
                                 f"{name(strategy_key)} = {said}", "keep one of the two keys")
            continue
        if key == "fsdp_offload_params":
            if not _flag(value):
                draft.map(full, value)
            elif sharding:
                draft.map(full, value, draft.option("fsdp2", "offload", "cpu"))
            else:
                draft.find("CP906", full, value, "NO_SHARD only replicates: CPU offload needs "
                           "FSDP2", "shard (FULL_SHARD) to offload")
        elif key == "fsdp_auto_wrap_policy":
            if str(value).upper() == "TRANSFORMER_BASED_WRAP":
                draft.map(full, value)  # blocks: the class names, or detected
            else:
                draft.find("CP905", full, value, "wrapping by size or not at all has no equal: "
                           "the plan makes one FSDP unit per block (detected, or named by "
                           "blocks)", "name the block classes: blocks = "
                           "[\"LlamaDecoderLayer\"] in the fsdp2 plugin")
        elif key == "fsdp_transformer_layer_cls_to_wrap":
            names = [n.strip() for n in str(value).split(",") if n.strip()]
            if names and policy == "TRANSFORMER_BASED_WRAP":
                target = "fsdp2" if sharding else "hsdp"
                draft.map(full, value, draft.option(target, "blocks", names))
            else:
                draft.map(full, value)
        elif key == "fsdp_min_num_params":
            draft.find("CP905", full, value, "a wrap size has no equal: the plan makes one "
                       "FSDP unit per block", "name the block classes in the fsdp2 plugin's "
                       "blocks option")
        elif key == "fsdp_state_dict_type":
            draft.find("CP911", full, value, "a plan's checkpoints are sharded DCP, resharded "
                       "on load to any layout; full weights are exported as safetensors",
                       "save with composer_par.checkpoint.save; export full weights with "
                       "composer_par.checkpoint.export_safetensors or composer-par convert")
        elif key == "fsdp_cpu_ram_efficient_loading":
            if _flag(value):
                draft.find("CP910", full, value, "rank 0 loading the full weights and "
                           "broadcasting them has no equal: in a plan each rank reads only its "
                           "own shards", "build the model on meta and add load_safetensors "
                           "with the weights' path (or meta_init to initialize)")
            else:
                draft.map(full, value)
        elif key == "fsdp_activation_checkpointing":
            if _flag(value):
                draft.map(full, value, draft.use("activation_checkpoint"))
            else:
                draft.map(full, value)
        elif key == "fsdp_activation_checkpointing_offload":
            if _flag(value):
                draft.find("CP908", full, value, "offloading checkpointed activations to CPU "
                           "has no equal", "leave it out; checkpointing recomputes instead")
            else:
                draft.map(full, value)
        elif key in FSDP_UNNEEDED:
            draft.find("CP903", full, value, FSDP_UNNEEDED[key], "nothing to do")
        else:
            unknown_key(draft, full, value, (
                *FSDP_UNNEEDED, "fsdp_version", "fsdp_sharding_strategy",
                "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_auto_wrap_policy",
                "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
                "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
                "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload"))


def _parallelism(draft: Draft, config: Mapping[str, Any], *, sharded_by: str = "fsdp"
                 ) -> None:
    """``parallelism_config``'s sizes: dp_replicate (hsdp), dp_shard (fsdp2) and tp (tp)
    under FSDP2; cp and sp (DeepSpeed's Ulysses) under either, as the cp plugin's dim.
    ``sharded_by="deepspeed"``: the ZeRO config decides the data-parallel layout."""
    sizes = {str(k).removeprefix(PARALLELISM): v for k, v in config.items()}
    given = {str(k).removeprefix(PARALLELISM): str(k) for k in config}
    key = "parallelism_config." + PARALLELISM

    def size(name: str) -> int:
        value = sizes.get(name, 1)
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            draft.refuse("CP902", key + name, value, "a size is an integer >= 1",
                         "give the number of ranks, e.g. 2")
            sizes.pop(name)
            return 1
        return value

    replicate, shard, tp = size("dp_replicate_size"), size("dp_shard_size"), size("tp_size")
    cp, sp = size("cp_size"), size("sp_size")
    if sharded_by == "fsdp":
        # All ones (or absent): accelerate shards over every process.
        shard_size = -1 if replicate * shard * tp * cp * sp == 1 else shard
        if "dp_replicate_size" in sizes:
            draft.map(key + "dp_replicate_size", replicate,
                      *([draft.dim("dp_replicate", replicate), draft.use("hsdp")]
                        if replicate > 1 else []))
        elif replicate > 1:
            draft.dim("dp_replicate", replicate)
        draft.map(key + "dp_shard_size", sizes.get("dp_shard_size", 1),
                  draft.dim("dp_shard", shard_size), draft.use("fsdp2"))
        if "tp_size" in sizes:
            draft.map(key + "tp_size", tp,
                      *([draft.dim("tp", tp), draft.use("tp")] if tp > 1 else []))
    else:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size"):
            if name not in sizes:
                continue
            if size(name) > 1:
                draft.find("CP917", key + name, sizes[name], "accelerate reads it with "
                           "FSDP only; under DeepSpeed the ZeRO config lays out the data "
                           "parallelism", "leave it out, or import an FSDP config")
            else:
                draft.map(key + name, sizes[name])
    if cp > 1 and sp > 1:
        draft.refuse("CP902", key + "cp_size", cp, f"accelerate takes context parallelism "
                     f"(cp_size) or sequence parallelism (sp_size = {sp}), not both",
                     "set one of them to 1")
        return
    for name in ("cp_size", "sp_size"):
        if name in sizes and (cp if name == "cp_size" else sp) == 1:
            draft.map(key + name, sizes[name])
    if cp > 1:
        _context_parallel(draft, key, cp, sizes)
    if sp > 1:
        _sequence_parallel(draft, key, sp, sizes)
    for name, value in sizes.items():
        if name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            continue
        full = key + name
        if (name in CP_KEYS and cp > 1) or (name in SP_KEYS and sp > 1):
            continue  # read with its size
        if name in CP_KEYS or name in SP_KEYS:
            draft.find("CP917", full, value, f"accelerate reads it only with "
                       f"{'cp_size' if name in CP_KEYS else 'sp_size'} > 1", "nothing to do")
        else:
            unknown_key(draft, "parallelism_config." + given[name], value, [
                PARALLELISM + k for k in ("dp_replicate_size", "dp_shard_size", "tp_size",
                                          "cp_size", "sp_size", *CP_KEYS, *SP_KEYS)])


#: parallelism_config's settings of context parallelism (torch's, ``cp_size``) and of
#: sequence parallelism (DeepSpeed-Ulysses, ``sp_size``).
CP_KEYS = ("cp_comm_strategy", "cp_backend")
SP_KEYS = ("sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation",
           "sp_allow_recurrent_layers", "sp_disable_in_eval")


def _context_parallel(draft: Draft, key: str, cp: int, sizes: Mapping[str, Any]) -> None:
    """accelerate's ``cp_size`` (torch's context parallelism: ring attention whose K/V
    move by all-gather or by all-to-all passes) as the cp plugin."""
    strategy = str(sizes.get("cp_comm_strategy", "allgather")).lower()
    if strategy not in ("allgather", "alltoall"):
        draft.refuse("CP902", key + "cp_comm_strategy", sizes.get("cp_comm_strategy"),
                     "accelerate's strategies are allgather and alltoall",
                     "use allgather or alltoall")
        return
    draft.map(key + "cp_size", cp, draft.dim("cp", cp), draft.use("cp"))
    if "cp_comm_strategy" in sizes and strategy == "allgather":
        draft.map(key + "cp_comm_strategy", sizes["cp_comm_strategy"],
                  draft.option("cp", "mode", "allgather"))
    elif strategy == "alltoall":
        draft.find("CP915", key + "cp_comm_strategy", sizes["cp_comm_strategy"],
                   "accelerate passes each rank's K/V around the cp ranks by all-to-all "
                   "(torch's ring attention); the cp plugin's all-to-all mode is Ulysses: "
                   "heads traded for sequence by all-to-all, which needs head counts "
                   "divisible by cp (CP822); both compute exact attention",
                   "nothing to do; for any head count use mode = \"allgather\" (K/V "
                   "gathered, as accelerate's allgather)", draft.option("cp", "mode",
                                                                          "alltoall"))
    if "cp_backend" in sizes:
        backend = str(sizes["cp_backend"]).lower()
        if backend == "torch":
            draft.map(key + "cp_backend", sizes["cp_backend"])
        else:
            draft.refuse("CP902", key + "cp_backend", sizes["cp_backend"], "accelerate's "
                         "only context-parallel backend is torch", "write torch")


def _sequence_parallel(draft: Draft, key: str, sp: int, sizes: Mapping[str, Any]) -> None:
    """accelerate's ``sp_size`` (DeepSpeed-Ulysses: heads traded for sequence by
    all-to-all) as the cp plugin's all-to-all mode."""
    backend = str(sizes.get("sp_backend", "deepspeed")).lower()
    if backend != "deepspeed":
        draft.refuse("CP902", key + "sp_backend", sizes.get("sp_backend"), "accelerate's "
                     "only sequence-parallel backend is deepspeed", "write deepspeed")
        return
    draft.map(key + "sp_size", sp, draft.dim("cp", sp), draft.use("cp"),
              draft.option("cp", "mode", "alltoall"))
    if "sp_backend" in sizes:
        draft.map(key + "sp_backend", sizes["sp_backend"])
    variable = sizes.get("sp_seq_length_is_variable", True)
    if "sp_seq_length_is_variable" in sizes:
        draft.map(key + "sp_seq_length_is_variable", variable)
    length = sizes.get("sp_seq_length")
    if "sp_seq_length" in sizes:
        if not _flag(variable) and isinstance(length, int) and not isinstance(length, bool) \
                and length > 0:
            draft.map(key + "sp_seq_length", length, draft.option("cp", "seq_len", length))
        else:
            draft.map(key + "sp_seq_length", length)  # any length: nothing to check
    if "sp_attn_implementation" in sizes:
        implementation = str(sizes["sp_attn_implementation"])
        if implementation == "sdpa":
            draft.map(key + "sp_attn_implementation", implementation)
        else:
            draft.find("CP915", key + "sp_attn_implementation", implementation,
                       "the cp plugin runs the model's scaled_dot_product_attention across "
                       "the cp ranks; other attention kernels are refused (CP823)",
                       "build the model with attn_implementation=\"sdpa\"")
    if "sp_allow_recurrent_layers" in sizes:
        if _flag(sizes["sp_allow_recurrent_layers"]):
            draft.find("CP915", key + "sp_allow_recurrent_layers",
                       sizes["sp_allow_recurrent_layers"], "the cp plugin refuses layers "
                       "whose attention it cannot split (CP823), recurrent ones included",
                       "nothing to do; such a model trains without cp")
        else:
            draft.map(key + "sp_allow_recurrent_layers", sizes["sp_allow_recurrent_layers"])
    if "sp_disable_in_eval" in sizes:
        draft.find("CP909", key + "sp_disable_in_eval", sizes["sp_disable_in_eval"],
                   "evaluation is the training loop's, not the plan's",
                   "evaluate with the model the plan applied: it splits every sequence over "
                   "cp as in training")


def _ignored_section(draft: Draft, section: str, value: Any, kind: str) -> None:
    """A section the distributed type does not read (an ``fsdp_config`` left in a
    MULTI_GPU config): each key is listed, and left out, as accelerate leaves it."""
    if not isinstance(value, Mapping) or not value:
        draft.map(section, value)
        return
    for key, item in value.items():
        draft.find("CP917", f"{section}.{key}", item, f"accelerate reads {section} only "
                   f"with distributed_type {_READS[section]}, not {kind}", "nothing to do; "
                   f"set distributed_type: {_READS[section].split(' or ')[0]} to use it")


_READS = {"fsdp_config": "FSDP", "deepspeed_config": "DEEPSPEED",
          "parallelism_config": "FSDP or DEEPSPEED"}


def _deepspeed(draft: Draft, config: Mapping[str, Any], *, base: Path | None) -> None:
    prefix = "deepspeed_config."
    path = config.get("deepspeed_config_file")
    if path:
        file = Path(str(path))
        if not file.is_absolute() and base is not None:
            file = base / file
        try:
            data = load_json(read_text(file, what="DeepSpeed JSON"), str(file))
            if not isinstance(data, Mapping):
                raise cannot(str(file), f"{file} holds a {type(data).__name__}, not a "
                             "JSON object", "give a DeepSpeed JSON")
        except ImportFailed as exc:
            why = "; ".join(f.message for f in exc.report.findings)
            draft.refuse("CP901", prefix + "deepspeed_config_file", path,
                         f"cannot read the DeepSpeed JSON it names: {why}",
                         "check the path (relative to the accelerate config), or import the "
                         "DeepSpeed JSON itself: composer-par import ds.json")
            return
        draft.map(prefix + "deepspeed_config_file", path)
        read_deepspeed(draft, data, prefix=f"{file.name}: ")
    else:
        _deepspeed_keys(draft, config, prefix)
    for key, value in config.items():
        full = prefix + key
        if key == "deepspeed_config_file" or (key in _FROM_KEYS and not path):
            continue  # read above
        if key in _FROM_KEYS:
            draft.find("CP902", full, value, "accelerate refuses it beside "
                       "deepspeed_config_file, which says it", "set it in the DeepSpeed JSON")
        elif key == "zero3_save_16bit_model":
            draft.find("CP911", full, value, "a plan's checkpoints are sharded DCP; full "
                       "weights are exported as safetensors", "export with "
                       "composer_par.checkpoint.export_safetensors or composer-par convert")
        elif key == "zero3_init_flag":
            if _flag(value):
                draft.find("CP910", full, value, "zero.Init builds the model sharded; a plan "
                           "builds it on meta and materializes only each rank's shards",
                           "build the model under torch.device(\"meta\") and add meta_init or "
                           "load_safetensors")
            else:
                draft.map(full, value)
        elif key in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            draft.find("CP906", full, value, "NVMe offload has no equal in FSDP2", "offload to "
                       "CPU memory (fsdp2 offload = \"cpu\")")
        elif key in DS_ACCELERATE:
            draft.find("CP909", full, value, "a setting of the launch, not of a plan",
                       "give it to the launcher")
        else:
            unknown_key(draft, full, value, DS_ACCELERATE)


def _deepspeed_keys(draft: Draft, config: Mapping[str, Any], prefix: str) -> None:
    # accelerate's own keys: the DeepSpeed JSON it writes from them.
    ds: dict[str, Any] = {"zero_optimization": {"stage": config.get("zero_stage", 2)}}
    zero = ds["zero_optimization"]
    for which in ("optimizer", "param"):
        if f"offload_{which}_device" in config:
            device = config[f"offload_{which}_device"]
            zero[f"offload_{which}"] = {"device": "none" if device is None else device}
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in config:
            ds[key] = config[key]
    read_deepspeed(draft, ds, label=lambda path: prefix + _DS_NAMES.get(path, path))


# accelerate's deepspeed_config keys that stand for a DeepSpeed JSON's.
_FROM_KEYS = ("zero_stage", "offload_optimizer_device", "offload_param_device",
              "gradient_accumulation_steps", "gradient_clipping")
# DeepSpeed's config paths -> accelerate's deepspeed_config keys that set them.
_DS_NAMES = {"zero_optimization.stage": "zero_stage",
             "zero_optimization.offload_optimizer": "offload_optimizer_device",
             "zero_optimization.offload_param": "offload_param_device"}


def _dynamo(draft: Draft, config: Mapping[str, Any]) -> None:
    prefix = "dynamo_config."
    backend = str(config.get("dynamo_backend", "NO")).lower()
    for key, value in config.items():
        full = prefix + key
        if key == "dynamo_backend":
            if backend in ("no", "none"):
                draft.map(full, value)
            elif backend == "inductor":
                draft.map(full, value, draft.use("compile"))
            else:
                draft.map(full, value, draft.option("compile", "backend", backend))
        elif backend in ("no", "none"):
            draft.map(full, value)
        elif key == "dynamo_mode":
            mode = str(value)
            draft.map(full, value, *([] if mode == "default" else
                                     [draft.option("compile", "mode", mode)]))
        elif key == "dynamo_use_fullgraph":
            draft.map(full, value, draft.option("compile", "fullgraph", _flag(value)))
        elif key == "dynamo_use_regional_compilation":
            draft.map(full, value)  # the plan compiles each block: regional already
        elif key == "dynamo_use_dynamic":
            draft.find("CP908", full, value, "the compile plugin leaves dynamic shapes to "
                       "torch.compile's default", "leave it out")
        else:
            unknown_key(draft, full, value, ("dynamo_backend", "dynamo_mode",
                                             "dynamo_use_fullgraph", "dynamo_use_dynamic",
                                             "dynamo_use_regional_compilation"))
