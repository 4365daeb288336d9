"""The schedule timeline of ``explain``: torch's order on every rank, times from the data
dependencies, the bubble against the textbook fraction, in the terminal and as SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from composer_par.plugins.pp import SCHEDULES
from composer_par.plugins.pp.schedules import placement
from composer_par.plugins.pp.timeline import rank_orders, theoretical_bubble, timeline

from composer_par import PP, MeshSpec, ParallelPlan
from composer_par.testing.distributed import run_ranks
from composer_par.tools.draw import render_timeline_svg, render_timeline_text
from tests.pp_workers import observed_order

CASES = [(name, pp, (info.stages_per_rank or 2) if info.multi else 1, mb)
         for name, info in SCHEDULES.items() for pp in (2, 4) for mb in (8, 12)]


@pytest.mark.parametrize(("schedule", "pp", "per_rank", "mb"), CASES)
def test_every_action_once_on_its_rank_after_what_it_needs(schedule: str, pp: int,
                                                          per_rank: int, mb: int) -> None:
    line = timeline(schedule, pp, per_rank, mb)
    stages = pp * per_rank
    layout = placement(pp, stages, SCHEDULES[schedule].style)
    done: dict[tuple[str, int, int], int] = {}
    for rank, row in enumerate(line.actions):
        ends = [0]
        for action in row:
            assert action.start >= ends[-1], (rank, action)  # one action at a time
            ends.append(action.end)
            for kind, stage, m in action.runs:
                assert stage in layout[rank]
                assert (kind, stage, m) not in done
                done[(kind, stage, m)] = action.end
    for stage in range(stages):
        for m in range(mb):
            assert ("F", stage, m) in done
            split = ("I", stage, m) in done
            assert split == (("W", stage, m) in done)
            assert split != (("B", stage, m) in done)
    starts = {(k, s, m): a.start for row in line.actions for a in row for k, s, m in a.runs}
    for (kind, stage, m), start in starts.items():
        if kind == "F" and stage:
            assert start >= done[("F", stage - 1, m)]
        if kind in ("B", "I") and stage < stages - 1:
            after = done.get(("I", stage + 1, m), done.get(("B", stage + 1, m)))
            assert after is not None and start >= after
    assert 0.0 <= line.bubble < 1.0


@pytest.mark.parametrize(("schedule", "per_rank"), [("GPipe", 1), ("1F1B", 1),
                                                    ("Interleaved1F1B", 2), ("LoopedBFS", 2)])
def test_the_bubble_of_full_backward_schedules_is_the_textbook_one(schedule: str,
                                                                   per_rank: int) -> None:
    for pp, mb in ((2, 4), (4, 8), (4, 12)):
        measured = timeline(schedule, pp, per_rank, mb).bubble
        assert measured == pytest.approx(theoretical_bubble(schedule, pp, per_rank, mb))
    # Zero bubble idles less than 1F1B on the same pipeline.
    assert timeline("ZBVZeroBubble", 4, 2, 8).bubble < timeline("1F1B", 4, 1, 8).bubble


@pytest.mark.distributed
@pytest.mark.parametrize(("schedule", "per_rank"), [("GPipe", 1), ("1F1B", 1),
                                                    ("Interleaved1F1B", 2)])
def test_the_order_is_what_torch_runs(schedule: str, per_rank: int) -> None:
    """Each rank's forwards and backwards in a real step (module hooks), in the order the
    timeline shows."""
    mb = 4
    ranks = run_ranks(observed_order, 2, args=(schedule, per_rank, mb), timeout=300)
    for rank, seen in enumerate(ranks):
        shown = [(kind, stage) for kind, stage, _ in
                 (run for step in rank_orders(schedule, 2, per_rank, mb)[rank]
                  for run in step)]
        assert seen == shown, (rank, seen, shown)


def test_explain_draws_the_timeline_in_text_json_and_svg() -> None:
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="1F1B", microbatches=4))
    explanation = plan.explain(world_size=2)
    (line,) = explanation.timelines
    text = explanation.format()
    assert "timeline: 1F1B, 2 stages over pp(2), 4 microbatches; bubble 20.0%" in text
    assert "pp 0 | 0F0 0F1 ... ... 0B0 --- 0F2 0B1 --- 0F3 0B2 --- ... 0B3 ---" in text
    assert explanation.to_dict()["timelines"][0]["bubble"] == pytest.approx(0.2)
    svg = ET.fromstring(render_timeline_svg(line))
    boxes = [e for e in svg.iter("{http://www.w3.org/2000/svg}rect")
             if e.get("class") == "action"]
    assert len(boxes) == 2 * 2 * 4  # forward and backward of 4 microbatches on 2 ranks
    assert render_timeline_text(line) in text


def test_explain_svg_holds_the_layout_and_the_timeline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``composer-par explain --svg`` of a pipeline plan: the layout, then the timeline."""
    import subprocess
    import sys

    plan_file = tmp_path / "pp.toml"
    plan_file.write_text('[mesh]\npp = 2\ndp_shard = 2\n\n[[plugins]]\nname = "pp"\n'
                         'schedule = "1F1B"\nmicrobatches = 4\n\n[[plugins]]\n'
                         'name = "fsdp2"\n', encoding="utf-8")
    picture = tmp_path / "pp.svg"
    done = subprocess.run([sys.executable, "-m", "composer_par.cli", "explain",
                           str(plan_file), "--world-size", "4", "--svg", str(picture)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    root = ET.parse(picture).getroot()
    layout, timeline = list(root)
    assert layout.get("data-world-size") == "4"
    assert int(timeline.get("y", "0")) >= int(layout.get("height", "0"))
    boxes = [e for e in timeline.iter("{http://www.w3.org/2000/svg}rect")
             if e.get("class") == "action"]
    assert len(boxes) == 2 * 2 * 4
    assert int(root.get("height", "0")) == int(layout.get("height", "0")) + int(
        timeline.get("height", "0"))


def test_no_timeline_without_a_resolved_mesh_or_with_a_refused_schedule() -> None:
    assert ParallelPlan(MeshSpec(pp=-1)).use(PP()).explain().timelines == ()
    refused = ParallelPlan(MeshSpec(pp=4)).use(PP(schedule="1F1B", microbatches=2))
    assert refused.explain(world_size=4).timelines == ()


def test_the_timeline_hook_answers_through_the_plans_hook_caller() -> None:
    plan = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="GPipe", microbatches=2))
    ((plugin, line),) = plan.hooks.answers("composer_par_timeline",
                                           mesh=plan.mesh.resolve(2))
    # (microbatches + pp - 1) forward-and-backward slots of 1 + 2 ticks
    assert plugin is plan.plugins[0] and line.length == (2 + 2 - 1) * 3


def test_activations_in_flight_per_rank() -> None:
    from composer_par.plugins.pp.timeline import peak_in_flight

    assert peak_in_flight(timeline("GPipe", 4, 1, 8)) == (8, 8, 8, 8)  # every microbatch
    assert peak_in_flight(timeline("1F1B", 4, 1, 8)) == (4, 3, 2, 1)  # pp - rank
    # Looped stages hold their own microbatches: two stages per rank, more at once.
    assert peak_in_flight(timeline("Interleaved1F1B", 4, 2, 8))[0] > 4
