"""FSDP2's unit options: ``reshard_units`` (reshard_after_forward per unit), ``units``
(modules sharded as units of their own beside the blocks) and ``gradient_divide_factor``.

Each is checked three ways: validation (no processes), golden collective counts on real
gloo ranks, and training parity with the single-process reference on every rank.

The golden counts are derived from the unit list a plan makes of the tasks' Llama
(``L = 2`` blocks ``layers.0``, ``layers.1``; the root's own parameters
``tok_embeddings``, ``norm``, ``output``), as in tests/test_collective_counts.py: per
step, over the shard dim, one all-gather per unit in forward, one more in backward per
unit resharded after forward (over the shard dim for True, over a subgroup for an int,
none for False), and one reduce-scatter per unit. FSDP2's default (``None``) reshards
every unit but the root (torch's default) and the last block (whose backward follows its
forward at once), unless ``reshard_units`` names that block. A module of ``units=`` leaves
the root's unit, so as long as the root keeps a parameter of its own (``norm``), each
such module adds exactly one unit.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from composer_par import FSDP2, ActivationCheckpoint, MeshSpec, MetaInit, ParallelPlan
from composer_par.plugin import OptionError
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ParityCase, ParityResult, train_reference
from composer_par.testing.tasks import llama

LLAMA = "composer_par.testing.tasks:llama"
L = llama.n_layers
BLOCKS = [f"layers.{i}" for i in range(L)]

# -- the golden counts, derived from the unit list ---------------------------------------------

Unit = tuple[str, "bool | int"]  # (name, reshard_after_forward as FSDP2 resolves it)


def units_of(extra: tuple[str, ...] = (), reshard: dict[str, bool | int] | None = None,
             default: bool | int | None = None) -> list[Unit]:
    """The units FSDP2 makes of the task's Llama, bottom-up, each with its resolved
    reshard_after_forward: ``default`` for every unit (None: FSDP2's, True for all but the
    root and the last block), then ``reshard`` by exact name."""
    names = [*BLOCKS, *extra, "root"]
    out = []
    for name in names:
        value: bool | int = (name not in ("root", BLOCKS[-1])) if default is None else default
        out.append((name, (reshard or {}).get(name, value)))
    return out


def golden(units: list[Unit], dim: str = "dp_shard", shard: int = 4,
           replicate: str | None = None) -> dict[str, dict[str, int]]:
    forward = len(units)
    backward = sum(1 for _, r in units if r is True or r == shard)
    subgroup = sum(1 for _, r in units if not isinstance(r, bool) and 1 < r < shard)
    counts = {dim: {"all_gather": forward + backward, "reduce_scatter": len(units)}}
    if subgroup:
        counts[f"{dim} (subgroup)"] = {"all_gather": subgroup}
    if replicate is not None:
        counts[replicate] = {"all_reduce": len(units)}
    return counts


def plan_toml(mesh: str, *plugins: str) -> str:
    tables = "\n".join(f"[[plugins]]\n{p.strip()}\n" for p in plugins)
    return f"[mesh]\n{mesh}\n\n{tables}\n[[plugins]]\nname = \"meta_init\"\nseed = 3\n"


AC_LAYERS = 'name = "activation_checkpoint"\nmode = "full"\nblocks = "layers"'
EMBEDDING = 'name = "fsdp2"\nunits = ["tok_embeddings"]'
EMBEDDING_AND_HEAD_KEPT = ('name = "fsdp2"\nunits = ["tok_embeddings", "output"]\n'
                          'reshard_units = { root = false, "layers.1" = false }')
ROOT_RESHARDED = 'name = "fsdp2"\nreshard_units = { root = true }'
BLOCKS_KEPT = 'name = "fsdp2"\nreshard_after_forward = true\nreshard_units = { "layers.*" = false }'
LAST_BLOCK_INT = 'name = "fsdp2"\nreshard_units = { "layers.1" = 2 }'
DIVIDE_BY_1 = 'name = "fsdp2"\ngradient_divide_factor = 1.0'
# torchtitan's Llama layout: the embedding alone, the final norm and the head as one unit
# kept gathered after forward (backward starts there), each block; the root then holds no
# parameter of its own, so its unit communicates nothing.
TORCHTITAN_UNITS = ('name = "fsdp2"\nunits = ["tok_embeddings", ["norm", "output"]]\n'
                    'reshard_units = { "norm + output" = false }')

FOUR = "dp_shard = 4"
COUNT_CASES: dict[str, tuple[str, dict[str, dict[str, int]]]] = {
    # The embedding a unit of its own with checkpointing of the layers only: +1 unit.
    "embedding unit, layers checkpointed": (
        plan_toml(FOUR, EMBEDDING, AC_LAYERS), golden(units_of(("tok_embeddings",)))),
    # The last block kept gathered drops its backward all-gather; the root is kept as by
    # torch's default.
    "embedding and head units, root and last block kept": (
        plan_toml(FOUR, EMBEDDING_AND_HEAD_KEPT),
        golden(units_of(("tok_embeddings", "output"), {"root": False, "layers.1": False}))),
    "root resharded": (plan_toml(FOUR, ROOT_RESHARDED), golden(units_of(reshard={"root": True}))),
    "blocks kept by a pattern, root resharded": (
        plan_toml(FOUR, BLOCKS_KEPT),
        golden(units_of(reshard={b: False for b in BLOCKS}, default=True))),
    "last block resharded to runs of 2": (
        plan_toml(FOUR, LAST_BLOCK_INT), golden(units_of(reshard={"layers.1": 2}))),
    # On gloo the factor runs as a SUM reduce-scatter and a local division: no extra call.
    "gradient divide factor": (plan_toml(FOUR, DIVIDE_BY_1), golden(units_of())),
    "hsdp x fsdp2 2x2, embedding unit": (
        plan_toml("dp_replicate = 2\ndp_shard = 2", 'name = "hsdp"', EMBEDDING),
        golden(units_of(("tok_embeddings",)), shard=2, replicate="dp_replicate")),
    "torchtitan's units, root without parameters": (
        plan_toml(FOUR, TORCHTITAN_UNITS),
        golden([u for u in units_of(("tok_embeddings", "norm + output"),
                                    {"norm + output": False}) if u[0] != "root"])),
}


def test_golden_counts_are_derived_as_documented() -> None:
    # The derivation itself, spelled out for the cases above (so a wrong helper cannot
    # make a wrong golden count agree with a wrong measurement).
    assert COUNT_CASES["embedding unit, layers checkpointed"][1] == {
        "dp_shard": {"all_gather": 4 + 2, "reduce_scatter": 4}}
    assert COUNT_CASES["embedding and head units, root and last block kept"][1] == {
        "dp_shard": {"all_gather": 5 + 3, "reduce_scatter": 5}}
    assert COUNT_CASES["root resharded"][1] == {
        "dp_shard": {"all_gather": 3 + 2, "reduce_scatter": 3}}
    assert COUNT_CASES["blocks kept by a pattern, root resharded"][1] == {
        "dp_shard": {"all_gather": 3 + 1, "reduce_scatter": 3}}
    assert COUNT_CASES["last block resharded to runs of 2"][1] == {
        "dp_shard": {"all_gather": 3 + 1, "reduce_scatter": 3},
        "dp_shard (subgroup)": {"all_gather": 1}}
    assert COUNT_CASES["torchtitan's units, root without parameters"][1] == {
        "dp_shard": {"all_gather": 4 + 2, "reduce_scatter": 4}}
    assert COUNT_CASES["hsdp x fsdp2 2x2, embedding unit"][1] == {
        "dp_shard": {"all_gather": 4 + 2, "reduce_scatter": 4},
        "dp_replicate": {"all_reduce": 4}}


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_golden_counts_of_unit_options_on_4_ranks() -> None:
    measured = run_ranks("tests.collective_count_workers:count_steps", 4,
                         args=({name: plan for name, (plan, _) in COUNT_CASES.items()},),
                         timeout=360)
    mismatches = []
    for name, (_, expected) in COUNT_CASES.items():
        for rank, per_rank in enumerate(measured):
            for step, counts in enumerate(per_rank[name], start=1):
                if counts != expected:
                    mismatches.append(f"{name}, rank {rank}, step {step}: measured {counts}, "
                                      f"golden {expected}")
    assert not mismatches, "\n".join(mismatches)


# -- what FSDP2 made of the model ------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_each_unit_gets_its_modules_and_its_reshard_setting() -> None:
    plan = plan_toml(FOUR, 'name = "fsdp2"\nunits = ["tok_embeddings", "output"]\n'
                     'reshard_units = { root = false, "layers.1" = 2 }\n'
                     'gradient_divide_factor = 2.0', AC_LAYERS)
    per_rank = run_ranks("tests.fsdp2_unit_workers:unit_settings", 4, args=(plan,),
                         timeout=160)
    for got in per_rank:
        units = got["units"]
        assert set(units) == {"layers.0", "layers.1", "tok_embeddings", "output", ""}
        assert {k: v["reshard"] for k, v in units.items()} == {
            "layers.0": True, "layers.1": 2, "tok_embeddings": True, "output": True, "": False}
        assert units["tok_embeddings"]["params"] == ["tok_embeddings.weight"]
        assert units["output"]["params"] == ["output.weight"]
        assert units[""]["params"] == ["norm.weight"]  # the root keeps what no unit took
        assert all(v["factor"] == 2.0 for v in units.values())
        detail = {(stage, plugin): text for stage, plugin, text in got["log"]}
        assert "2 block(s) + 2 unit(s) (tok_embeddings, output) + root" in detail[
            ("data_parallel", "fsdp2")]
        assert "layers.1=2" in detail[("data_parallel", "fsdp2")]
        assert "gradient divide factor 2 on 5 FSDP module(s)" in detail[("finalize", "fsdp2")]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_by_default_the_last_block_alone_stays_gathered() -> None:
    per_rank = run_ranks("tests.fsdp2_unit_workers:unit_settings", 2,
                         args=(plan_toml("dp_shard = 2", 'name = "fsdp2"'),), timeout=160)
    for got in per_rank:
        # torch's own settings, as FSDP2 applied them: the root kept by torch's default,
        # the last block by FSDP2's
        assert {k: v["reshard"] for k, v in got["units"].items()} == {
            "layers.0": True, "layers.1": False, "": False}
        detail = {(stage, plugin): text for stage, plugin, text in got["log"]}
        assert "the last block layers.1 kept gathered from forward to backward" in detail[
            ("data_parallel", "fsdp2")]


# -- gradients with a divide factor ------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gradient_divide_factor_scales_gradients_exactly() -> None:
    factors = (1.0, 2.0, 4.0, 8.0)
    plans = {"default": plan_toml(FOUR, 'name = "fsdp2"')}
    plans |= {f"{f:g}": plan_toml(FOUR, f'name = "fsdp2"\ngradient_divide_factor = {f}')
              for f in factors}
    per_rank = run_ranks("tests.fsdp2_unit_workers:gradients", 4, args=(plans,), timeout=260)
    world = 4
    for rank, grads in enumerate(per_rank):
        default = grads["default"]
        assert set(default) == {n for n, _ in _llama_parameters()}
        assert all(bool(g.abs().sum() > 0) for g in default.values())
        for f in factors:
            # world / f is a power of two: the scaling is exact in fp32, so the gradients
            # are the default's times world / f bit for bit.
            scale = world / f
            for name, grad in grads[f"{f:g}"].items():
                assert torch.equal(grad, default[name] * scale), (rank, f, name)


def _llama_parameters() -> list[tuple[str, torch.nn.Parameter]]:
    with torch.device("meta"):
        return list(llama.build().named_parameters())


# -- training parity, on every rank --------------------------------------------------------------


PARITY_FOUR = {
    "embedding unit, layers checkpointed": (plan_toml(FOUR, EMBEDDING, AC_LAYERS), 1.0),
    "embedding and head units, root and last block kept": (
        plan_toml(FOUR, EMBEDDING_AND_HEAD_KEPT), 1.0),
    "blocks kept by a pattern, root resharded": (plan_toml(FOUR, BLOCKS_KEPT), 1.0),
    "last block resharded to runs of 2": (plan_toml(FOUR, LAST_BLOCK_INT), 1.0),
    # Gradients summed (factor 1) instead of averaged over 4: the same training as the
    # reference at 4 x the learning rate.
    "gradient divide factor 1": (plan_toml(FOUR, DIVIDE_BY_1), 4.0),
    "hsdp x fsdp2 2x2, embedding unit": (
        plan_toml("dp_replicate = 2\ndp_shard = 2", 'name = "hsdp"', EMBEDDING), 1.0),
    "torchtitan's units, layers checkpointed": (plan_toml(FOUR, TORCHTITAN_UNITS, AC_LAYERS),
                                                1.0),
}


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_unit_options_train_like_a_single_process_on_every_rank() -> None:
    lr = 0.25
    cases = {name: ParityCase(task=LLAMA, plan=plan, world_size=4, steps=6, optimizer="sgd",
                              lr=lr)
             for name, (plan, _) in PARITY_FOUR.items()}
    measured = run_ranks("tests.fsdp2_unit_workers:train_every_rank", 4, args=(cases,),
                         timeout=450)
    for name, (_, lr_scale) in PARITY_FOUR.items():
        reference = train_reference(attrs.evolve(cases[name], lr=lr * lr_scale))
        for rank, per_rank in enumerate(measured):
            losses, params = per_rank[name]
            result = ParityResult(losses, reference[0], params, reference[1])
            try:
                result.assert_close()
            except AssertionError as exc:
                raise AssertionError(f"{name}, rank {rank}: {exc}") from None
        assert reference[0][-1] < reference[0][0] - 0.05, (name, reference[0])


# -- validation, before anything changes ---------------------------------------------------


def _model() -> torch.nn.Module:
    with torch.device("meta"):
        return llama.build()


def _plan(fsdp: FSDP2, *more: object) -> ParallelPlan:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(fsdp)
    for plugin in more:
        plan = plan.use(plugin)  # type: ignore[arg-type]
    return plan.use(MetaInit())


def test_embedding_in_the_blocks_disagrees_with_checkpointing_of_the_layers() -> None:
    # What users try first: the embedding among FSDP2's blocks. Blocks are shared with
    # activation checkpointing, so two specs are refused (CP208) ...
    plan = _plan(FSDP2(blocks=["DecoderLayer", "Embedding"]), ActivationCheckpoint(blocks="layers"))
    report = plan.validate(_model(), world_size=2)
    assert report.codes() == ["CP208"], report.format()
    assert "fsdp2: classes ['DecoderLayer', 'Embedding']" in report.format()
    # ... and units= leaves the blocks alone, so both agree.
    plan = _plan(FSDP2(units=["tok_embeddings"]), ActivationCheckpoint(blocks="layers"))
    assert plan.validate(_model(), world_size=2).codes() == []


def test_reshard_units_naming_no_unit_lists_the_units() -> None:
    report = _plan(FSDP2(units=["output"], reshard_units={"layers.9": False, "layer.*": False,
                                                         "root": False})
                   ).validate(_model(), world_size=2)
    assert report.codes() == ["CP428", "CP428"], report.format()
    text = report.format()
    assert "'layers.9', which is no FSDP2 unit; the units are layers.0 ... layers.1 (2 " \
        "blocks), output, root (did you mean 'layers.1'?)" in text
    assert "'layer.*'" in text and "list it in units=" in text
    # A module that is no unit (norm is in the root's) is no key either.
    assert _plan(FSDP2(reshard_units={"norm": False})).validate(
        _model(), world_size=2).codes() == ["CP428"]


def test_reshard_units_exact_path_wins_and_patterns_must_agree() -> None:
    fsdp = FSDP2(reshard_units={"layers.*": False, "layers.1": True})
    assert _plan(fsdp).validate(_model(), world_size=2).codes() == []
    units, _ = fsdp.unit_list(_model(), [(b, None) for b in BLOCKS])
    values, found = fsdp.reshard_values(units)
    assert values == {"layers.0": False, "layers.1": True, "root": None} and not found
    report = _plan(FSDP2(reshard_units={"layers.*": False, "*.1": True})).validate(
        _model(), world_size=2)
    assert report.codes() == ["CP430"], report.format()
    assert "unit layers.1 2 values ('layers.*': False, '*.1': True)" in report.format()
    # True and 1 are different settings.
    report = _plan(FSDP2(reshard_units={"layers.*": True, "*.1": 1})).validate(
        _model(), world_size=2)
    assert report.codes() == ["CP430"]


@pytest.mark.parametrize(("units", "message"), [
    (["nope"], "Llama has no module 'nope'"),
    (["layers.1"], "layers.1 is a block, a unit of its own already"),
    (["layers.0.attention"], "layers.0.attention is inside block layers.0"),
    (["layers"], "layers holds 2 block(s) (layers.0, ...)"),
    (["layers.0.rotary"], "inside block layers.0"),
])
def test_units_must_be_modules_beside_the_blocks(units: list[str], message: str) -> None:
    report = _plan(FSDP2(units=units)).validate(_model(), world_size=2)
    assert report.codes() == ["CP429"], report.format()
    assert message in report.format()


def test_units_must_not_overlap_hold_nothing_or_split_a_tie() -> None:
    model = torch.nn.ModuleDict({
        "layers": torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2)),
        "head": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()),
        "embed": torch.nn.Embedding(8, 4),
        "out": torch.nn.Linear(4, 8, bias=False),
        "act": torch.nn.Tanh(),
    })
    model["out"].weight = model["embed"].weight  # tied
    plan = _plan(FSDP2(blocks="layers", units=["head", "head.0", "act", "embed"]))
    report = plan.validate(model, world_size=2)
    assert report.codes() == ["CP429", "CP429", "CP429"], report.format()
    text = report.format()
    assert "head.0 and head, both in units, overlap" in text
    assert "act holds no parameters" in text
    assert "embed holds embed.weight, which is tied to out.weight outside it" in text


@pytest.mark.parametrize(("options", "message"), [
    ({"reshard_units": ["root"]}, "reshard_units must be a table"),
    ({"reshard_units": {"root": 0}}, "reshard_units['root'] must be true, false, or a positive"),
    ({"reshard_units": {"root": "no"}}, "reshard_units['root']"),
    ({"units": "tok_embeddings"}, None),  # one path is a list of one
    ({"units": ["output", "output"]}, "units names 'output' twice"),
    ({"units": [["norm", "output"], "output"]}, "units names 'output' twice"),
    ({"units": [["norm", 2]]}, "units must be a list of module paths, or of lists"),
    ({"units": [[]]}, "units must be a list of module paths, or of lists"),
    ({"units": ["root"]}, "'root' is the root's unit"),
    ({"units": [1]}, "units must be a list of module paths"),
    ({"gradient_divide_factor": 0}, "gradient_divide_factor must be a number > 0"),
    ({"gradient_divide_factor": -2.0}, "gradient_divide_factor must be a number > 0"),
    ({"gradient_divide_factor": True}, "gradient_divide_factor must be a number > 0"),
    ({"gradient_divide_factor": "4"}, "gradient_divide_factor must be a number > 0"),
    ({"gradient_divide_factor": float("nan")}, "gradient_divide_factor must be a number > 0"),
    ({"gradient_divide_factor": float("inf")}, "must be finite"),
])
def test_option_values_are_checked(options: dict[str, object], message: str | None) -> None:
    if message is None:
        assert FSDP2(**options).units == ("tok_embeddings",)  # type: ignore[arg-type]
        return
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace("[", r"\[")):
        FSDP2(**options)  # type: ignore[arg-type]


def test_modules_sharded_together_are_one_unit_named_by_their_paths() -> None:
    fsdp = FSDP2(units=["tok_embeddings", ["norm", "output"], ["layers"]],
                 reshard_units={"norm + output": False})
    assert fsdp.units == ("tok_embeddings", ("norm", "output"), "layers")
    fsdp = attrs.evolve(fsdp, units=("tok_embeddings", ("norm", "output")))
    units, found = fsdp.unit_list(_model(), [(b, None) for b in BLOCKS])
    assert not found
    assert [(u.name, u.paths, u.kind) for u in units[L:]] == [
        ("tok_embeddings", ("tok_embeddings",), "unit"),
        ("norm + output", ("norm", "output"), "unit"), ("root", (), "root")]
    assert fsdp.reshard_values(units)[0]["norm + output"] is False
    # a key naming one module of the unit names the unit
    by_path = attrs.evolve(fsdp, reshard_units={"output": False})
    assert by_path.reshard_values(units) == (
        {**{b: None for b in BLOCKS[:-1]}, BLOCKS[-1]: False, "tok_embeddings": None,
         "norm + output": False, "root": None}, [])
    # the last block stays gathered by default, but not inside a pipeline stage, nor when
    # a value is given for it
    assert by_path.reshard_values(units, part=True)[0][BLOCKS[-1]] is None
    assert attrs.evolve(by_path, reshard_units={"layers.*": True}).reshard_values(
        units)[0][BLOCKS[-1]] is True
    assert attrs.evolve(by_path, reshard_after_forward=True).reshard_values(
        units)[0][BLOCKS[-1]] is True
    text = ParallelPlan(MeshSpec(dp_shard=2)).use(fsdp).use(MetaInit()).to_toml()
    assert 'units = ["tok_embeddings", ["norm", "output"]]' in text
    assert ParallelPlan.from_toml(text).plugin("fsdp2") == fsdp
    assert "then tok_embeddings, norm + output, then the root" in str(
        ParallelPlan(MeshSpec(dp_shard=2)).use(fsdp).explain())


def test_a_tie_inside_a_unit_of_several_modules_is_fine() -> None:
    model = torch.nn.ModuleDict({
        "layers": torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2)),
        "embed": torch.nn.Embedding(8, 4),
        "out": torch.nn.Linear(4, 8, bias=False),
    })
    model["out"].weight = model["embed"].weight
    report = _plan(FSDP2(blocks="layers", units=[["embed", "out"]])).validate(
        model, world_size=2)
    assert report.codes() == [], report.format()
    report = _plan(FSDP2(blocks="layers", units=["embed", "out"])).validate(
        model, world_size=2)
    assert report.codes() == ["CP429", "CP429"], report.format()


def test_int_per_unit_must_divide_the_shard_size() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2(reshard_units={"layers.1": 3}))
    report = plan.validate(world_size=4)
    assert report.codes() == ["CP303"], report.format()
    assert "reshard_units['layers.1']=3 does not divide the shard size dp_shard(4)" in \
        report.format()


def test_options_round_trip_through_a_plan_file_and_are_explained() -> None:
    fsdp = FSDP2(units=["tok_embeddings", "output"], reshard_units={"root": False,
                                                                   "layers.*": 2},
                 gradient_divide_factor=1)
    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(fsdp).use(MetaInit())
    text = plan.to_toml()
    assert 'reshard_units = {root = false, "layers.*" = 2}' in text
    assert 'units = ["tok_embeddings", "output"]' in text
    assert "gradient_divide_factor = 1.0" in text
    again = ParallelPlan.from_toml(text)
    assert again.plugin("fsdp2") == fsdp
    assert hash(again.plugin("fsdp2")) == hash(fsdp)
    explained = str(plan.explain())
    assert "fully_shard each block, then tok_embeddings, output, then the root" in explained
    assert "[finalize] fsdp2: divide gradients by 1 on every FSDP module" in explained


def test_explicit_units_replace_the_models_own_plan() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = _plan(FSDP2(units=["model.embed_tokens"])).validate(model, world_size=2)
    assert report.codes() == ["CP426"], report.format()
    assert "units=['model.embed_tokens'] gives the FSDP units" in report.format()
    fsdp = FSDP2(units=["model.embed_tokens"], reshard_units={"lm_head": False})
    assert sorted(_plan(fsdp).validate(model, world_size=2).codes()) == ["CP426", "CP428"]
    # Without units the model's plan's units are units too, and reshard_units names them.
    report = _plan(FSDP2(reshard_units={"lm_head": True, "model.layers.*": False})).validate(
        model, world_size=2)
    assert report.codes() == ["CP425"], report.format()


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_second_divide_factor_is_refused_at_finalize_in_either_order() -> None:
    hsdp = 'name = "hsdp"\ngradient_divide_factor = 2.0'
    mesh = "dp_replicate = 2\ndp_shard = 2"
    plans = {"both": plan_toml(mesh, hsdp, 'name = "fsdp2"\ngradient_divide_factor = 4.0'),
             "the same": plan_toml(mesh, hsdp, 'name = "fsdp2"\ngradient_divide_factor = 2.0'),
             "hsdp only": plan_toml(mesh, hsdp, 'name = "fsdp2"'),
             "fsdp2 first": plan_toml(mesh, 'name = "fsdp2"\ngradient_divide_factor = 4.0',
                                      hsdp)}
    per_rank = run_ranks("tests.fsdp2_unit_workers:apply_errors", 4, args=(plans,), timeout=160)
    for errors in per_rank:
        assert errors["hsdp only"] is None and errors["the same"] is None, errors
        assert errors["both"] is not None and "fsdp2: gradient_divide_factor=4, but the FSDP " \
            "modules already divide by 2" in errors["both"], errors["both"]
        # whichever order the plan gives them, the second one refuses
        first = errors["fsdp2 first"]
        assert first is not None and "hsdp: gradient_divide_factor=2, but the FSDP modules " \
            "already divide by 4" in first, first


# -- the estimator follows the options ---------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in COUNT_CASES if "hsdp" not in n])
def test_estimated_calls_equal_the_golden_counts(name: str) -> None:
    from composer_par.estimate import ModelShape, Workload, estimate_plan

    plan_text, expected = COUNT_CASES[name]
    with torch.device("meta"):
        shape = ModelShape.from_module(llama.build())
    est = estimate_plan(ParallelPlan.from_toml(plan_text), shape,
                        Workload(seq=llama.seq_len, micro_batch=2), world_size=4)
    merged: dict[str, dict[str, int]] = {}
    for label, kinds in expected.items():
        dim = label.removesuffix(" (subgroup)")
        for kind, calls in kinds.items():
            merged.setdefault(dim, {}).setdefault(kind, 0)
            merged[dim][kind] += calls
    assert {t.dim.name: t.calls() for t in est.traffic} == merged


def test_estimator_splits_units_off_the_root_and_says_when_it_cannot() -> None:
    from composer_par.estimate import ModelShape

    with torch.device("meta"):
        shape = ModelShape.from_module(llama.build())
    split, missing = shape.with_units(("tok_embeddings", "output", "nope"))
    assert [g.name for g in split.groups] == [*BLOCKS, "tok_embeddings", "output", "root"]
    assert [t.name for t in split.groups[-1].tensors] == ["norm.weight"]
    assert sum(g.numel for g in split.groups) == sum(g.numel for g in shape.groups)
    assert missing == ["nope"]
    numbers = ModelShape.from_numbers(params=10**9)
    assert numbers.with_units(("tok_embeddings",)) == (numbers, ["tok_embeddings"])


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_units_under_a_pipeline_train_like_a_single_process() -> None:
    # Each stage shards the units its part holds: the embedding is in stage 0's part
    # only, the last block (kept gathered) in stage 1's.
    from tests.pp_workers import StepCase, check_step_cases

    plan = plan_toml("pp = 2\ndp_shard = 2", 'name = "pp"\nschedule = "1F1B"',
                     'name = "fsdp2"\nunits = ["tok_embeddings"]\n'
                     'reshard_units = { "layers.3" = false }')
    case = StepCase(ParityCase(task="tests.pp_workers:llama4", plan=plan, world_size=4,
                               steps=6, lr=1.0), clip=0.5)
    [(result, _, _)] = check_step_cases([case], timeout=360)
    result.assert_close()
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses
