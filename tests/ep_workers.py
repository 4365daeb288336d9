"""Tasks and rank-side functions of tests/test_ep*.py: the MoE Llama of
composer_par.models.moe_llama and Hugging Face MoE families from tiny configs (built on
meta, nothing downloaded), each with its router's auxiliary loss in the loss."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class MoELlamaTask:
    """Next-token prediction plus the load-balancing loss with the MoE Llama."""

    num_experts: int = 4
    top_k: int = 2
    shared_expert: bool = False
    n_layers: int = 2
    dim: int = 32
    vocab_size: int = 64
    global_batch: int = 8
    seq_len: int = 8
    data_seed: int = 1234
    # Route every token to these experts regardless of the router (the router's
    # probabilities still give the weights): uneven routing, an ep rank receiving nothing.
    forced: tuple[int, ...] | None = None

    def config(self) -> Any:
        from composer_par.models.moe_llama import MoELlamaConfig

        return MoELlamaConfig(
            vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=4,
            n_kv_heads=2, ffn_hidden=2 * self.dim, max_seq_len=self.seq_len,
            num_experts=self.num_experts, top_k=self.top_k, expert_hidden=self.dim,
            shared_expert=self.shared_expert, aux_loss_coef=0.1)

    def build(self) -> Any:
        from composer_par.models.moe_llama import MoELlama

        model = MoELlama(self.config())
        if self.forced is not None:
            for layer in model.layers:
                layer.moe.router.forward = _ForcedRouter(layer.moe.router, self.forced)
        return model

    def batch(self, step: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(self.data_seed + step)
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=gen)
        stride = torch.randint(1, 4, (self.global_batch, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len)) % self.vocab_size

    def loss(self, model: Any, batch: Any) -> Any:
        from composer_par.models.moe_llama import moe_loss

        return moe_loss(model, batch)


class _ForcedRouter:
    """A router whose choice of experts is fixed (its weights still train)."""

    def __init__(self, router: Any, experts: tuple[int, ...]) -> None:
        self.router, self.experts = router, experts

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        probs = F.softmax(F.linear(x, self.router.weight).float(), dim=-1)
        index = torch.tensor(self.experts, device=x.device).expand(x.shape[0], -1)
        weights = probs.gather(1, index)
        return probs, weights.to(x.dtype), index


@attrs.frozen
class HFMoETask:
    """A Hugging Face MoE family's causal-LM loss with its router's aux loss
    (``output_router_logits=True``: the model adds ``router_aux_loss_coef`` times it)."""

    family: str
    global_batch: int = 4
    seq_len: int = 8
    data_seed: int = 5

    def build(self) -> Any:
        from tests import hf_workers

        if self.family in MORE_MOE:
            import transformers

            config_class, model_class, fields = MORE_MOE[self.family]
            config = getattr(transformers, config_class)(**{**hf_workers.COMMON, **fields})
            return getattr(transformers, model_class)(config)
        return hf_workers.build(self.family, **MOE_CONFIG.get(self.family, {}))

    def batch(self, step: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(self.data_seed + step)
        return torch.randint(3, 128, (self.global_batch, self.seq_len), generator=gen)

    def loss(self, model: Any, batch: Any) -> Any:
        if self.family in ("deepseek_v2", "deepseek_v3"):  # no router loss to ask for
            return model(input_ids=batch, labels=batch).loss
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        assert out.aux_loss is not None
        return out.loss


# The tiny configs of tests/hf_workers.py with a router loss that counts.
MOE_CONFIG: dict[str, dict[str, Any]] = {
    "mixtral": {"router_aux_loss_coef": 0.1},
    "qwen3_moe": {"router_aux_loss_coef": 0.1},
}

# MoE families beyond tests/hf_workers.py's: family -> (config, model, fields over its
# COMMON), each with 4 experts, top-2 and a router loss that counts.
MORE_MOE: dict[str, tuple[str, str, dict[str, Any]]] = {
    # A shared expert with its own sigmoid gate beside the routed ones.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "router_aux_loss_coef": 0.1}),
    # Grouped routing, a shared expert, multi-head latent attention; no aux loss.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
        "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8}),
    # Multi-head latent attention (its kv_a_proj_with_mqa feeds the split heads), greedy
    # routing, two shared experts, a dense first layer; no aux loss.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
        "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.1}),
}

moe_llama = MoELlamaTask()
moe_llama_shared = MoELlamaTask(shared_expert=True, num_experts=8)
# Every token to experts 0 and 1: with ep = 2 rank 1's experts receive nothing.
moe_llama_forced = MoELlamaTask(forced=(0, 1))
mixtral = HFMoETask("mixtral")
qwen3_moe = HFMoETask("qwen3_moe")
qwen2_moe = HFMoETask("qwen2_moe")
olmoe = HFMoETask("olmoe")
deepseek_v3 = HFMoETask("deepseek_v3")
deepseek_v2 = HFMoETask("deepseek_v2")


def layouts(plan_toml: str, task: str = "moe_llama") -> dict[str, tuple[Any, ...]]:
    """After apply on this rank: (mesh dim names, placements, local shape) of an expert
    weight and of a dense weight of the first block."""
    from torch.distributed.tensor import DTensor

    from composer_par.testing.parity import apply_to_built, build_plan

    if ":" in task:  # another module's task
        import importlib

        module, _, task = task.partition(":")
        tasks = vars(importlib.import_module(module))
    else:
        tasks = globals()
    model, _, _ = apply_to_built(tasks[task], build_plan(plan_toml))
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(("moe.experts.w1", "attention.wq.weight")) and ".0." in name:
            key = "expert" if "experts" in name else "dense"
            assert isinstance(param, DTensor), (name, type(param))
            out[key] = (param.device_mesh.mesh_dim_names, tuple(map(str, param.placements)),
                        tuple(param.to_local().shape))
    return out


# -- checkpoints across EP layouts ----------------------------------------------------------

#: name -> (mesh, plugins other than the materializer).
CHECKPOINT_LAYOUTS: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "fsdp2_ep_2x2": ({"dp_shard": 2, "ep": 2}, ("fsdp2", "ep")),
    "ep_2": ({"ep": 2}, ("ep",)),
    "one_process": ({}, ()),
}


def _built(layout: str, seed: int) -> tuple[Any, Any, Any]:
    import torch

    from composer_par import MeshSpec, MetaInit, ParallelPlan
    from tests.checkpoint_io_workers import plugin

    mesh, names = CHECKPOINT_LAYOUTS[layout]
    plan = ParallelPlan(MeshSpec(**mesh))
    for name in names:
        plan.use(plugin(name))
    plan.use(MetaInit(seed=seed))
    with torch.device("meta"):
        model = moe_llama_shared.build()
    model = plan.apply(model)
    return plan, model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def save_trained(layout: str, root: str) -> dict[str, Any]:
    """Train 2 steps under ``layout`` and save; this rank's view of the full state."""
    from composer_par.checkpoint import save
    from tests.checkpoint_io_workers import full_state

    plan, model, optimizer = _built(layout, 11)
    index, count = plan.data_shard()
    for step in range(2):
        moe_llama_shared.loss(model, moe_llama_shared.batch(step).chunk(count)[index]).backward()
        optimizer.step()
        optimizer.zero_grad()
    save(root, model, optimizer, step=2, plan=plan)
    return full_state(model, optimizer)  # type: ignore[no-any-return]


def load_saved(layout: str, root: str) -> dict[str, Any]:
    """A fresh model of ``layout`` (another seed) loads ``root``; this rank's view."""
    from composer_par.checkpoint import load
    from tests.checkpoint_io_workers import full_state

    _, model, optimizer = _built(layout, 99)
    load(root, model, optimizer)
    return full_state(model, optimizer)  # type: ignore[no-any-return]


def routing_after_one_step(options: str = "") -> list[dict[str, Any]]:
    """EP 2 (with ``options``, plan-file lines of the ep plugin) on the forced-routing MoE
    Llama: one forward, then the routing stats (each rank's), logged through
    composer_par's logger too."""
    from composer_par.plugins.ep.stats import log_routing

    from composer_par.logging import get_logger
    from composer_par.testing.parity import apply_to_built, build_plan

    plan = build_plan(EP2.replace('name = "ep"', 'name = "ep"\n' + options))
    model, index, count = apply_to_built(moe_llama_forced, plan)
    moe_llama_forced.loss(model, moe_llama_forced.batch(0).chunk(count)[index])
    return [s.as_dict() for s in log_routing(model, get_logger("tests.ep"), step=0)]


EP2 = """
[mesh]
ep = 2

[[plugins]]
name = "ep"

[[plugins]]
name = "meta_init"
"""


# -- Hugging Face weights in and out under EP ------------------------------------------------

HF_EP_LAYOUTS: dict[str, dict[str, int]] = {"fsdp2_ep_2x2": {"dp_shard": 2, "ep": 2},
                                             "ep_2": {"ep": 2}}


def _hf_plan(layout: str, materializer: Any) -> Any:
    from composer_par import EP, FSDP2, MeshSpec, ParallelPlan

    mesh = HF_EP_LAYOUTS[layout]
    plan = ParallelPlan(MeshSpec(**mesh))
    if "dp_shard" in mesh:
        plan.use(FSDP2())
    return plan.use(EP()).use(materializer)


def export_mixtral(layout: str, directory: str) -> dict[str, Any]:
    """Mixtral initialized under ``layout``, exported as safetensors with its Hugging
    Face names; this rank's view of the full weights."""
    import torch

    from composer_par import MetaInit
    from composer_par.checkpoint import export_safetensors
    from tests.checkpoint_io_workers import full_state

    plan = _hf_plan(layout, MetaInit(seed=5))
    with torch.device("meta"):
        model = mixtral.build()
    model = plan.apply(model)
    export_safetensors(model, directory, plan=plan)
    return full_state(model, None)  # type: ignore[no-any-return]


def load_mixtral(layout: str, directory: str) -> dict[str, Any]:
    """Mixtral materialized under ``layout`` by LoadSafetensors from ``directory``."""
    import torch

    from composer_par import LoadSafetensors
    from tests.checkpoint_io_workers import full_state

    plan = _hf_plan(layout, LoadSafetensors(directory))
    with torch.device("meta"):
        model = mixtral.build()
    model = plan.apply(model)
    state: dict[str, Any] = full_state(model, None)
    state["bytes_read"] = plan.notes["load_safetensors_report"].bytes_read
    return state


def deepseek_v2_model() -> Any:
    """DeepSeek-V2's tiny model, for ``--model tests.ep_workers:deepseek_v2_model``."""
    return deepseek_v2.build()


def deepseek_v3_model() -> Any:
    """DeepSeek-V3's tiny model, for ``--model tests.ep_workers:deepseek_v3_model``."""
    return deepseek_v3.build()
