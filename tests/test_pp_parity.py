"""PP at parity on real gloo ranks: every schedule, every composition, one training loop.

Each case trains with ``plan.training_step`` (the loop every plan shares) and is compared
with plain single-process training on the same global batch from the same MetaInit
weights: losses and every parameter (each rank's stage, gathered) at the design's fp32
tolerance (rtol 1.3e-6, atol 1e-5), and, where the case clips, the gradient norm the
plan's ``clip_grad_norm_`` computes against torch's ``clip_grad_norm_`` on one process.

Six steps per case rather than ten: this machine's two cores run the ranks of every
case of a world size in one launch, and six steps already compound any gradient error
(the losses must fall, too). Cases of one world size share a launch (starting 8
processes costs more than a case).
"""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ParityCase
from tests.pp_workers import StepCase, check_step_cases, refusals

pytestmark = pytest.mark.distributed

STEPS = 6


def plan_toml(mesh: str, *plugins: str) -> str:
    tables = "\n".join(f"[[plugins]]\n{p.strip()}\n" for p in plugins)
    return f"[mesh]\n{mesh}\n\n{tables}\n[[plugins]]\nname = \"meta_init\"\nseed = 7\n"


def pp(schedule: str, **opts: object) -> str:
    extra = "".join(f"\n{k} = {v!r}".replace("'", '"') for k, v in opts.items())
    return f'name = "pp"\nschedule = "{schedule}"{extra}'


# SGD learning rates at which each task's loss falls steadily over the steps (the MLP
# and the encoder diverge at 1.0).
LR = {"mlp": 0.2, "encoder": 0.05}


def case(task: str, mesh: str, *plugins: str, world: int, clip: float | None = None,
         try_torch_clip: bool = False) -> StepCase:
    parity = ParityCase(task=f"tests.pp_workers:{task}", plan=plan_toml(mesh, *plugins),
                        world_size=world, steps=STEPS, lr=LR.get(task, 1.0))
    return StepCase(parity, clip=clip, try_torch_clip=try_torch_clip)


def check(cases: dict[str, StepCase], timeout: float) -> list[list[float | str]]:
    results = check_step_cases(list(cases.values()), timeout=timeout)
    norms_seen = []
    for (name, c), (result, norms, ref_norms) in zip(cases.items(), results, strict=True):
        try:
            result.assert_close()
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        assert result.losses[-1] < result.losses[0], (name, result.losses)
        numbers = [n for n in norms if not isinstance(n, str)]
        if c.clip is not None:
            assert len(numbers) == len(ref_norms) == STEPS, name
            for ours, theirs in zip(numbers, ref_norms, strict=True):
                assert abs(ours - theirs) <= 1e-5 * theirs, (name, numbers, ref_norms)
            # Clipping must have bitten, or the parity says nothing about it.
            assert max(ref_norms) > c.clip, (name, ref_norms)
        norms_seen.append(norms)
    return norms_seen


MLP, HF, LLAMA4, LLAMA8 = "mlp", "hf_style", "llama4", "llama8"


def test_two_stages_every_schedule_and_model_kind() -> None:
    cases = {
        "GPipe": case(LLAMA4, "pp = 2", pp("GPipe"), world=2, clip=0.5),
        "1F1B": case(LLAMA4, "pp = 2", pp("1F1B"), world=2),
        "Interleaved1F1B": case(LLAMA4, "pp = 2", pp("Interleaved1F1B", stages_per_rank=2),
                                world=2, clip=0.5),
        "ZBVZeroBubble": case(LLAMA4, "pp = 2", pp("ZBVZeroBubble"), world=2),
        "DualPipeV": case(LLAMA4, "pp = 2", pp("DualPipeV"), world=2),
        "InterleavedZeroBubble": case(LLAMA4, "pp = 2",
                                      pp("InterleavedZeroBubble", stages_per_rank=2), world=2),
        "LoopedBFS Sequential stack": case(MLP, "pp = 2", pp("LoopedBFS", stages_per_rank=2),
                                           world=2),
        "1F1B nn.TransformerEncoder": case("encoder", "pp = 2", pp("1F1B"), world=2),
        "Hugging Face style, its pp plan": case(HF, "pp = 2", pp("1F1B", split="pp_plan"),
                                                world=2, clip=0.5),
        "Hugging Face LlamaForCausalLM, its pp plan": case(
            "hf_llama", "pp = 2", pp("1F1B", split="pp_plan"), world=2, clip=0.5),
        # Its last stage without the head returns a view of the hidden state, which the
        # split backward detaches in place: the stage sends a copy. Clipped: unclipped at
        # lr 1, 4 microbatches' summation order (any schedule) grows past atol in 6 steps.
        "Hugging Face LlamaForCausalLM, ZBVZeroBubble": case(
            "hf_llama", "pp = 2", pp("ZBVZeroBubble"), world=2, clip=0.5),
        "1F1B, selective AC, compiled through aot_eager": case(
            LLAMA4, "pp = 2", pp("1F1B"), 'name = "activation_checkpoint"\nmode = "selective"',
            'name = "compile"\nbackend = "aot_eager"', world=2),
        "explicit split": case(LLAMA4, "pp = 2", pp("GPipe", split=[
            ["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm",
                                             "output"]]), world=2),
    }
    check(cases, timeout=600)


def test_one_loss_for_the_model_output_with_and_without_a_pipeline() -> None:
    """``loss_fn`` is given what the model's own forward returns under every plan: a loss
    reading ``outputs.logits`` off Hugging Face's ``CausalLMOutputWithPast`` (and refusing
    anything else) trains at parity under PP and without; the project's Llama returns
    its logits tensor, and its loss takes that tensor under both."""
    fsdp = 'name = "fsdp2"'
    # Clipped as the other LlamaForCausalLM cases are: unclipped at lr 1, the microbatches'
    # summation order grows past atol in 6 steps.
    cases = {
        "LlamaForCausalLM, outputs.logits, GPipe": case("hf_llama", "pp = 2", pp("GPipe"),
                                                        world=2, clip=0.5),
        "LlamaForCausalLM, outputs.logits, 1F1B, its pp plan": case(
            "hf_llama", "pp = 2", pp("1F1B", split="pp_plan"), world=2, clip=0.5),
        "LlamaForCausalLM, outputs.logits, FSDP2 without a pipeline": case(
            "hf_llama", "dp_shard = 2", fsdp, world=2, clip=0.5),
        "Llama, logits tensor, GPipe": case(LLAMA4, "pp = 2", pp("GPipe"), world=2),
        "Llama, logits tensor, FSDP2 without a pipeline": case(LLAMA4, "dp_shard = 2", fsdp,
                                                               world=2),
    }
    check(cases, timeout=600)


def test_four_stages_and_two_by_two_compositions() -> None:
    fsdp, tp, hsdp = 'name = "fsdp2"', 'name = "tp"', 'name = "hsdp"'
    cases = {
        "pp 4 GPipe": case(LLAMA8, "pp = 4", pp("GPipe"), world=4),
        "pp 4 1F1B": case(LLAMA8, "pp = 4", pp("1F1B"), world=4, clip=0.5),
        "pp 4 Interleaved1F1B": case(LLAMA8, "pp = 4", pp("Interleaved1F1B", stages_per_rank=2),
                                     world=4),
        "pp 4 ZBVZeroBubble": case(LLAMA8, "pp = 4", pp("ZBVZeroBubble"), world=4),
        "PP x FSDP2": case(LLAMA4, "pp = 2\ndp_shard = 2", pp("1F1B"), fsdp, world=4, clip=0.5),
        # FSDP2 resharding after forward gives split-backward schedules wrong weight
        # gradients on torch 2.13; the plugin keeps those modules unsharded until backward.
        "PP x FSDP2 ZBVZeroBubble": case(LLAMA4, "pp = 2\ndp_shard = 2", pp("ZBVZeroBubble"),
                                         fsdp, world=4),
        "PP x TP": case(LLAMA4, "pp = 2\ntp = 2", pp("1F1B"), tp, world=4, clip=0.5),
        "Hugging Face LlamaForCausalLM, PP x TP (its tp and pp plans)": case(
            "hf_llama", "pp = 2\ntp = 2", pp("1F1B", split="pp_plan"), tp, world=4,
            clip=0.5),
        "PP x HSDP": case(LLAMA4, "pp = 2\ndp_replicate = 2",
                          pp("Interleaved1F1B", stages_per_rank=2), hsdp, world=4),
        # No pipeline: what TP leaves alone (here all but the feed-forward) is on another
        # mesh than what it splits, which torch's clip_grad_norm_ cannot take; the plan's
        # clipping can (FSDP2 over TP shards with _StridedShard, which is no Shard).
        "FSDP2 x TP, embedding not split": case(
            LLAMA4, "dp_shard = 2\ntp = 2", fsdp,
            'name = "tp"\nreplicate_rest = false\nplan = {"layers.*.feed_forward.w1" = '
            '"colwise", "layers.*.feed_forward.w3" = "colwise", '
            '"layers.*.feed_forward.w2" = "rowwise"}',
            world=4, clip=0.5, try_torch_clip=True),
    }
    norms = check(cases, timeout=900)
    torch_says = norms[-1][0]
    assert isinstance(torch_says, str) and "mesh" in torch_says.lower(), torch_says


def test_the_embedding_and_the_head_as_stages_of_their_own() -> None:
    """Three stages per rank over four blocks: the first stage runs only the embedding,
    the last only the norm, the head and the loss (the split past one block a stage),
    alone and under FSDP2 and TP with sequence parallelism."""
    six = pp("Interleaved1F1B", stages_per_rank=3, microbatches=4)
    check({"Llama": case(LLAMA4, "pp = 2", six, world=2),
           "Hugging Face LlamaForCausalLM": case("hf_llama", "pp = 2", six, world=2,
                                                 clip=0.5)}, timeout=600)
    check({"PP x FSDP2": case(LLAMA4, "pp = 2\ndp_shard = 2", six, 'name = "fsdp2"',
                              world=4, clip=0.5),
           "PP x TP, sequence parallel": case(LLAMA4, "pp = 2\ntp = 2", six,
                                              'name = "tp"\nsequence_parallel = true',
                                              world=4)}, timeout=600)


def test_pp_tp_sequence_parallel() -> None:
    """The first stage holds the embedding, the last the norm and head, a middle one
    blocks only: between stages the residual stream is each tp rank's sequence shard,
    as it is between blocks (four stages: two of them middle ones)."""
    tp = 'name = "tp"\nsequence_parallel = true'
    check({"PP x TP, sequence parallel": case(LLAMA4, "pp = 2\ntp = 2", pp("GPipe"), tp,
                                               world=4),
           "PP x TP, sequence parallel, four stages": case(
               LLAMA4, "pp = 2\ntp = 2", pp("Interleaved1F1B", stages_per_rank=2), tp,
               world=4, clip=0.5)}, timeout=600)


def test_pp_fsdp2_tp_on_eight_ranks_with_and_without_checkpointing() -> None:
    mesh = "pp = 2\ndp_shard = 2\ntp = 2"
    fsdp, tp = 'name = "fsdp2"', 'name = "tp"'
    cases = {
        "PP x FSDP2 x TP": case(LLAMA4, mesh, pp("1F1B"), fsdp, tp, world=8, clip=0.5),
        "PP x FSDP2 x TP, full AC": case(LLAMA4, mesh, pp("Interleaved1F1B", stages_per_rank=2),
                                         fsdp, tp,
                                         'name = "activation_checkpoint"\nmode = "full"',
                                         world=8),
    }
    check(cases, timeout=900)


def test_refusals_at_step_and_apply_time() -> None:
    out = run_ranks(refusals, 2, timeout=300)
    for rank in out:
        assert rank["batch"].startswith("ERROR CP604 [pp]"), rank["batch"]
        assert "6 sample(s)" in rank["batch"] and "4 microbatches" in rank["batch"]
        assert rank["compile"].startswith("ERROR CP606 [pp]"), rank["compile"]
