"""Rank-side functions and tasks for tests/test_tp.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any

from composer_par.testing.parity import ParityCase, ParityResult
from composer_par.testing.tasks import LlamaTask

# Four KV heads: TP over 4 ranks needs a KV-head count it divides (the default has 2).
llama_kv4 = LlamaTask(n_kv_heads=4)


def train_loss_parallel(case: ParityCase) -> tuple[list[float], dict[str, Any]]:
    """``train_case`` with the loss and its backward under ``loss_parallel()``, as a
    user of ``TP(loss_parallel=True)`` writes them (the logits stay vocabulary-sharded).
    Every rank returns its own view of the parameters (a replicated one is its copy)."""
    import torch.distributed as dist
    from composer_par.plugins.tp import local_loss, loss_parallel
    from torch.distributed.tensor import DTensor

    from composer_par.testing.parity import full_parameters, start_rank

    task, _plan, model, index, count, optimizer = start_rank(case)
    losses, sharded_logits = [], True
    for step in range(case.steps):
        local = task.batch(step).chunk(count)[index]
        with loss_parallel():
            logits = model(local)
            sharded_logits &= isinstance(logits, DTensor) and logits.placements[-1].is_shard()
            loss = task.loss_of(logits, local)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = local_loss(loss).detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    assert sharded_logits, "the output head did not keep its logits sharded on the vocabulary"
    return losses, full_parameters(model)


class LossParallelLlama(LlamaTask):
    """The Llama task with the loss split from the forward (the harness above calls both)."""

    def loss_of(self, logits: Any, batch: Any) -> Any:
        from composer_par.models.llama import next_token_loss

        return next_token_loss(logits, batch)


llama_loss_parallel = LossParallelLlama()


def check_loss_parallel(case: ParityCase, timeout: float = 240.0) -> ParityResult:
    from composer_par.testing.distributed import run_ranks
    from composer_par.testing.parity import parity_result

    return parity_result(case, run_ranks(train_loss_parallel, case.world_size, args=(case,),
                                         timeout=timeout))


def materialize(mesh: dict[str, int], task: str, seed: int, fsdp: bool,
                sequence_parallel: bool) -> dict[str, Any]:
    """MetaInit after TP (and FSDP2): the full parameters and every placement."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.parity import _resolve, full_parameters

    with torch.device("meta"):
        model = _resolve(task).build()
    plan = ParallelPlan(MeshSpec(**mesh)).use(TP(sequence_parallel=sequence_parallel))
    if fsdp:
        plan.use(FSDP2())
    model = plan.use(MetaInit(seed=seed)).apply(model)
    placements = {n: str(p.placements) if isinstance(p, DTensor) else "tensor"
                  for n, p in model.named_parameters()}
    # Every rank's own view: a Replicate parameter is each rank's copy, which could drift
    # on one rank while rank 0's matches.
    params = full_parameters(model)
    return {"rank": dist.get_rank(), "params": params, "placements": placements}


def optimizer_trap(replicate_rest: bool, fsdp: bool) -> dict[str, Any]:
    """One step of AdamW with foreach=True (CUDA's default; on CPU the default is the
    for-loop) and with fused=True, and clip_grad_norm_, on the Llama under TP without
    sequence parallel: "ok" or the first line of torch's error; with every optimizer that
    runs, whether its parameters equal the for-loop AdamW's bitwise."""
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import llama

    def trained(step: Any) -> tuple[Any, Any]:
        with torch.device("meta"):
            model = llama.build()
        mesh = MeshSpec(dp_shard=2, tp=2) if fsdp else MeshSpec(tp=2)
        plan = ParallelPlan(mesh).use(TP(replicate_rest=replicate_rest))
        if fsdp:
            plan.use(FSDP2())
        model = plan.use(MetaInit(seed=1)).apply(model)
        batch = llama.batch(0)
        next_token_loss(model(batch), batch).backward()
        step(model)
        return model, full_parameters(model)

    def adamw(**kwargs: Any) -> Any:
        return lambda model: torch.optim.AdamW(model.parameters(), lr=0.01, **kwargs).step()

    model, loop = trained(adamw(foreach=False))
    outcome: dict[str, Any] = {
        "parameter types": sorted({type(p).__name__ for p in model.parameters()}),
        "meshes": sorted({p.device_mesh.mesh_dim_names for p in model.parameters()
                          if isinstance(p, DTensor)}),
    }
    for name, step in (
        ("foreach", adamw(foreach=True)),
        ("fused", adamw(fused=True)),
        ("clip_grad_norm_", lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)),
    ):
        try:
            _, params = trained(step)
        except RuntimeError as exc:
            outcome[name] = str(exc).splitlines()[0]
            continue
        outcome[name] = "ok"
        if name != "clip_grad_norm_":
            outcome[f"{name} equals the for-loop"] = all(
                torch.equal(params[n], loop[n]) for n in loop)
    return outcome


# -- a model named and annotated like a Hugging Face Llama (transformers is not installed) --

HF_BASE_TP_PLAN = {
    "embed_tokens": "rowwise_rep",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def hf_like_llama(n_layers: int = 2, dim: int = 32, heads: int = 4, kv_heads: int = 2,
                  vocab: int = 128, seq: int = 16, tp_plan: dict[str, str] | None = None) -> Any:
    """LlamaForCausalLM's module names, ``config.base_model_tp_plan``, ``_tp_plan`` and
    ``base_model_prefix``, built from this project's Llama pieces."""
    import types

    import torch.nn as nn
    import torch.nn.functional as F

    from composer_par.models.llama import RMSNorm, Rotary

    head_dim = dim // heads
    config = types.SimpleNamespace(
        hidden_size=dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab, base_model_tp_plan=dict(tp_plan or HF_BASE_TP_PLAN))

    class LlamaAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
            self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

        def forward(self, x: Any, rotary: Any) -> Any:
            b, s, _ = x.shape
            q = rotary(self.q_proj(x).view(b, s, -1, head_dim))
            k = rotary(self.k_proj(x).view(b, s, -1, head_dim))
            v = self.v_proj(x).view(b, s, -1, head_dim)
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    class LlamaMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
            self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
            self.down_proj = nn.Linear(2 * dim, dim, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class LlamaDecoderLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = LlamaAttention()
            self.mlp = LlamaMLP()
            self.input_layernorm = RMSNorm(dim)
            self.post_attention_layernorm = RMSNorm(dim)
            self.rotary = Rotary(head_dim, seq, 10000.0)

        def forward(self, x: Any) -> Any:
            x = x + self.self_attn(self.input_layernorm(x), self.rotary)
            return x + self.mlp(self.post_attention_layernorm(x))

    class LlamaModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.embed_tokens = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(n_layers))
            self.norm = RMSNorm(dim)

        def forward(self, tokens: Any) -> Any:
            h = self.embed_tokens(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.norm(h)

    class LlamaForCausalLM(nn.Module):
        base_model_prefix = "model"
        _tp_plan = {"lm_head": "colwise_rep"}
        _no_split_modules = ["LlamaDecoderLayer"]

        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.model = LlamaModel()
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            return self.lm_head(self.model(tokens))

    return LlamaForCausalLM()


class HFLikeLlamaTask(LlamaTask):
    def build(self) -> Any:
        return hf_like_llama(vocab=self.vocab_size, seq=self.seq_len)


hf_llama = HFLikeLlamaTask(vocab_size=128)


def tied_weights_stay_tied() -> dict[str, Any]:
    """The Llama with its output head tied to the token embedding, both left out of the
    plan: replicate_rest must make them one DTensor, and training must keep them one."""
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par import TP, MeshSpec, MetaInit, ParallelPlan
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    model.output.weight = model.tok_embeddings.weight
    plan = {f"layers.*.{w}": s for w, s in (
        ("attention.wq", "colwise"), ("attention.wk", "colwise"), ("attention.wv", "colwise"),
        ("attention.wo", "rowwise"), ("feed_forward.w1", "colwise"),
        ("feed_forward.w3", "colwise"), ("feed_forward.w2", "rowwise"))}
    model = ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)).use(MetaInit(seed=2)).apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    batch = llama.batch(0)
    next_token_loss(model(batch), batch).backward()
    optimizer.step()
    head, embedding = model.get_submodule("output"), model.get_submodule("tok_embeddings")
    return {
        "tied": head.weight is embedding.weight,
        "dtensor": isinstance(head.weight, DTensor),
        "count": len(list(model.parameters())),
    }
