"""Real Hugging Face models for the tests: tiny configs of 13 families (hidden 64, 2
layers, a 128-token vocabulary; built on meta, nothing downloaded), their batches with
``labels=``, and the rank-side functions of tests/test_hf_*.py.

transformers is imported inside the functions: a rank process imports it once, on its
first case. Each ``train_cases`` call trains several (family, plan) cases in sequence on
one process group and returns every rank's results: the losses, and every parameter of
this rank (its local part) against the same part of a single-process reference trained
on the global batch from the same initial weights.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

# family -> (config class, model class, config fields beyond COMMON)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "vit": ("ViTConfig", "ViTForImageClassification",
            {"image_size": 32, "patch_size": 8, "num_labels": 10}),
    "bert": ("BertConfig", "BertForMaskedLM", {}),
}
# Families outside the matrix, for the cases only they have: StableLm's attention
# reshapes by its own global head count (TP's name fallback), Apertus's XIELU activation
# holds parameters only its constructor sets (MetaInit), GraniteMoe builds a generation
# cache from use_cache passed through **kwargs (activation checkpointing); those under
# sequence parallel in tests/test_hf_sequence_parallel.py.
MORE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    # Its causal LM's forward takes use_cache only through **kwargs.
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # MoE blocks whose routers, experts and shared experts compute beside split layers
    # (sequence parallel); DeepSeek-V3's latent attention beside a projection left whole.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"head_dim": 8, "num_key_value_heads": 4, "moe_intermediate_size": 32,
                     "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                     "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                     "first_k_dense_replace": 1}),
    # Its own tp plan splits the token embedding only.
    "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
    # Decoders whose token embedding is their output head (tests/test_tied_parity.py).
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"tie_word_embeddings": True}),
}
COMMON: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 64,
}
# Dropout draws differ between layouts (and from the reference): off, for parity.
NO_DROPOUT = ("hidden_dropout", "attention_dropout", "hidden_dropout_prob",
              "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
              "summary_first_dropout", "classifier_dropout")
GLOBAL_BATCH = 4
SEQ = 16
SEED = 7


def config(family: str, **overrides: Any) -> Any:
    import transformers

    config_class, _, extra = {**FAMILIES, **MORE_FAMILIES}[family]
    cls = getattr(transformers, config_class)
    fields = {**COMMON, **extra, **overrides}
    cfg = cls(**fields)
    for name in NO_DROPOUT:
        if isinstance(getattr(cfg, name, None), float):
            setattr(cfg, name, 0.0)
    return cfg


def build(family: str, meta: bool = True, **overrides: Any) -> Any:
    """The family's model from its tiny config, on meta unless asked otherwise."""
    import torch
    import transformers

    cls = getattr(transformers, {**FAMILIES, **MORE_FAMILIES}[family][1])
    cfg = config(family, **overrides)
    if not meta:
        torch.manual_seed(SEED)
        return cls(cfg)
    with torch.device("meta"):
        return cls(cfg)


def factory(family: str) -> Any:
    """A zero-argument builder (``--model tests.hf_workers:llama`` and friends)."""
    return functools.partial(build, family)


for _name in FAMILIES:
    globals()[_name] = factory(_name)


def batch(family: str, step: int, size: int = GLOBAL_BATCH) -> dict[str, Any]:
    """The model's inputs for one step, ``labels=`` included (a learnable pattern)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    if family == "vit":
        # The same images and labels every step: random ones are learnable only so.
        gen = torch.Generator().manual_seed(1000)
        return {"pixel_values": torch.randn(size, 3, 32, 32, generator=gen),
                "labels": torch.randint(0, 10, (size,), generator=gen)}
    start = torch.randint(3, 128, (size, 1), generator=gen)
    ids = (start + 3 * torch.arange(SEQ)) % 125 + 3
    if family == "bert":
        labels = ids.clone()
        # A quarter of each row masked: every data shard averages over as many tokens, so
        # the mean of the shards' losses is the global batch's.
        masked = (torch.arange(SEQ) + torch.arange(size)[:, None]) % 4 == 0
        labels[~masked] = -100
        return {"input_ids": torch.where(masked, torch.full_like(ids, 4), ids),
                "labels": labels}
    return {"input_ids": ids, "labels": ids}


def shard(inputs: dict[str, Any], index: int, count: int) -> dict[str, Any]:
    return {k: v.chunk(count)[index] for k, v in inputs.items()}


# -- plans -----------------------------------------------------------------------------

HANDWRITTEN = {
    "model.embed_tokens": "embedding_rowwise",
    **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather",
}


def make_plan(plan: str, world: int) -> Any:
    """The plans of the test matrix, by name, for ``world`` ranks."""
    from composer_par import (
        FSDP2,
        HSDP,
        TP,
        ActivationCheckpoint,
        MeshSpec,
        MetaInit,
        ParallelPlan,
    )

    init = MetaInit(seed=SEED)
    if plan == "fsdp2":
        return ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2()).use(init)
    if plan in ("tp", "tp_sp", "tp_lp"):
        tp = TP(sequence_parallel=plan == "tp_sp", loss_parallel=plan == "tp_lp")
        return ParallelPlan(MeshSpec(tp=world)).use(tp).use(init)
    if plan == "tp_handwritten":
        # The Llama-family plan written out by hand, without the per-head norms of Qwen3
        # and Gemma3: TP finds them beside the split projections itself (CP421).
        return ParallelPlan(MeshSpec(tp=world)).use(TP(plan=HANDWRITTEN)).use(init)
    if plan == "tp_norms_replicated":
        # The control: the per-head norms declared to see the same inputs on every rank
        # (what TP did before it looked): each rank keeps its own part of their gradient.
        norms = {f"model.layers.*.self_attn.{n}_norm": "replicate" for n in "qk"}
        return ParallelPlan(MeshSpec(tp=world)).use(TP(plan={**HANDWRITTEN, **norms})).use(init)
    if plan == "fsdp2_tp":
        return ParallelPlan(MeshSpec(dp_shard=world // 2, tp=2)).use(FSDP2()).use(TP()).use(init)
    if plan == "hsdp":
        return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=world // 2)).use(HSDP())
                .use(FSDP2()).use(init))
    if plan in ("fsdp2_ac_full", "fsdp2_ac_selective"):
        mode = plan.rsplit("_", 1)[1]
        return (ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2())
                .use(ActivationCheckpoint(mode=mode)).use(init))
    if plan == "fsdp2_tp_ac":
        return (ParallelPlan(MeshSpec(dp_shard=world // 2, tp=2)).use(FSDP2()).use(TP())
                .use(ActivationCheckpoint()).use(init))
    raise ValueError(plan)


# -- training --------------------------------------------------------------------------


def reference(family: str, steps: int, lr: float) -> tuple[list[float], dict[str, Any]]:
    """One process, the global batch, the same initial weights (MetaInit's, on one rank)."""
    import torch

    from composer_par.plugin.initialize import materialize

    model = build(family)
    materialize(model, torch.device("cpu"), SEED)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # Under every name, tied ones too: a tie broken by a plan then shows as a difference.
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    losses = []
    for step in range(steps):
        loss = model(**batch(family, step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {"initial": initial,
                    "final": {n: p.detach().clone()
                              for n, p in model.named_parameters(remove_duplicate=False)}}


def _local_part(param: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _same_part(ref: Any, like: Any) -> Any:
    """This rank's part of the reference tensor ``ref``, laid out as ``like``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(ref, like.device_mesh, like.placements,
                                 src_data_rank=None).to_local()
    return ref


def _worst(model: Any, expected: dict[str, Any]) -> tuple[str, float, int]:
    """(name, largest absolute difference, parameters compared) of this rank's parameter
    parts against the same parts of ``expected``."""
    from composer_par.plugin import clean_name

    worst, where, count = 0.0, "", 0
    for name, param in model.named_parameters(remove_duplicate=False):
        ref = expected[clean_name(name)]
        mine = _local_part(param).detach().float()
        theirs = _same_part(ref, param).float()
        diff = float((mine - theirs).abs().max()) if mine.numel() else 0.0
        count += 1
        if diff > worst or not where:
            worst, where = diff, clean_name(name)
    return where, worst, count


def _loss(model: Any, inputs: dict[str, Any], loss_parallel: bool) -> Any:
    if loss_parallel:
        from composer_par.plugins.tp import loss_parallel as context

        with context():
            loss = model(**inputs).loss
            loss.backward()
        return loss
    loss = model(**inputs).loss
    loss.backward()
    return loss


def train_case(family: str, plan_name: str, steps: int = 3, lr: float = 0.1,
               refs: dict[str, Any] | None = None, plan: Any = None,
               count: bool = False) -> dict[str, Any]:
    """One case on this rank: apply the plan (``plan``, or the matrix's of that name),
    train ``steps`` steps on this rank's data shard with ``labels=``, compare losses and
    this rank's parameter parts (before and after training) with the single-process
    reference. ``count``: each step (forward, backward, optimizer step) under a
    CommCounter, its calls per mesh dim and kind in ``counts``."""
    import contextlib

    import torch
    import torch.distributed as dist
    from composer_par.plugins.tp import local_loss

    from composer_par import PlanError
    from composer_par.testing.comm_count import CommCounter

    world = dist.get_world_size()
    if plan is None:
        plan = make_plan(plan_name, world)
    model = build(family)
    report = plan.validate(model)
    try:
        model = plan.apply(model)
    except PlanError as exc:
        errors = [f for f in exc.report.findings if f.severity.value == "error"]
        return {"family": family, "plan": plan_name, "applied": False,
                "codes": sorted(exc.report.codes()), "report": exc.report.format(),
                "refusals": [(f.code, f.message, f.fix) for f in errors]}
    cache = refs if refs is not None else {}
    if family not in cache:
        cache[family] = reference(family, steps, lr)
    ref_losses, ref_params = cache[family]
    model.train()
    index, shards = plan.data_shard()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    result: dict[str, Any] = {
        "family": family, "plan": plan_name, "applied": True, "rank": dist.get_rank(),
        "codes": sorted(report.codes()), "initial": _worst(model, ref_params["initial"]),
        "use_cache": getattr(model.config, "use_cache", None),
        "ties": _tied(model), "ref_losses": ref_losses,
    }
    losses = []
    counts: list[dict[str, dict[str, int]]] = []
    mesh = plan.mesh.resolve(world)
    try:
        for step in range(steps):
            with CommCounter() if count else contextlib.nullcontext() as counter:
                loss = _loss(model, shard(batch(family, step), index, shards),
                             plan_name == "tp_lp")
                optimizer.step()
                optimizer.zero_grad()
            if counter is not None:
                counts.append({dim: {kind: totals["calls"] for kind, totals in kinds.items()}
                               for dim, kinds in counter.summary(mesh, dist.get_rank()).items()})
            total = local_loss(loss).detach().float().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
    except Exception:
        result["error"] = traceback.format_exc()[-3000:]
        return result
    result["losses"] = losses
    if count:
        result["counts"] = counts
    result["final"] = _worst(model, ref_params["final"])
    result["tied_after"] = _tied(model)
    return result


# -- the matrix: cases, what each must give, the table -----------------------------------

TWO_RANK_PLANS = ("fsdp2", "tp", "tp_sp", "tp_lp", "fsdp2_ac_full", "fsdp2_ac_selective")
FOUR_RANK_PLANS = ("fsdp2_tp", "hsdp", "fsdp2_tp_ac")
TWO_RANK_CASES = [(f, p) for f in FAMILIES for p in TWO_RANK_PLANS] + [
    ("qwen3", "tp_handwritten"), ("gemma3", "tp_handwritten"), ("qwen3", "tp_norms_replicated")]
FOUR_RANK_CASES = [(f, p) for f in FAMILIES for p in FOUR_RANK_PLANS]
PLAN_TITLES = {
    "fsdp2": "FSDP2", "tp": "TP(auto)", "tp_sp": "TP + SP", "tp_lp": "TP + loss parallel",
    "fsdp2_tp": "FSDP2 x TP", "hsdp": "HSDP x FSDP2", "fsdp2_ac_full": "FSDP2 + AC full",
    "fsdp2_ac_selective": "FSDP2 + AC selective", "fsdp2_tp_ac": "FSDP2 x TP + AC",
}
RTOL, ATOL = 1.3e-6, 1e-5  # the design's fp32 tolerance, for the losses
PARAM_ATOL = 1e-6  # parameters after 3 SGD steps at lr 0.1 from weights of scale 0.02

# (family, plan) -> the finding that refuses it, and words it says. GPT-2 (Conv1D layers,
# no tp plan) and BERT (no tp plan, query/key/value names) give TP(auto) nothing to work
# from; ViT has no token embedding or output head for sequence or loss parallel.
_NO_TP = {"gpt2": "GPT2LMHeadModel and recognized none",
          "bert": "BertForMaskedLM and recognized"}
REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    **{(f, p): ("CP408", words) for f, words in _NO_TP.items()
       for p in ("tp", "tp_sp", "tp_lp", "fsdp2_tp", "fsdp2_tp_ac")},
    ("vit", "tp_sp"): ("CP408", "found no token embedding"),
    ("vit", "tp_lp"): ("CP408", "found no output head"),
}
# The decoders build a generation cache in a training forward unless told not to.
CACHING = {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "phi3", "gpt_neox",
           "gpt2", "mixtral", "qwen3_moe"}
TIED = {"gemma", "gemma3", "gpt2", "bert"}


def problems(results: list[list[dict[str, Any]]], cases: list[tuple[str, str]]) -> list[str]:
    """What is wrong with every rank's results: a case that raised, was refused without
    the expected finding (or with), whose parameter parts differ from the reference's
    (bitwise at the start), whose losses differ or do not fall, or whose ties broke."""
    out = []
    for rank, rows in enumerate(results):
        if [(r["family"], r["plan"]) for r in rows] != cases:
            out.append(f"rank {rank}: the cases came back out of order")
            continue
        for row in rows:
            key = (row["family"], row["plan"])
            where = f"rank {rank} {key[0]} x {key[1]}"
            if "error" in row:
                out.append(f"{where}: raised\n{row['error']}")
                continue
            if key in REFUSED:
                code, words = REFUSED[key]
                if row["applied"] or code not in row["codes"] or words not in row["report"]:
                    out.append(f"{where}: expected {code} ({words}), got "
                               f"{row.get('report', row['codes'])}")
                continue
            if not row["applied"]:
                out.append(f"{where}: refused\n{row['report']}")
                continue
            if key[1] == "tp_norms_replicated":  # the comparison must see the drift
                name, diff, _ = row["final"]
                if "_norm" not in name or diff <= 10 * PARAM_ATOL:
                    out.append(f"{where}: norms declared replicated should drift apart; the "
                               f"largest difference is {diff} in {name}")
                continue
            if "ac" in key[1] and key[0] in CACHING and "CP422" not in row["codes"]:
                out.append(f"{where}: no CP422 for a checkpointed model with a cache")
            name, diff, count = row["initial"]
            if diff != 0.0 or count < 15:
                out.append(f"{where}: initial {name} differs by {diff} ({count} compared)")
            name, diff, _ = row["final"]
            if diff > PARAM_ATOL:
                out.append(f"{where}: trained {name} differs by {diff}")
            for ours, ref in zip(row["losses"], row["ref_losses"], strict=True):
                if abs(ours - ref) > ATOL + RTOL * abs(ref):
                    out.append(f"{where}: losses {row['losses']} vs {row['ref_losses']}")
                    break
            if row["losses"][-1] >= row["losses"][0]:
                out.append(f"{where}: the loss did not fall: {row['losses']}")
            if row["ties"] != row["tied_after"] or (key[0] in TIED and not row["ties"]):
                out.append(f"{where}: ties {row['ties']} became {row['tied_after']}")
    return out


def trained(cases: list[tuple[str, str]], world: int, *, timeout: float, steps: int = 3,
            count: bool = False) -> list[list[dict[str, Any]]]:
    """Every rank's results of :func:`train_cases` on ``world`` gloo ranks, asserted free
    of :func:`problems`."""
    from composer_par.testing.distributed import run_ranks

    results = run_ranks(train_cases, world, args=(cases, steps, count), timeout=timeout)
    found = problems(results, cases)
    assert not found, "\n".join(found)
    return results


def cells(results: list[list[dict[str, Any]]]) -> dict[tuple[str, str], str]:
    """(family, plan) -> what the case gave on every rank: "trains" (at parity with one
    process), the codes of the findings that refused it, or "fails" (on any rank; see
    :func:`problems` for why)."""
    out: dict[tuple[str, str], str] = {}
    for rows in results:
        for row in rows:
            key = (row["family"], row["plan"])
            if problems([[row]], [key]):
                value = "fails"
            elif not row["applied"]:
                value = ", ".join(dict.fromkeys(code for code, _, _ in row["refusals"]))
            else:
                value = "trains"
            out[key] = value if out.get(key, value) == value else "fails"
    return out


def refusals(results: list[list[dict[str, Any]]]) -> dict[tuple[str, str], list[tuple[
        str, str, str]]]:
    """(family, plan) -> the (code, message, fix) of each error that refused it."""
    return {(r["family"], r["plan"]): [tuple(x) for x in r["refusals"]]  # type: ignore[misc]
            for r in results[0] if r.get("applied") is False}


def _tied(model: Any) -> list[str]:
    """Parameter names registered twice (one parameter in two modules)."""
    seen: dict[int, str] = {}
    twice = []
    for module_name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            if id(param) in seen:
                twice.append(f"{name}={seen[id(param)]}")
            else:
                seen[id(param)] = name
    return twice


def train_cases(cases: list[tuple[str, str]], steps: int = 3,
                count: bool = False) -> list[dict[str, Any]]:
    """Every (family, plan) case in order, on this process group; one reference per
    family is trained once and shared by its cases. ``count``: as :func:`train_case`."""
    import time

    refs: dict[str, Any] = {}
    out = []
    for family, plan_name in cases:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            result = train_case(family, plan_name, steps, refs=refs, count=count)
        except Exception:
            result = {"family": family, "plan": plan_name, "applied": None,
                      "error": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        result["cpu"] = round(time.process_time() - cpu, 2)
        result["process_cpu"] = round(time.process_time(), 2)  # this rank's, imports too
        out.append(result)
    return out


# -- torchtitan's Llama 3 naming (a hand-written model: torchtitan is no dependency) -----


def titan_llama3(fused: bool = False, n_layers: int = 2, dim: int = 64, heads: int = 8,
                 kv_heads: int = 4, vocab: int = 128) -> Any:
    """A Llama 3 with torchtitan's module names: ``tok_embeddings``, ``layers`` (a
    ModuleDict keyed "0", "1", ...) of ``attention_norm``, ``attention.wq/wk/wv/wo`` (or
    one fused ``wqkv``), ``ffn_norm``, ``feed_forward.w1/w2/w3``; ``norm``, ``output``."""
    import torch.nn as nn
    import torch.nn.functional as F

    head_dim = dim // heads

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if fused:
                self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
            else:
                self.wq = nn.Linear(dim, heads * head_dim, bias=False)
                self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
                self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, dim, bias=False)

        def forward(self, x: Any) -> Any:
            b, s, _ = x.shape
            if fused:
                q, k, v = self.wqkv(x).split(
                    [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            else:
                q, k, v = self.wq(x), self.wk(x), self.wv(x)
            q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, 2 * dim, bias=False)
            self.w2 = nn.Linear(2 * dim, dim, bias=False)
            self.w3 = nn.Linear(dim, 2 * dim, bias=False)

        def forward(self, x: Any) -> Any:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.RMSNorm(dim)
            self.attention = Attention()
            self.ffn_norm = nn.RMSNorm(dim)
            self.feed_forward = FeedForward()

        def forward(self, x: Any) -> Any:
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
            self.norm = nn.RMSNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h)
            return self.output(self.norm(h))

    return Transformer()


def titan_llama3_fused() -> Any:
    return titan_llama3(fused=True)


# The plan TP(plan="auto") made for the fused model before it knew fused projections:
# torchtitan's names, with wqkv not recognized (left whole) while wo is split.
TITAN_SPLIT_WO_ONLY = {
    "tok_embeddings": "embedding_rowwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "colwise_gather",
}


# -- weights: save_pretrained -> LoadSafetensors, export_safetensors -> from_pretrained --


def weight_plans(world: int) -> dict[str, Any]:
    """The layouts weights are loaded into: FSDP2, TP and FSDP2 x TP."""
    from composer_par import FSDP2, TP, MeshSpec, ParallelPlan

    return {"fsdp2": lambda: ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2()),
            "tp": lambda: ParallelPlan(MeshSpec(tp=world)).use(TP()),
            "fsdp2_tp": lambda: ParallelPlan(MeshSpec(dp_shard=world // 2, tp=2)).use(
                FSDP2()).use(TP())}


def round_trips(families: list[str], plans: list[str], directory: str) -> list[dict[str, Any]]:
    """For each family: rank 0 writes a plain model with ``save_pretrained`` (per-expert
    tensors for the MoE families, older names for GPT-NeoX and ViT); each plan loads it
    with LoadSafetensors on meta, and its logits are compared with the plain model's; the
    loaded model is exported with ``export_safetensors`` and rank 0 reads the export back
    with ``from_pretrained`` and compares state dicts with the plain model's."""
    import os

    import torch
    import torch.distributed as dist
    import transformers
    from safetensors import safe_open

    rank = dist.get_rank()
    out = []
    for family in families:
        cls = getattr(transformers, FAMILIES[family][1])
        plain = build(family, meta=False).eval()
        saved = os.path.join(directory, f"{family}-hf")
        if rank == 0:
            plain.save_pretrained(saved, safe_serialization=True)
        dist.barrier()
        files = [os.path.join(saved, f) for f in os.listdir(saved) if f.endswith(".safetensors")]
        keys: list[str] = []
        for file in files:
            with safe_open(file, "pt") as handle:
                keys += list(handle.keys())
        inputs = {k: v for k, v in batch(family, 0).items() if k != "labels"}
        with torch.no_grad():
            expected = plain(**inputs).logits
        for name in plans:
            row: dict[str, Any] = {"family": family, "plan": name, "from": "save_pretrained",
                                   "per_expert": any(".experts.0." in k for k in keys),
                                   "file_bytes": sum(os.path.getsize(f) for f in files)}
            exported = os.path.join(directory, f"{family}-{name}")
            row.update(_load_and_check(family, name, saved, inputs, expected, plain, cls,
                                       exported))
            out.append(row)
            if row["per_expert"] and row.get("applied"):
                # The export holds the fused layout: TP's strided split of it is read box
                # by box from one tensor per weight rather than from per-expert tensors.
                again = {"family": family, "plan": name, "from": "export", "per_expert": False,
                         "file_bytes": os.path.getsize(exported + "/model.safetensors")}
                again.update(_load_and_check(family, name, exported, inputs, expected,
                                             plain, cls, exported + "-again"))
                out.append(again)
        dist.barrier()
    return out


def _load_and_check(family: str, plan_name: str, path: str, inputs: dict[str, Any],
                    expected: Any, plain: Any, cls: Any, exported: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_par import LoadSafetensors, PlanError
    from composer_par.checkpoint import export_safetensors

    plan = weight_plans(dist.get_world_size())[plan_name]().use(LoadSafetensors(path))
    model = build(family)
    try:
        model = plan.apply(model).eval()
        read = plan.notes["load_safetensors_report"].bytes_read
    except PlanError as exc:
        return {"applied": False, "codes": sorted(exc.report.codes()),
                "report": exc.report.format(), "untouched": all(
                    p.is_meta and not isinstance(p, DTensor) for p in model.parameters())}
    except Exception:
        return {"applied": None, "error": traceback.format_exc()[-2000:]}
    row: dict[str, Any] = {"applied": True, "bytes_read": read, "held": _held_bytes(model)}
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        row["logits"] = float((logits - expected).abs().max())
        export_safetensors(model, exported, plan=plan)
        dist.barrier()
        if dist.get_rank() == 0:
            plain.config.save_pretrained(exported)  # the weights are ours, the config its
            theirs, mine = cls.from_pretrained(exported).state_dict(), plain.state_dict()
            row["export_keys"] = sorted(theirs) == sorted(mine)
            row["export"] = max((float((theirs[k] - mine[k]).abs().max())
                                 for k in mine if k in theirs), default=-1.0)
    except Exception:
        row["error"] = traceback.format_exc()[-2000:]
    return row


def _held_bytes(model: Any) -> int:
    """The bytes of this rank's parts of the model's stored tensors (each tensor once)."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            local = _local_part(tensor)
            total += local.numel() * local.element_size()
    return total


def held_elements(families: list[str], plan_name: str) -> dict[str, int]:
    """family -> the elements of this rank's parts of the parameters, under ``plan_name``
    (each parameter once)."""
    import torch.distributed as dist

    out = {}
    for family in families:
        model = make_plan(plan_name, dist.get_world_size()).apply(build(family))
        params = {id(p): p for p in model.parameters()}.values()
        out[family] = sum(_local_part(p).numel() for p in params)
    return out


# -- DCP checkpoints of TP's packed (strided) weights -------------------------------------

# Phi3 with its fused gate_up_proj split as packed halves (each rank a slice of gate and a
# slice of up: a strided placement), the MLP's down projection rowwise after it.
PHI3_PACKED = {"model.layers.*.mlp.gate_up_proj": "packed_colwise",
               "model.layers.*.mlp.down_proj": "rowwise"}
# family -> the instance tp plan's changes; Mixtral's own plan packs its experts' gate_up.
PACKED_CASES: dict[str, dict[str, str]] = {"phi3": PHI3_PACKED, "mixtral": {}}


def packed_model(family: str, layout: str, seed: int) -> tuple[Any, Any]:
    """(model, plan) of ``family`` on meta under ``layout`` ("tp": TP over every rank, with
    PACKED_CASES' plan; "fsdp2": FSDP2 over every rank), initialized by MetaInit(seed)."""
    import torch.distributed as dist

    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan

    world = dist.get_world_size()
    model = build(family)
    if layout == "tp":
        model._tp_plan = {**model._tp_plan, **PACKED_CASES[family]}
        plan = ParallelPlan(MeshSpec(tp=world)).use(TP())
    else:
        plan = ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2())
    plan = plan.use(MetaInit(seed=seed))
    return plan.apply(model), plan


def initial(family: str) -> dict[str, Any]:
    """The single-process parameters and buffers MetaInit(SEED) gives ``family``."""
    import torch

    from composer_par.plugin.initialize import materialize

    model = build(family)
    materialize(model, torch.device("cpu"), SEED)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parts_differ(model: Any, expected: dict[str, Any], optimizer: Any = None,
                  expected_optimizer: dict[str, Any] | None = None) -> list[str]:
    """The state-dict entries (and optimizer states) whose part on this rank is not
    bitwise the same part of ``expected`` (sliced as DTensor itself slices)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from composer_par.plugin import clean_name

    pairs = [(clean_name(n), t, expected[clean_name(n)]) for n, t in model.state_dict().items()]
    if optimizer is not None:
        assert expected_optimizer is not None
        state = get_optimizer_state_dict(model, optimizer)["state"]
        pairs += [(f"{name}:{k}", v, expected_optimizer[f"{name}:{k}"])
                  for name, values in state.items() for k, v in values.items()]
    out = []
    for name, tensor, ref in pairs:
        mine = _local_part(tensor).detach()
        theirs = _same_part(ref, tensor)
        if mine.shape != theirs.shape or not torch.equal(mine, theirs):
            out.append(name)
    return out


def full_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whole tensors of the model's state dict and of its optimizer's states (by
    ``parameter:state``), gathered on every rank."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from composer_par.plugin import clean_name

    def whole(t: Any) -> Any:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    model_state = {clean_name(n): whole(t) for n, t in model.state_dict().items()}
    optim = get_optimizer_state_dict(model, optimizer)["state"]
    return model_state, {f"{name}:{k}": whole(v) for name, values in optim.items()
                         for k, v in values.items()}


def packed_checkpoints(directory: str) -> list[dict[str, Any]]:
    """For each PACKED_CASES family, on this process group: TP with packed weights from
    MetaInit(SEED) (its parts bitwise the single-process model's) takes one Adam step and
    is saved, with its optimizer, by composer_par.checkpoint; it is loaded into FSDP2 and
    into TP (each first initialized from another seed), and the FSDP2 copy, saved, into
    TP again: every rank's part of every tensor and optimizer state is compared bitwise
    with the saved model's. The TP checkpoint is left for one process to load; the saved
    model's whole tensors are returned (rank 0) to compare it with."""
    import os

    import torch
    from torch.distributed.tensor import DTensor

    from composer_par import checkpoint
    from composer_par.checkpoint.strided import strided_alone

    def adam(model: Any) -> Any:
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    out = []
    for family in PACKED_CASES:
        row: dict[str, Any] = {"family": family}
        try:
            tp, _ = packed_model(family, "tp", SEED)
            row["strided"] = sorted(n for n, p in tp.named_parameters()
                                    if isinstance(p, DTensor) and strided_alone(p.placements))
            row["initial"] = _parts_differ(tp, initial(family))
            optimizer = adam(tp)
            tp(**batch(family, 0)).loss.backward()
            optimizer.step()
            saved_model, saved_optim = full_state(tp, optimizer)
            saved = os.path.join(directory, f"{family}-tp")
            checkpoint.save(saved, tp, optimizer, step=0)
            for layout in ("fsdp2", "tp"):
                model, _ = packed_model(family, layout, SEED + 1)
                optimizer = adam(model)
                checkpoint.load(saved, model, optimizer)
                row[f"tp->{layout}"] = _parts_differ(model, saved_model, optimizer,
                                                     saved_optim)
                if layout == "fsdp2":
                    checkpoint.save(os.path.join(directory, f"{family}-fsdp2"), model,
                                    optimizer, step=0)
            model, _ = packed_model(family, "tp", SEED + 1)
            optimizer = adam(model)
            checkpoint.load(os.path.join(directory, f"{family}-fsdp2"), model, optimizer)
            row["fsdp2->tp"] = _parts_differ(model, saved_model, optimizer, saved_optim)
            if torch.distributed.get_rank() == 0:
                row["saved"] = (saved_model, saved_optim)
        except Exception:
            row["error"] = traceback.format_exc()[-3000:]
        out.append(row)
    return out


# -- the model's own FSDP plan ------------------------------------------------------------


def own_fsdp_units(family: str) -> dict[str, Any]:
    """FSDP2 over every rank on ``family`` (MetaInit): which of its modules are FSDP units
    and, after one forward (no backward), which hold their parameters unsharded (kept
    whole from forward to backward) or sharded again."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(dp_shard=dist.get_world_size())).use(FSDP2()).use(
        MetaInit(seed=SEED))
    model = plan.apply(build(family))
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n)
    with torch.no_grad():
        model(**{k: v for k, v in batch(family, 0).items() if k != "labels"})
    sharded = {n: isinstance(m.weight, DTensor) for n, m in model.named_modules()
               if n in units and isinstance(getattr(m, "weight", None), torch.Tensor)}
    return {"units": units, "sharded_after_forward": sharded,
            "applied": [s.detail for s in plan.applied if s.plugin == "fsdp2"]}
