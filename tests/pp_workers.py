"""Rank-side functions for tests/test_pp*.py (importable by rank processes).

A case trains with the plan's training step (``plan.training_step``), the one loop for
every plan, and is compared with plain single-process training on the same global batch
from the same MetaInit weights (:mod:`composer_par.testing.parity`'s reference, with
``clip_grad_norm_`` of torch when the case clips).
"""

from __future__ import annotations

from typing import Any

import attrs

from composer_par.testing.parity import ParityCase, ParityResult
from composer_par.testing.tasks import EncoderTask, LlamaTask, MLPTask

# Tiny models with enough blocks for 8 stages: a step of these takes milliseconds.
llama4 = LlamaTask(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)
llama8 = LlamaTask(n_layers=8, dim=32, vocab_size=128, global_batch=8, seq_len=8)
llama8_b16 = LlamaTask(n_layers=8, dim=32, vocab_size=128, global_batch=16, seq_len=8)
mlp = MLPTask(width=16, depth=4, global_batch=16)
encoder = EncoderTask(width=16, n_layers=4, n_heads=2, seq_len=4, global_batch=8)


# -- a model built as Hugging Face builds its causal LMs (without the library) ------------


class HFStyleConfig:
    """What a Hugging Face config says about the pipeline: its base model's plan."""

    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(self, layers: int) -> None:
        self.num_hidden_layers = layers


def _hf_base(cfg: Any, llama_cfg: Any) -> Any:
    import torch.nn as nn

    from composer_par.models.llama import DecoderLayer, RMSNorm

    class HFStyleModel(nn.Module):
        """A base model: embed_tokens, layers, norm; called with input_ids or
        inputs_embeds keywords, returning a mapping (a ModelOutput is one)."""

        def __init__(self) -> None:
            super().__init__()
            self.config = cfg
            self.embed_tokens = nn.Embedding(llama_cfg.vocab_size, llama_cfg.dim)
            self.layers = nn.ModuleList(
                DecoderLayer(llama_cfg) for _ in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(llama_cfg.dim)

        def forward(self, input_ids: Any = None, inputs_embeds: Any = None) -> Any:
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            hidden = inputs_embeds
            for layer in self.layers[: self.config.num_hidden_layers]:
                hidden = layer(hidden)
            return {"last_hidden_state": self.norm(hidden), "past_key_values": None}

    return HFStyleModel()


def build_hf_style(layers: int, llama_cfg: Any) -> Any:
    import torch.nn as nn

    cfg = HFStyleConfig(layers)

    class HFStyleForCausalLM(nn.Module):
        base_model_prefix = "model"
        _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

        def __init__(self) -> None:
            super().__init__()
            self.config = cfg
            self.model = _hf_base(cfg, llama_cfg)
            self.lm_head = nn.Linear(llama_cfg.dim, llama_cfg.vocab_size, bias=False)

        def forward(self, input_ids: Any) -> Any:
            out = self.model(input_ids=input_ids)
            return {"logits": self.lm_head(out["last_hidden_state"]), "past_key_values": None}

    return HFStyleForCausalLM()


@attrs.frozen
class HFStyleTask(LlamaTask):
    def build(self) -> Any:
        return build_hf_style(self.n_layers, self.config())


hf_style = HFStyleTask(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)


@attrs.frozen
class HFLlamaTask(LlamaTask):
    """Hugging Face's own ``LlamaForCausalLM``, from a tiny config (nothing downloaded)."""

    def build(self) -> Any:
        import transformers

        cfg = transformers.LlamaConfig(
            hidden_size=self.dim, intermediate_size=2 * self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, head_dim=self.dim // self.n_heads,
            vocab_size=self.vocab_size, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return transformers.LlamaForCausalLM(cfg)


hf_llama = HFLlamaTask(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)


# -- Hugging Face decoders whose layers differ by type (config.layer_types) --------------
# Each forward picks a layer's mask (and in Gemma 3 its rotary embedding) by
# config.layer_types[i], i counting the layers it iterates; the types are chosen so that
# the last stage's layers differ from the first stage's, and the sequence (8) is longer
# than the sliding window (4), so a sliding layer run as a full one changes the losses.

_SLIDING, _FULL = "sliding_attention", "full_attention"
# Taken by every config's base class, though not in the typed signatures.
_EAGER: dict[str, Any] = {"attn_implementation": "eager"}


@attrs.frozen
class HFQwen2SlidingTask(LlamaTask):
    """Qwen2 with sliding layers: layers 0-3 full, 4-5 sliding (``max_window_layers``)."""

    def build(self) -> Any:
        import transformers

        cfg = transformers.Qwen2Config(
            hidden_size=self.dim, intermediate_size=2 * self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, vocab_size=self.vocab_size,
            max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
            use_sliding_window=True, sliding_window=4, max_window_layers=4,
            **_EAGER)
        return transformers.Qwen2ForCausalLM(cfg)


@attrs.frozen
class HFGemma3Task(LlamaTask):
    """Gemma 3 text: sliding and full layers, each type with its own rotary embedding."""

    def build(self) -> Any:
        import transformers

        cfg = transformers.Gemma3TextConfig(
            hidden_size=self.dim, intermediate_size=2 * self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, head_dim=self.dim // self.n_heads,
            vocab_size=self.vocab_size, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=False, sliding_window=4,
            layer_types=[_SLIDING, _FULL, _FULL, _SLIDING], **_EAGER)
        return transformers.Gemma3ForCausalLM(cfg)


@attrs.frozen
class HFGptOssTask(LlamaTask):
    """gpt-oss (mixture of experts, attention sinks): two sliding layers, then two full."""

    def build(self) -> Any:
        import transformers

        cfg = transformers.GptOssConfig(
            hidden_size=self.dim, intermediate_size=2 * self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, head_dim=self.dim // self.n_heads,
            vocab_size=self.vocab_size, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=False, sliding_window=4, num_local_experts=4,
            num_experts_per_tok=2, layer_types=[_SLIDING, _SLIDING, _FULL, _FULL],
            **_EAGER)
        return transformers.GptOssForCausalLM(cfg)


@attrs.frozen
class HFGraniteTask(LlamaTask):
    """Granite with a real checkpoint's multipliers: its causal LM divides the head's
    output by ``logits_scaling`` and its base model multiplies the embedding's output by
    ``embedding_multiplier``, both outside any module a stage could leave out."""

    def build(self) -> Any:
        import transformers

        cfg = transformers.GraniteConfig(
            hidden_size=self.dim, intermediate_size=2 * self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, vocab_size=self.vocab_size,
            max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
            logits_scaling=8.0, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=1 / 16, **_EAGER)
        return transformers.GraniteForCausalLM(cfg)


@attrs.frozen
class HFGemma2Task(LlamaTask):
    """Gemma 2: its causal LM softcaps the head's output (``final_logit_softcapping``,
    30 in its checkpoints; smaller here so that a stage applying it to its hidden state
    shows in the losses of a few steps)."""

    def build(self) -> Any:
        import transformers

        cfg = transformers.Gemma2Config(
            hidden_size=self.dim, intermediate_size=2 * self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, head_dim=self.dim // self.n_heads,
            vocab_size=self.vocab_size, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=False, sliding_window=4, final_logit_softcapping=2.0,
            **_EAGER)
        return transformers.Gemma2ForCausalLM(cfg)


hf_qwen2_sliding = HFQwen2SlidingTask(n_layers=6, dim=32, vocab_size=128, global_batch=8,
                                      seq_len=8)
hf_gemma3 = HFGemma3Task(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)
hf_gpt_oss = HFGptOssTask(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)
hf_granite = HFGraniteTask(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)
hf_gemma2 = HFGemma2Task(n_layers=4, dim=32, vocab_size=128, global_batch=8, seq_len=8)


def split_batch(task: Any, batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a task's batch, as the training step takes them."""
    if isinstance(task, LlamaTask):
        return batch, batch  # next-token loss shifts the tokens itself
    return batch[..., :-1], batch[..., -1:]


def loss_fn_for(task: Any) -> Any:
    """The task's loss as ``loss_fn(outputs, targets)``, written for what the task's model
    returns (with or without a pipeline, the training step hands it that): Hugging Face's
    ``LlamaForCausalLM`` its ``CausalLMOutputWithPast``, the Hugging Face-style model a
    dict, the project's Llama its logits tensor."""
    if isinstance(task, HFLlamaTask):
        return logits_attribute_loss
    if isinstance(task, (HFQwen2SlidingTask, HFGemma3Task, HFGptOssTask, HFGraniteTask,
                         HFGemma2Task)):
        return output_logits_loss
    if isinstance(task, HFStyleTask):
        from composer_par.models.llama import next_token_loss

        return lambda outputs, tokens: next_token_loss(outputs["logits"], tokens)
    if isinstance(task, LlamaTask):
        from composer_par.models.llama import next_token_loss

        return next_token_loss

    def mse(outputs: Any, targets: Any) -> Any:
        return ((outputs - targets) ** 2).mean()

    return mse


def logits_attribute_loss(outputs: Any, tokens: Any) -> Any:
    """Next-token cross-entropy read from a Hugging Face causal LM's own output object, as
    a user writes it for the model: ``outputs.logits``; refuses anything else."""
    import torch.nn.functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if not isinstance(outputs, CausalLMOutputWithPast):
        raise TypeError(f"the loss was given {type(outputs).__name__}, not the model's "
                        "CausalLMOutputWithPast")
    logits = outputs.logits
    assert logits is not None
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def output_logits_loss(outputs: Any, tokens: Any) -> Any:
    """Next-token cross-entropy read from any Hugging Face model output's ``logits``."""
    import torch.nn.functional as F

    logits = outputs.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


@attrs.frozen
class StepCase:
    parity: ParityCase
    clip: float | None = None  # clip_grad_norm_ to this before each optimizer step
    # Record what torch.nn.utils.clip_grad_norm_ raises on the first step's gradients
    # (it modifies nothing when it fails), to show the plan's clipping is needed.
    try_torch_clip: bool = False


def gathered_parameters(model: Any) -> dict[str, Any]:
    """Every parameter of the whole model, full, on every rank: each pipeline stage's
    ranks gather their own (DTensor collectives), then every rank's dict is shared."""
    import torch.distributed as dist

    from composer_par.testing.parity import full_parameters

    mine = full_parameters(model)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, Any] = {}
    for params in everyone:
        for name, value in params.items():
            if name in merged:
                assert bool((merged[name] == value).all()), f"ranks disagree on {name}"
            merged[name] = value
    return merged


def train_step_case(case: StepCase
                    ) -> tuple[list[float], dict[str, Any] | None, list[float | str]]:
    """One rank: build on meta, apply, train with the training step. Returns the losses
    (as every rank saw them: the same), the full parameters (rank 0) and the norms."""
    import torch
    import torch.distributed as dist

    from composer_par.testing.parity import _optimizer, _resolve, build_plan

    task = _resolve(case.parity.task)
    plan = build_plan(case.parity.plan)
    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    if plan.pipeline is not None:
        # The rank built, sharded and allocated its own stages' parameters only.
        from composer_par.blocks import clean_name

        owned = [path for part in plan.pipeline.parts for path in part.modules]
        names = [clean_name(n) for n, _ in model.named_parameters()]
        assert names and all(any(n.startswith(o + ".") for o in owned) for n in names), names
        assert not any(p.is_meta for p in model.parameters())
    index, count = plan.data_shard()
    optimizer = _optimizer(case.parity, model.parameters())
    step = plan.training_step(model, loss_fn_for(task))
    losses: list[float] = []
    norms: list[float | str] = []
    for n in range(case.parity.steps):
        inputs, targets = split_batch(task, task.batch(n).chunk(count)[index])
        loss = step.step(inputs, targets)
        seen = [torch.empty(()) for _ in range(dist.get_world_size())]
        dist.all_gather(seen, loss)
        assert all(bool(s == seen[0]) for s in seen), f"ranks returned different losses: {seen}"
        if case.try_torch_clip and n == 0:
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            except Exception as exc:  # torch's failure is the result
                norms.append(f"{type(exc).__name__}: {exc}")
            else:
                norms.append("torch's clip_grad_norm_ worked")
        if case.clip is not None:
            norms.append(float(step.clip_grad_norm_(case.clip)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    params = gathered_parameters(model)
    return losses, params if dist.get_rank() == 0 else None, norms


def refusals() -> dict[str, str]:
    """What a pipeline refuses at step time and at apply time, by case (2 ranks)."""
    import torch
    from composer_par.plugins.pp import PipelineError

    from composer_par import PP, Compile, MeshSpec, MetaInit, ParallelPlan, PlanError

    out: dict[str, str] = {}
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="GPipe", microbatches=4)).use(
        MetaInit(seed=1))
    with torch.device("meta"):
        model = llama4.build()
    model = plan.apply(model)
    step = plan.training_step(model, loss_fn_for(llama4))
    batch = llama4.batch(0)[:6]
    try:
        step.step(batch, batch)
        out["batch"] = "stepped"
    except PipelineError as exc:
        out["batch"] = str(exc)
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="ZBVZeroBubble")).use(
        Compile(backend="aot_eager")).use(MetaInit(seed=1))
    with torch.device("meta"):
        model = llama4.build()
    # Found by validation, before the model is split or compiled.
    try:
        plan.apply(model)
        out["compile"] = "applied"
    except PlanError as exc:
        out["compile"] = exc.report.format()
    return out


def train_step_cases(cases: list[StepCase]) -> list[Any]:
    """Several cases in one run of the ranks (starting processes costs more than a step)."""
    return [train_step_case(case) for case in cases]


def reference(case: StepCase) -> tuple[list[float], dict[str, Any], list[float]]:
    """Single-process training of the same task and batches (torch's clip_grad_norm_)."""
    import torch

    from composer_par import MeshSpec, ParallelPlan
    from composer_par.testing.parity import _optimizer, _resolve, build_plan, full_parameters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = _resolve(case.parity.task)
        meta_init = build_plan(case.parity.plan).plugin("meta_init")
        assert attrs.has(type(meta_init)), "parity needs a plan that materializes with MetaInit"
        with torch.device("meta"):
            model = task.build()
        model = ParallelPlan(MeshSpec()).use(
            attrs.evolve(meta_init, device="cpu")).apply(model)  # type: ignore[misc, arg-type]
        optimizer = _optimizer(case.parity, model.parameters())
        loss_fn = loss_fn_for(task)
        losses, norms = [], []
        for n in range(case.parity.steps):
            inputs, targets = split_batch(task, task.batch(n))
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            if case.clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                  case.clip)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses, full_parameters(model), norms
    finally:
        torch.set_num_threads(threads)


def check_step_cases(cases: list[StepCase], *, timeout: float
                     ) -> list[tuple[ParityResult, list[float | str], list[float]]]:
    """Run the cases (one world size) on their ranks and the reference; for each, the
    parity result and the gradient norms of the ranks and of the reference."""
    from composer_par.testing.distributed import run_ranks

    sizes = {case.parity.world_size for case in cases}
    assert len(sizes) == 1, f"one world size per run, got {sorted(sizes)}"
    results = run_ranks(train_step_cases, sizes.pop(), args=(cases,), timeout=timeout)[0]
    out = []
    for case, (losses, params, norms) in zip(cases, results, strict=True):
        ref_losses, ref_params, ref_norms = reference(case)
        out.append((ParityResult(losses, ref_losses, params, ref_params), norms, ref_norms))
    return out


# -- checkpoints ----------------------------------------------------------------------------

CHECKPOINT_LAYOUTS: dict[str, tuple[int, str]] = {
    # name -> (world size, plan file text without the materializer)
    "pp_fsdp2": (4, '[mesh]\npp = 2\ndp_shard = 2\n\n[[plugins]]\nname = "pp"\n'
                    'schedule = "1F1B"\n\n[[plugins]]\nname = "fsdp2"\n'),
    "pp_virtual_fsdp2": (4, '[mesh]\npp = 2\ndp_shard = 2\n\n[[plugins]]\nname = "pp"\n'
                            'schedule = "Interleaved1F1B"\nstages_per_rank = 2\n\n'
                            '[[plugins]]\nname = "fsdp2"\n'),
    "fsdp2_4": (4, '[mesh]\ndp_shard = 4\n\n[[plugins]]\nname = "fsdp2"\n'),
    "one_process": (1, "[mesh]\n"),
}


def _checkpoint_plan(layout: str, seed: int) -> Any:
    from composer_par import MetaInit, ParallelPlan

    plan = ParallelPlan.from_toml(CHECKPOINT_LAYOUTS[layout][1])
    return plan.use(MetaInit(seed=seed))


def whole_state(model: Any, optimizer: Any) -> dict[str, Any] | None:
    """Every full tensor of model and optimizer state, every stage's, on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Full tensors on every rank (cpu_offload would keep them on global rank 0 only, which
    # holds no other stage): each stage's ranks gather their own, then ranks share.
    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True))
    mine: dict[str, Any] = {f"model.{k}": v.detach().clone()  # type: ignore[union-attr]
                            for k, v in msd.items()}
    optim_state: dict[str, Any] = osd["state"]  # type: ignore[assignment]
    for fqn, entry in optim_state.items():
        for key, value in entry.items():
            mine[f"optim.{fqn}.{key}"] = (value.detach().clone()
                                          if isinstance(value, torch.Tensor) else value)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, Any] = {}
    for part in everyone:
        merged.update(part)
    return merged


def pp_save(root: str, layout: str) -> dict[str, Any] | None:
    """Train ``layout`` 2 steps (AdamW, the training step) and save it to ``root/layout``;
    rank 0 returns the whole state saved."""
    import torch

    from composer_par.checkpoint import save

    plan = _checkpoint_plan(layout, seed=11)
    with torch.device("meta"):
        model = llama4.build()
    model = plan.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    step = plan.training_step(model, loss_fn_for(llama4))
    index, count = plan.data_shard()
    for n in range(2):
        inputs, targets = split_batch(llama4, llama4.batch(n).chunk(count)[index])
        step.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
    save(f"{root}/{layout}", model, optimizer, step=2, plan=plan)
    return whole_state(model, optimizer)


def pp_load(root: str, saved: str, layout: str, strict: bool) -> dict[str, Any]:
    """A fresh model of ``layout`` (another seed, a fresh AdamW) loads ``root/saved``;
    rank 0 returns the whole state, every rank its optimizer's parameter groups."""
    import torch

    from composer_par.checkpoint import load

    plan = _checkpoint_plan(layout, seed=99)
    with torch.device("meta"):
        model = llama4.build()
    model = plan.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    info = load(f"{root}/{saved}", model, optimizer, strict=strict)
    assert info.step == 2
    state = whole_state(model, optimizer)
    # The loaded optimizer steps its own parameters with the saved hyperparameters.
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    held = sum(len(g["params"]) for g in optimizer.param_groups)
    # On every rank (the others' state is None): each holds its own parameter groups.
    state = state if state is not None else {}
    state["groups"] = groups
    state["held"] = held == len(list(model.parameters()))
    return state


def pp_export(directory: str, layout: str) -> dict[str, Any] | None:
    """``export_safetensors`` from ``layout`` (MetaInit seed 11); rank 0 returns the whole
    model state exported."""
    import torch

    from composer_par.checkpoint import export_safetensors

    plan = _checkpoint_plan(layout, seed=11)
    with torch.device("meta"):
        model = llama4.build()
    model = plan.apply(model)
    export_safetensors(model, directory, plan=plan)
    state = whole_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return {k: v for k, v in state.items() if k.startswith("model.")} if state else None


def pp_load_safetensors(directory: str, layout: str, strict: bool = True
                        ) -> tuple[dict[str, Any] | None, int, list[str]]:
    """``layout`` materialized by LoadSafetensors from ``directory``: rank 0's whole model
    state, this rank's bytes read and the tensors it loaded."""
    import torch

    from composer_par import LoadSafetensors, ParallelPlan

    plan = ParallelPlan.from_toml(CHECKPOINT_LAYOUTS[layout][1]).use(
        LoadSafetensors(path=directory, strict=strict))
    with torch.device("meta"):
        model = llama4.build()
    model = plan.apply(model)
    report = plan.notes["load_safetensors_report"]
    state = whole_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model_state = {k: v for k, v in state.items() if k.startswith("model.")} if state else None
    return model_state, report.bytes_read, list(report.loaded)


def pp_save_many(root: str, layouts: list[str]) -> dict[str, Any]:
    return {layout: pp_save(root, layout) for layout in layouts}


def pp_load_many(root: str, loads: list[tuple[str, str, bool]]) -> dict[str, Any]:
    """``pp_load`` for each ``(saved, layout, strict)``; the error text where one raised."""
    from composer_par.checkpoint import CheckpointError

    out: dict[str, Any] = {}
    for saved, layout, strict in loads:
        try:
            out[f"{saved}->{layout}"] = pp_load(root, saved, layout, strict)
        except CheckpointError as exc:
            out[f"{saved}->{layout}"] = f"{type(exc).__name__}: {exc}"
    return out


def observed_order(schedule: str, per_rank: int, microbatches: int) -> list[tuple[str, int]]:
    """The order this rank runs forwards and backwards of its stages in one real step of
    ``schedule`` (module hooks on each stage's part): ``(kind, stage)`` pairs."""
    import torch

    from composer_par import PP, MeshSpec, MetaInit, ParallelPlan

    world = torch.distributed.get_world_size()
    plan = ParallelPlan(MeshSpec(pp=world)).use(
        PP(schedule=schedule, stages_per_rank=per_rank, microbatches=microbatches)).use(
        MetaInit(seed=3))
    with torch.device("meta"):
        model = llama8.build()
    model = plan.apply(model)
    assert plan.pipeline is not None
    seen: list[tuple[str, int]] = []
    for part in plan.pipeline.parts:
        def forward(module: Any, args: Any, stage: int = part.stage) -> None:
            seen.append(("F", stage))

        def backward(module: Any, grad_in: Any, grad_out: Any, stage: int = part.stage
                     ) -> None:
            seen.append(("B", stage))

        part.module.register_forward_pre_hook(forward)
        # A stage hands on the hidden state its last block made, not its forward's return
        # value (the ops around the head run on the last stage only), so the backward is
        # seen on that block.
        part.blocks[-1][1].register_full_backward_hook(backward)
    step = plan.training_step(model, loss_fn_for(llama8))
    batch = llama8_b16.batch(0)
    step.step(batch, batch)  # the first step also runs torch's shape inference
    seen.clear()
    step.step(batch, batch)
    return seen


# -- checkpoints of other models, and what a load left aside -------------------------------


def pp_save_depth(root: str, layers: int) -> None:
    """One process: llama4 with ``layers`` blocks instead, two AdamW steps as ``pp_save``,
    saved to ``root/layers-N``: a checkpoint with more (or fewer) keys than llama4."""
    import torch

    from composer_par.checkpoint import save

    task = attrs.evolve(llama4, n_layers=layers)
    plan = _checkpoint_plan("one_process", seed=11)
    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    step = plan.training_step(model, loss_fn_for(task))
    for n in range(2):
        inputs, targets = split_batch(task, task.batch(n))
        step.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
    save(f"{root}/layers-{layers}", model, optimizer, step=2, plan=plan)


def pp_safetensors_report(directory: str, layout: str, strict: bool
                          ) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """``layout`` materialized by LoadSafetensors: this rank's report's unexpected and
    missing keys and the number of tensors it loaded."""
    import torch

    from composer_par import LoadSafetensors, ParallelPlan

    plan = ParallelPlan.from_toml(CHECKPOINT_LAYOUTS[layout][1]).use(
        LoadSafetensors(path=directory, strict=strict))
    with torch.device("meta"):
        model = llama4.build()
    plan.apply(model)
    report = plan.notes["load_safetensors_report"]
    return tuple(report.unexpected), tuple(report.missing), len(report.loaded)


# -- ops around the head and the embedding ---------------------------------------------------


def boundary_events(task_name: str) -> list[dict[str, Any]]:
    """One PP 2 training step of a task; the pipeline's log events naming the ops each
    stage left to the stage holding the modules they follow (as every rank logged them)."""
    import logging

    import torch

    from composer_par import PP, MeshSpec, MetaInit, ParallelPlan

    events: list[dict[str, Any]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict) and "stage" in record.msg:
                events.append(dict(record.msg))

    logger = logging.getLogger("composer_par.plugins.pp.boundary")
    handler = Keep(logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        task = globals()[task_name]
        plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="1F1B")).use(MetaInit(seed=1))
        with torch.device("meta"):
            model = task.build()
        model = plan.apply(model)
        step = plan.training_step(model, loss_fn_for(task))
        inputs, targets = split_batch(task, task.batch(0))
        step.step(inputs, targets)
    finally:
        logger.removeHandler(handler)
    return [{k: v for k, v in e.items() if k in (
        "event", "stage", "model", "left_out_before_first_block", "left_out_after_last_block")}
        for e in events]


def pooled_model() -> Any:
    """Token embedding, then a mean over the sequence outside any module (the blocks take
    one vector per sample), a stack of blocks, a head: a stage after the first cannot hand
    its first block the hidden state it received."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, h: Any) -> Any:
            return h + self.linear(h).tanh()

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.layers = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(16, 32)

        def forward(self, tokens: Any) -> Any:
            h = self.embed(tokens).mean(dim=1)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    return Pooled()


def pooled_step() -> None:
    """A PP 2 step of :func:`pooled_model` (2 ranks): the stage after the first refuses."""
    import torch
    import torch.nn.functional as F

    from composer_par import PP, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="GPipe", microbatches=2)).use(
        MetaInit(seed=1))
    with torch.device("meta"):
        model = pooled_model()
    model = plan.apply(model)
    step = plan.training_step(model, lambda out, target: F.cross_entropy(out, target))
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    step.step(tokens, tokens[:, 0])
