"""transformers' ``DistributedConfig`` (``from_pretrained(..., distributed_config=...)``)
as a plan.

| DistributedConfig | mesh | plugins |
|---|---|---|
| ``fsdp_size = n`` | ``dp_shard = n`` | fsdp2 |
| ``dp_replicate_size = r`` | ``dp_replicate = r`` | hsdp (+ fsdp2) |
| ``tp_size = t``, ``tp_plan = "auto"`` | ``tp = t`` | tp (the model's own plan) |
| ``pp_size = p`` | ``pp = p`` | pp |
| ``ep_size = e`` (``tp_size = 1``) | ``dp_shard = n / e``, ``ep = e`` | ep |
| ``fsdp_cpu_offload`` | | fsdp2 ``offload = "cpu"`` |
| ``fsdp_mixed_precision`` | | fsdp2 bf16 parameters, fp32 reduction |
| ``fsdp_plan`` (per module: free or keep) | | fsdp2 ``units``, ``reshard_units`` |

transformers lays the ranks out as ``pp x dp_replicate x fsdp x tp``, with the experts'
``ep`` carved out of ``fsdp x tp``; a plan's mesh lists the same dims in the same order,
``ep`` inside ``dp_shard`` (FSDP2 shards the dense layers over both, the experts over
``dp_shard``: transformers' ``efsdp``). Nothing here imports transformers: the source is
the config's dict (``DistributedConfig.to_dict()``, its JSON file, or a model's
``config.json`` holding one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_par.migrate.draft import Draft
from composer_par.migrate.keys import unknown_key

#: DistributedConfig's fields, as its ``to_dict()`` writes them.
FIELDS = ("tp_size", "tp_plan", "enable_sequence_parallel", "enable_expert_parallel",
          "fsdp_size", "dp_replicate_size", "fsdp_plan", "fsdp_cpu_offload",
          "fsdp_mixed_precision", "pp_size", "ep_size", "ep_plan", "ep_implementation")
_FSDP_STYLES = {"free_full_weight": True, "keep_full_weight": False}
_EP_ALL_TO_ALL = ("auto", "all_to_all")


def is_distributed_config(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` is a DistributedConfig's dict (it has only its fields, and at
    least one of its sizes)."""
    keys = set(data)
    return bool(keys) and keys <= set(FIELDS) and bool(
        keys & {"tp_size", "fsdp_size", "dp_replicate_size", "pp_size", "ep_size"})


def _size(draft: Draft, config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        draft.refuse("CP902", key, value, "a parallel size is an integer >= 1 (transformers "
                     "refuses others)", "give the number of ranks, or leave it out (1)")
        return 1
    return value


def read_distributed(draft: Draft, config: Mapping[str, Any]) -> None:
    """Every field of a DistributedConfig's dict into ``draft``."""
    tp, fsdp = _size(draft, config, "tp_size"), _size(draft, config, "fsdp_size")
    replicate, pp = _size(draft, config, "dp_replicate_size"), _size(draft, config, "pp_size")
    ep = _size(draft, config, "ep_size")
    if ep > 1 and (ep % tp or (fsdp * tp) % ep):
        draft.refuse("CP902", "ep_size", ep, f"transformers needs ep_size a multiple of "
                     f"tp_size ({tp}) dividing fsdp_size * tp_size ({fsdp * tp})",
                     "choose an ep_size that does")
        ep = 1
    experts = ep > 1 and tp == 1
    if pp > 1:
        draft.map("pp_size", pp, draft.dim("pp", pp), draft.use("pp"))
    elif "pp_size" in config:
        draft.map("pp_size", config["pp_size"])
    if replicate > 1:
        draft.map("dp_replicate_size", replicate, draft.dim("dp_replicate", replicate),
                  draft.use("hsdp"))
    elif "dp_replicate_size" in config:
        draft.map("dp_replicate_size", config["dp_replicate_size"])
    if fsdp > 1:
        shard = fsdp // ep if experts else fsdp
        draft.map("fsdp_size", fsdp, draft.dim("dp_shard", shard), draft.use("fsdp2"))
    elif "fsdp_size" in config:
        draft.map("fsdp_size", config["fsdp_size"])
    _tensor_parallel(draft, config, tp)
    _experts(draft, config, ep, tp, experts)
    _fsdp_options(draft, config, sharded=fsdp > 1)
    for key, value in config.items():
        if key in ("tp_size", "tp_plan", "fsdp_size", "dp_replicate_size", "pp_size",
                   "ep_size", "ep_plan", "ep_implementation", "enable_expert_parallel",
                   "fsdp_plan", "fsdp_cpu_offload", "fsdp_mixed_precision"):
            continue
        if key == "enable_sequence_parallel":
            if value:
                draft.find("CP908", key, value, "transformers reserves it and runs no "
                           "sequence parallelism", "leave it out; for sequence parallelism "
                           "inside tp use the tp plugin's sequence_parallel, for long "
                           "sequences the cp plugin")
            else:
                draft.map(key, value)
        else:
            unknown_key(draft, key, value, FIELDS)


def _tensor_parallel(draft: Draft, config: Mapping[str, Any], tp: int) -> None:
    plan = config.get("tp_plan")
    if tp > 1:
        draft.map("tp_size", tp, draft.dim("tp", tp), draft.use("tp"))
    elif "tp_size" in config:
        draft.map("tp_size", config["tp_size"])
    if "tp_plan" not in config:
        return
    if plan is None or plan == "auto":
        # The tp plugin's default plan is the model's own (base_model_tp_plan).
        draft.map("tp_plan", plan)
    elif isinstance(plan, Mapping) and tp > 1:
        draft.find("CP918", "tp_plan", plan, "rules that override the model's own tensor "
                   "parallel plan: the tp plugin takes the model's plan (plan = \"auto\") "
                   "without them", "to change rules, give the tp plugin a plan table with "
                   "every rule (module pattern = style, as the model's plan names them)")
    elif isinstance(plan, Mapping):
        draft.map("tp_plan", plan)  # tp_size 1: no tensor parallelism to plan
    else:
        draft.refuse("CP902", "tp_plan", plan, "tp_plan is \"auto\", a dict or null",
                     "give \"auto\" or a dict of module pattern -> style")


def _experts(draft: Draft, config: Mapping[str, Any], ep: int, tp: int, experts: bool
             ) -> None:
    if experts:
        draft.map("ep_size", ep, draft.dim("ep", ep), draft.use("ep"))
    elif ep > 1:
        draft.find("CP918", "ep_size", ep, f"experts split over ranks that also split the "
                   f"dense layers by tp ({tp}): the ep plugin's ranks are a mesh dim of "
                   "their own, so the plan leaves expert parallelism out (FSDP2 shards the "
                   "experts with the rest)", "use tp_size = 1 with ep_size, or give the ep "
                   "plugin expert_tp to split each expert over tp")
    elif "ep_size" in config:
        draft.map("ep_size", config["ep_size"])
    for key in ("enable_expert_parallel", "ep_plan", "ep_implementation"):
        if key not in config:
            continue
        value = config[key]
        if key == "enable_expert_parallel":
            draft.map(key, value)  # derived from ep_size by DistributedConfig itself
        elif key == "ep_plan" and (value is None or not experts):
            draft.map(key, value)
        elif key == "ep_plan":
            draft.find("CP918", key, value, "rules naming the experts modules: the ep "
                       "plugin finds the experts modules itself", "nothing to do; it names "
                       "the modules it splits in its log line")
        elif value in _EP_ALL_TO_ALL or not experts:
            draft.map(key, value)  # the ep plugin sends tokens by all-to-all
        else:
            draft.find("CP918", key, value, "the ep plugin sends each token to its experts' "
                       "ranks by all-to-all; it has no other implementation",
                       "nothing to do; the training is the same")


def _fsdp_options(draft: Draft, config: Mapping[str, Any], *, sharded: bool) -> None:
    target = "fsdp2" if sharded else None
    for key in ("fsdp_cpu_offload", "fsdp_mixed_precision", "fsdp_plan"):
        if key not in config:
            continue
        value = config[key]
        if not value:
            draft.map(key, value)
        elif target is None:
            draft.find("CP917", key, value, "transformers applies FSDP2's settings only with "
                       "fsdp_size or dp_replicate_size > 1", "nothing to do")
        elif key == "fsdp_cpu_offload":
            draft.map(key, value, draft.option("fsdp2", "offload", "cpu"))
        elif key == "fsdp_mixed_precision":
            # transformers' policy: parameters in bf16, gradients reduced in fp32.
            draft.map(key, value, draft.option("fsdp2", "mixed_precision",
                                               {"param_dtype": "bfloat16",
                                                "reduce_dtype": "float32"}))
        else:
            _fsdp_plan(draft, value)


def _fsdp_plan(draft: Draft, plan: Any) -> None:
    if not isinstance(plan, Mapping) or not all(
            isinstance(k, str) and v in _FSDP_STYLES for k, v in plan.items()):
        draft.refuse("CP902", "fsdp_plan", plan, "fsdp_plan maps module names to "
                     "free_full_weight or keep_full_weight", "use those two styles")
        return
    # A pattern with a wildcard names the repeated layers (the plan's blocks, units
    # already); a plain name, a module sharded as a unit of its own.
    units = [name for name in plan if "*" not in name]
    lines = []
    if units:
        lines.append(draft.option("fsdp2", "units", units))
    reshard = {name: _FSDP_STYLES[style] for name, style in plan.items()}
    lines.append(draft.option("fsdp2", "reshard_units", reshard))
    draft.map("fsdp_plan", plan, *lines)


__all__ = ["FIELDS", "is_distributed_config", "read_distributed"]
