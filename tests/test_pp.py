"""PP without ranks: options, the static and model-aware rules (CP601-CP610), the split,
the stage placement (against torch's own), the pruned parts and the training step on
one process. Distributed parity is in tests/test_pp_parity.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from composer_par.plugins.pp import SCHEDULES
from composer_par.plugins.pp.parts import OnAnotherStage, StageModuleList, build_parts
from composer_par.plugins.pp.schedules import microbatch_problem, placement
from composer_par.plugins.pp.split import SplitError, balanced, compute_split

import composer_par
from composer_par import FSDP2, PP, TP, MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.blocks import find_blocks
from composer_par.findings import PlanError
from composer_par.plugin import STAGES, Stage
from composer_par.plugin.registry import Registry
from composer_par.testing.tasks import LlamaTask
from tests.pp_workers import build_hf_style, llama8

LLAMA2 = LlamaTask(n_layers=2, dim=32, vocab_size=64, seq_len=8)


def codes(plan: ParallelPlan, model: nn.Module | None = None, world: int | None = None
          ) -> list[str]:
    return [f.code for f in plan.validate(model, world_size=world).findings]


def meta(task: Any) -> nn.Module:
    with torch.device("meta"):
        return task.build()  # type: ignore[no-any-return]


# -- the plugin as users meet it ---------------------------------------------------------


def test_pp_is_exported_registered_and_claims_the_pp_dim() -> None:
    assert composer_par.PP is PP
    assert Registry().get("pp") is PP
    (claim,) = PP().claims()
    assert claim.dim == "pp"
    assert PP(dim="stages").claims()[0].dim == "stages"  # type: ignore[call-arg]


def test_pipeline_split_stage_runs_after_convert_before_tensor_parallel() -> None:
    order = list(STAGES)
    assert order.index(Stage.CONVERT) < order.index(Stage.PIPELINE_SPLIT) < order.index(
        Stage.TENSOR_PARALLEL)
    assert Stage.PIPELINE_SPLIT.value == "composer_par_pipeline_split"
    assert PP.stages() == (Stage.PIPELINE_SPLIT, Stage.FINALIZE)


def test_plan_file_round_trip() -> None:
    text = ('[mesh]\npp = 2\ndp_shard = 2\n\n[[plugins]]\nname = "pp"\n'
            'schedule = "interleaved1f1b"\nstages_per_rank = 2\nmicrobatches = 4\n'
            'split = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], '
            '["layers.3", "norm", "output"]]\n\n[[plugins]]\nname = "fsdp2"\n')
    plan = ParallelPlan.from_toml(text)
    pp = plan.plugin("pp")
    assert isinstance(pp, PP) and pp.split[0] == ("tok_embeddings", "layers.0")
    again = ParallelPlan.from_toml(plan.to_toml()).plugin("pp")
    assert again == pp


@pytest.mark.parametrize("value", [3, "balanced", [["a"], "b"], [[]], [[1]]])
def test_a_split_of_the_wrong_shape_is_an_option_error(value: Any) -> None:
    with pytest.raises(ValueError, match="split must be"):
        PP(split=value)


@pytest.mark.parametrize("field", ["microbatches", "stages_per_rank"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_counts_must_be_positive_ints(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        PP(**{field: value})


# -- static rules ------------------------------------------------------------------------


def test_cp601_unknown_schedule_suggests_torchs_spelling() -> None:
    (finding,) = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="1f1bb")).validate(
        world_size=2).findings
    assert finding.code == "CP601" and "'1F1B'" in finding.message


@pytest.mark.parametrize("name", ["gpipe", "GPIPE", "zbvzerobubble", "DualPipeV"])
def test_schedule_names_are_case_insensitive(name: str) -> None:
    assert codes(ParallelPlan(MeshSpec(pp=2)).use(PP(schedule=name, microbatches=8)),
                 world=2) == []


def test_cp605_stages_per_rank_against_the_schedule() -> None:
    def check(**opts: Any) -> list[str]:
        return codes(ParallelPlan(MeshSpec(pp=2)).use(PP(microbatches=8, **opts)), world=2)

    assert check(schedule="ZBVZeroBubble", stages_per_rank=1) == ["CP605"]
    assert check(schedule="DualPipeV", stages_per_rank=3) == ["CP605"]
    assert check(schedule="GPipe", stages_per_rank=2) == ["CP605"]
    assert check(schedule="1F1B", stages_per_rank=2) == ["CP605"]
    assert check(schedule="Interleaved1F1B", stages_per_rank=3) == []
    # Left out, it is what the schedule takes.
    assert PP(schedule="ZBVZeroBubble").virtual_stages() == 2
    assert PP(schedule="GPipe").virtual_stages() == 1


def test_cp606_selective_checkpointing_with_a_split_backward_schedule() -> None:
    """torch's weight pass recomputes each checkpointed block a second time, which its
    selective checkpointing refuses at the first step: said before launch."""
    from composer_par import ActivationCheckpoint

    def check(schedule: str, mode: str) -> list[str]:
        plan = ParallelPlan(MeshSpec(pp=2, dp_shard=2)).use(
            PP(schedule=schedule, microbatches=8)).use(FSDP2()).use(
            ActivationCheckpoint(mode=mode))
        return [f.message for f in plan.validate(world_size=4).findings if f.code == "CP606"]

    for schedule in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
        (message,) = check(schedule, "selective")
        assert "recomputes each checkpointed block twice" in message, message
        assert check(schedule, "full") == []
    assert check("1F1B", "selective") == []


def test_cp603_microbatches_against_the_schedule() -> None:
    def check(schedule: str, microbatches: int, pp: int = 4, **opts: Any) -> list[str]:
        plan = ParallelPlan(MeshSpec(pp=pp)).use(
            PP(schedule=schedule, microbatches=microbatches, **opts))
        return codes(plan, world=pp)

    assert check("1F1B", 2) == ["CP603"]  # torch refuses fewer microbatches than stages
    assert check("1F1B", 4) == []
    assert check("GPipe", 1) == []
    assert check("DualPipeV", 6) == ["CP603"]  # 8 stages over pp 4
    assert check("DualPipeV", 8) == []
    assert check("Interleaved1F1B", 9, stages_per_rank=2) == ["CP603"]  # 2 rounds: 9 % 2
    assert check("Interleaved1F1B", 8, stages_per_rank=2) == []
    assert check("InterleavedZeroBubble", 6, stages_per_rank=2) == []  # one round of 6
    # The default is the smallest count the schedule takes.
    assert PP(schedule="1F1B").microbatch_count(4) == 4
    assert PP(schedule="DualPipeV").microbatch_count(4) == 8
    finding = ParallelPlan(MeshSpec(pp=4)).use(PP(schedule="1F1B", microbatches=2)).validate(
        world_size=4).findings[0]
    assert "microbatches = 2 < 4 stages" in finding.message and "microbatches = 4" in finding.fix


def test_microbatch_rules_are_torchs() -> None:
    """Each count the rules accept builds torch's schedule; each they refuse, torch
    refuses too (constructed over fake single-rank stage objects, no process group)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    class FakeStage:
        def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
            self.stage_index, self.num_stages = index, num_stages
            self.group_size, self.group_rank = pp, rank
            self.is_first, self.is_last = index == 0, index == num_stages - 1
            self.submod = nn.Identity()

    for name, info in SCHEDULES.items():
        cls = torch_schedules.get_schedule_class(name)
        for pp in (2, 4):
            per_rank = info.stages_per_rank or 2 if info.multi else 1
            stages = pp * per_rank
            for mb in range(1, 13):
                layout = placement(pp, stages, info.style)
                fakes: Any = [FakeStage(s, stages, pp, 0) for s in layout[0]]
                try:
                    if info.multi:
                        cls(fakes, mb)
                    else:
                        cls(fakes[0], mb)
                    accepted = True
                except ValueError:
                    accepted = False
                except Exception:  # something past the checks our rules mirror
                    accepted = True
                ours = microbatch_problem(info, mb, pp, per_rank) is None
                assert ours == accepted, (name, pp, mb)


@pytest.mark.parametrize(("pp", "stages", "style"),
                         [(2, 2, "loop"), (2, 4, "loop"), (4, 12, "loop"), (2, 4, "v"),
                          (4, 8, "v"), (3, 6, "v")])
def test_placement_is_torchs(pp: int, stages: int, style: str) -> None:
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    ours = placement(pp, stages, style)
    theirs = generate_rank_to_stage_mapping(pp, stages, style)
    assert {r: list(s) for r, s in enumerate(ours)} == {r: sorted(s) for r, s in theirs.items()}


def test_cp608_explicit_split_needs_one_list_per_stage() -> None:
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(split=[["tok_embeddings", "layers"]]))
    assert codes(plan, world=2) == ["CP608"]


def test_cp607_collectives_across_nodes_while_pp_stays_inside() -> None:
    topo = Topology(nodes=2, devices_per_node=4)
    bad = ParallelPlan(MeshSpec(dp_shard=4, pp=2), topology=topo).use(FSDP2()).use(PP())
    found = [f for f in bad.validate(world_size=8).findings if f.code == "CP607"]
    assert len(found) == 1 and found[0].severity.value == "warning"
    assert "pp = 2, dp_shard = 4" in found[0].fix
    good = ParallelPlan(MeshSpec(pp=2, dp_shard=4), topology=topo).use(FSDP2()).use(PP())
    assert "CP607" not in codes(good, world=8)
    tp_inside = ParallelPlan(MeshSpec(tp=2, pp=4), topology=topo).use(TP()).use(PP())
    assert "CP607" in codes(tp_inside, world=8)


def test_cp207_two_pipeline_splitters() -> None:
    import attrs

    @attrs.frozen
    class OtherPP(PP):
        name = "other_pp"

    plan = ParallelPlan(MeshSpec(pp=2, stage=1)).use(PP()).use(
        OtherPP(dim="stage"))  # type: ignore[call-arg]
    assert "CP207" in codes(plan, world=2)


# -- model-aware rules --------------------------------------------------------------------


def test_cp602_more_stages_than_blocks() -> None:
    # two blocks, the embedding and the head: four stages at most
    plan = ParallelPlan(MeshSpec(pp=5)).use(PP(schedule="GPipe")).use(MetaInit())
    (finding,) = plan.validate(meta(LLAMA2), world_size=5).findings
    assert finding.code == "CP602" and "5 pipeline stages" in finding.message
    with pytest.raises(PlanError, match="CP602"):
        plan.apply(meta(LLAMA2))


@pytest.mark.parametrize(("split", "words"), [
    ([["tok_embeddings", "layers.0"], ["layers.1", "norm", "outptu"]], "nearest: output"),
    ([["tok_embeddings", "layers"], ["layers.1", "norm", "output"]], "one module in two"),
    ([["tok_embeddings", "layers.0"], ["layers.1", "norm"]], "output.weight"),
    ([["tok_embeddings", "layers.0.attention"], ["layers.0.feed_forward", "layers.1", "norm",
                                                 "output"]], "inside block"),
])
def test_cp608_explicit_split_problems(split: Any, words: str) -> None:
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(split=split, schedule="GPipe")).use(MetaInit())
    (finding,) = plan.validate(meta(LLAMA2), world_size=2).findings
    assert finding.code == "CP608" and words in finding.message


def test_cp608_pp_plan_on_a_model_without_one() -> None:
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(split="pp_plan")).use(MetaInit())
    (finding,) = plan.validate(meta(LLAMA2), world_size=2).findings
    assert finding.code == "CP608" and "no Hugging Face pipeline plan" in finding.message


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)  # type: ignore[no-any-return]


def test_cp609_tied_parameters_on_two_stages() -> None:
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="GPipe")).use(MetaInit())
    (finding,) = plan.validate(Tied(), world_size=2).findings
    assert finding.code == "CP609"
    assert "embed.weight (stage 0)" in finding.message and "head.weight (stage 1)" in (
        finding.message)
    one_stage = PP(schedule="GPipe", split=[["embed", "layers.0", "layers.1", "head"]])
    assert codes(ParallelPlan(MeshSpec(pp=1)).use(one_stage).use(MetaInit()), Tied(), 1) == []


def test_cp610_parameters_on_the_root() -> None:
    model = Tied()
    model.scale = nn.Parameter(torch.ones(1))
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="GPipe")).use(MetaInit())
    assert "CP610" in codes(plan, model, 2)


# -- the split ----------------------------------------------------------------------------


def test_balanced_minimizes_the_largest_stage() -> None:
    assert balanced([1, 1, 1, 1], 2, 0, 0) == [2, 2]
    assert balanced([1, 1, 1, 1], 2, 10, 0) == [1, 3]  # the embedding weighs on stage 0
    assert balanced([5, 1, 1, 1, 1, 1], 2, 0, 0) == [1, 5]
    assert balanced([3, 3, 3], 3, 0, 0) == [1, 1, 1]
    assert sum(balanced(list(range(1, 20)), 5, 3, 7)) == 19


def test_auto_split_of_the_llama() -> None:
    model = meta(llama8)
    split = compute_split(model, find_blocks(model), "auto", 4)
    assert split.stages[0] == ("tok_embeddings", "layers.0", "layers.1")
    assert split.stages[3] == ("layers.6", "layers.7", "norm", "output")
    assert split.blocks == (("layers.0", "layers.1"), ("layers.2", "layers.3"),
                            ("layers.4", "layers.5"), ("layers.6", "layers.7"))
    assert sum(split.params) == sum(p.numel() for p in model.parameters())


def test_past_one_block_a_stage_the_ends_are_stages_of_their_own() -> None:
    """Ten stages over eight blocks: the embedding alone on the first, the final norm and
    head alone on the last (the Llama 3 405B pipeline's ends); nine: the heavier end
    alone; eleven: CP602, naming how many stages the model can take."""
    model = meta(llama8)
    total = sum(p.numel() for p in model.parameters())
    ten = compute_split(model, find_blocks(model), "auto", 10)
    assert ten.stages[0] == ("tok_embeddings",) and ten.blocks[0] == ()
    assert ten.stages[9] == ("norm", "output") and ten.blocks[9] == ()
    assert ten.blocks[1:9] == tuple((f"layers.{i}",) for i in range(8))
    assert sum(ten.params) == total
    nine = compute_split(model, find_blocks(model), "auto", 9)
    assert sum(len(b) for b in nine.blocks) == 8 and sum(nine.params) == total
    empty = [i for i, b in enumerate(nine.blocks) if not b]
    assert empty in ([0], [8])  # one end alone, the other with its block
    with pytest.raises(SplitError, match="11 pipeline stages") as raised:
        compute_split(model, find_blocks(model), "auto", 11)
    assert raised.value.code == "CP602" and "at most 10 stages" in raised.value.fix


def test_block_finder_finds_blocks_in_a_module_dict() -> None:
    class TitanStyle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(16, 8)
            self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(3)})
            self.output = nn.Linear(8, 16)

    blocks = find_blocks(TitanStyle())
    assert [path for path, _ in blocks] == ["layers.0", "layers.1", "layers.2"]


def test_pp_plan_split_of_a_hugging_face_style_model() -> None:
    from composer_par.plugins.pp.split import pp_plan_paths

    with torch.device("meta"):
        model = build_hf_style(4, llama8.config())
    assert pp_plan_paths(model) == ["model.embed_tokens", "model.layers", "model.norm",
                                    "lm_head"]
    split = compute_split(model, [], "pp_plan", 2)
    assert split.stages == (("model.embed_tokens", "model.layers.0", "model.layers.1"),
                            ("model.layers.2", "model.layers.3", "model.norm", "lm_head"))


# -- the parts ----------------------------------------------------------------------------


def _llama_parts(local: list[int], stages: int = 4) -> tuple[nn.Module, list[Any], Any]:
    torch.manual_seed(0)
    model = llama8.build()
    reference = llama8.build()
    reference.load_state_dict(model.state_dict())
    blocks = find_blocks(model)
    split = compute_split(model, blocks, "auto", stages)
    union, parts = build_parts(model, split.stages, split.shared, local, blocks)
    return reference, parts, union


def test_parts_run_the_models_own_forward_stage_by_stage() -> None:
    reference, _, _ = _llama_parts([0])
    tokens = llama8.batch(0)
    hidden = tokens
    for stage in range(4):
        _, (( _, part, blocks, _),), _ = _llama_parts([stage])
        assert [p for p, _ in blocks] == [f"layers.{2 * stage}", f"layers.{2 * stage + 1}"]
        hidden = part(hidden)
    torch.testing.assert_close(hidden, reference(tokens))


def test_parts_of_the_embedding_and_the_head_alone_run_the_models_forward() -> None:
    reference, _, _ = _llama_parts([0], stages=10)
    tokens = llama8.batch(0)
    hidden = tokens
    for stage in range(10):
        _, ((_, part, blocks, _),), _ = _llama_parts([stage], stages=10)
        assert len(blocks) == (0 if stage in (0, 9) else 1)
        hidden = part(hidden)
    torch.testing.assert_close(hidden, reference(tokens))


def test_a_block_that_is_a_container_is_deleted_and_a_layer_list_emptied() -> None:
    """Blocks that are Sequentials in a ModuleList: another stage's block leaves the list
    (no empty Sequential stays behind to run), and the stage of the embedding alone holds
    an empty list, which its forward loops over without running anything."""
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU())
                                        for _ in range(4))
            self.head = nn.Linear(8, 16)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(tokens)
            for layer in self.layers:
                hidden = layer(hidden)
            return self.head(hidden)

    def part_of(stage: int) -> nn.Module:
        model = Stack()
        blocks = [(f"layers.{i}", model.layers[i]) for i in range(4)]
        split = compute_split(model, blocks, "auto", 6)  # the embedding, 4 blocks, the head
        _, ((_, part, _, _),) = build_parts(model, split.stages, split.shared, [stage],
                                            blocks)
        return part

    assert list(part_of(2).layers._modules) == ["1"]
    first = part_of(0)
    assert len(first.layers) == 0
    tokens = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(first(tokens), first.embed(tokens))


def test_a_part_keeps_the_models_names_and_hides_the_other_stages() -> None:
    _, ((_, part, _, _),), union = _llama_parts([1])
    assert part is union
    assert [n for n, _ in part.named_children()] == ["layers"]
    assert sorted(part.state_dict()) == sorted(
        k for k in llama8.build().state_dict() if k.startswith(("layers.2.", "layers.3.")))
    assert isinstance(part.tok_embeddings, OnAnotherStage)
    assert isinstance(part.layers, StageModuleList)
    assert part.layers[0] is part.layers.get_submodule("2") and len(part.layers) == 2


def test_several_stages_per_rank_share_the_modules_of_one_model() -> None:
    _, parts, union = _llama_parts([0, 3])
    (_, first, _, _), (_, last, _, _) = parts
    assert first is not union and last is not union
    assert sorted(n for n, _ in union.named_parameters()) == sorted(
        n for p in (first, last) for n, _ in p.named_parameters())
    assert first.tok_embeddings is union.tok_embeddings
    assert isinstance(last.tok_embeddings, OnAnotherStage)
    assert last.layers.get_submodule("7") is union.layers.get_submodule("7")
    assert "output" not in dict(first.named_children())


# -- the training step on one process -------------------------------------------------------


def test_training_step_without_a_pipeline_is_forward_loss_backward() -> None:
    from tests.pp_workers import loss_fn_for

    task = LLAMA2
    torch.manual_seed(0)
    model, twin = task.build(), task.build()
    twin.load_state_dict(model.state_dict())
    plan = ParallelPlan(MeshSpec())
    step = plan.training_step(model, loss_fn_for(task))
    batch = task.batch(0)
    loss = step.step(batch, batch)
    expected = task.loss(twin, batch)
    expected.backward()
    assert float(loss) == float(expected.detach())
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    norm = step.clip_grad_norm_(0.1)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, float("inf")])
def test_grad_norm_types_match_torch(norm_type: float) -> None:
    from composer_par.training import total_grad_norm

    params = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                             norm_type)
    torch.testing.assert_close(total_grad_norm(params, norm_type), expected)


def test_training_step_needs_a_callable_loss() -> None:
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ParallelPlan(MeshSpec()).training_step(nn.Linear(2, 2), "mse")  # type: ignore[arg-type]


def test_a_stage_sends_tensors_it_owns() -> None:
    from collections import OrderedDict

    from composer_par.plugins.pp.runtime import stage_output

    hidden = torch.randn(2, 4, 8)
    view = hidden[:, 1:, :]
    sent = stage_output(view)
    assert torch.equal(sent, view) and not sent._is_view()
    assert stage_output(hidden) is hidden
    logits = torch.randn(2, 4, 16)
    assert stage_output(OrderedDict(logits=logits, past_key_values=object())) is logits
    pair = (hidden, logits)
    assert stage_output(pair) == pair
    with pytest.raises(TypeError, match="must return tensors"):
        stage_output("text")
