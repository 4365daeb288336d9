"""suggest on the cluster shapes of published runs: where the published layout ranks.

For Llama 3 405B (16384 H100) and DeepSeek-V3 (2048 H800), the clusters, workloads and
published layouts of ``bench_estimate_published.CLUSTERS`` (with their sources), suggest
ranks every layout the installed plugins offer by its predicted step time. Printed per
cluster: suggest's best, the published layout's rank among the layouts that fit, both
predicted step times and their ratios, and the time the search took. Targets: the
published layout among the top 5, and suggest's best no more than 10 % faster by its own
model (best / published >= 0.91, that is published / best <= 1.10). When a target is
missed, each layout's step is printed by its parts (compute, exposed communication, the
pipeline's idle time, the dim whose collectives take longest), which shows the term
that separates them.

    .venv/bin/python benchmarks/bench_suggest_published.py [--cluster NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench_estimate_published import CLUSTERS, NIC_400G, Cluster, _published

TOP = 5
SLOWER = 1.10


def run(cluster: Cluster) -> Any:
    from composer_par.estimate import preset
    from composer_par.tools.suggest import suggest
    from composer_par.topology import Topology

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\r{cluster.name}: {done:,} of {total:,} layouts")
        if done == total:
            sys.stderr.write("\n")

    return suggest(preset(cluster.model), Topology(cluster.nodes, 8),
                   int(cluster.memory_gib * 10**9), seq=cluster.seq,
                   global_batch=cluster.global_batch, device=cluster.device,
                   matmul_dtype=cluster.matmul_dtype, intra_node_gbps=cluster.intra_gbps,
                   inter_node_gbps=NIC_400G, options=cluster.options,
                   max_sizes=cluster.max_sizes, progress=progress)


def row(cluster: Cluster, result: Any, seconds: float) -> tuple[tuple[str, ...], list[str]]:
    """The table row, and the step parts to print when a target is missed."""
    from composer_par.tools.suggest.explain import dominant, step_parts

    fitting = [r for r in result.ranked if r.fits]
    best = result.best
    found = [(i, r) for i, r in enumerate(fitting) if _published(r.candidate, cluster.published)]
    if best is None or not found:
        return ((cluster.name, best.candidate.label() if best else "nothing fits", "-",
                 "not among the fitting layouts", "-", "-", "-", "-", "MISS",
                 f"{seconds:.0f}s"), [])
    index, mine = found[0]
    ratio = best.seconds / mine.seconds
    ok = index < TOP and mine.seconds <= SLOWER * best.seconds
    parts = [] if ok else [
        f"{cluster.name}: {label} {r.candidate.label()}: {r.seconds:.2f}s = {step_parts(r)}; "
        f"most communication on {dominant(r.estimate)}"
        for label, r in (("best", best), ("published", mine))]
    return ((cluster.name, best.candidate.label(), f"{best.seconds:.2f}s",
             mine.candidate.label(), f"{mine.seconds:.2f}s", f"{index + 1} of {len(fitting)}",
             f"{ratio:.3f}", f"{1 / ratio:.3f}", "ok" if ok else "MISS", f"{seconds:.0f}s"),
            parts)


def main() -> None:
    from composer_par.tables import table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", choices=[c.name for c in CLUSTERS], action="append",
                        help="only this cluster (repeatable; default: all)")
    args = parser.parse_args()
    rows, missed = [], []
    for cluster in CLUSTERS:
        if args.cluster and cluster.name not in args.cluster:
            continue
        started = time.perf_counter()
        result = run(cluster)
        line, parts = row(cluster, result, time.perf_counter() - started)
        rows.append(line)
        missed += parts
    print(f"suggest on the published cluster shapes: the published layout's rank among the "
          f"fitting layouts (target: top {TOP}) and the best's predicted step time over the "
          f"published layout's (target: >= {1 / SLOWER:.2f}, published/best <= {SLOWER:.2f})")
    print(table(rows, ("CLUSTER", "BEST", "STEP", "PUBLISHED LAYOUT", "STEP", "RANK",
                       "BEST/PUB", "PUB/BEST", "TARGETS", "TIME"), right=(2, 4, 6, 7, 9)))
    if missed:
        print("\nwhere the targets are missed, each step by its parts:")
        print("\n".join(f"  {line}" for line in missed))
    print("sources: " + "; ".join(f"{c.name}: {c.source}" for c in CLUSTERS))


if __name__ == "__main__":
    main()
