"""The estimate against published training runs: predicted / published for each row.

Every row is a run whose authors published its layout, its workload and what it
measured, each row naming its source:

* torchtitan's own tables (benchmarks/llama3_h100_202412_torchtitan.md in
  github.com/pytorch/torchtitan: Llama 3.1 8B, 70B and 405B on H100s, 96 GB HBM2e at
  500 W, NVLink inside a node, 400 Gbit/s RDMA per GPU between nodes): peak memory
  (torchtitan logs torch.cuda's max_memory_reserved, the caching allocator's segments,
  the most of any rank) and tokens/s per GPU. The estimate counts allocated bytes, which
  the reserved figure exceeds by the allocator's slack: no factor is applied for it, so
  a ratio a little below 1 is what a right estimate shows;
* Meta's Llama 3 paper (arXiv 2407.21783, Table 4: 405B on 8192 and 16384 H100 SXM
  80 GB, 400 Gbit/s RoCE): the layout and BF16 MFU;
* DeepSeek-V3's technical report (arXiv 2412.19437: 2048 H800, NVLink 160 GB/s and
  InfiniBand 50 GB/s per GPU; 16-way pipeline, 64-way expert parallelism over 8 nodes,
  ZeRO-1 data parallelism; FP8; 2.664 M GPU hours of pre-training on 14.8 T tokens, so
  about 1543 tokens/s per GPU).

Each row's plan is the published layout as composer_par's plugins write it, its
workload the published settings (sequence length, sequences per data shard and step,
activation checkpointing, float8 matmuls); nothing is fitted to the rows: the device's
achieved share of its peak is the estimate's default. Targets: memory within +-15 %,
tokens/s within +-25 % on every row that states them.

``suggest`` on the cluster shapes of Llama 3 405B and DeepSeek-V3 (``CLUSTERS`` below)
is bench_suggest_published.py.

    .venv/bin/python benchmarks/bench_estimate_published.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import attrs

MEMORY_TARGET = 0.15
TOKENS_TARGET = 0.25
GIB = 2**30

# Link bandwidths per GPU, Gbit/s, each way: NVLink 4 (900 GB/s both ways), an H800's
# NVLink (160 GB/s), 400 Gbit/s NICs.
H100_NVLINK = 3600.0
H800_NVLINK = 1280.0
NIC_400G = 400.0

TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
LLAMA3 = "Llama 3 paper (arXiv 2407.21783) Table 4"
DEEPSEEK = "DeepSeek-V3 report (arXiv 2412.19437) 3.1-3.3, Table 1"


@attrs.frozen
class Row:
    name: str
    source: str
    model: str  # preset
    nodes: int
    mesh: dict[str, int]
    plugins: tuple[tuple[str, dict[str, Any]], ...]
    seq: int
    micro_batch: int = 1
    device: str = "h100"
    matmul_dtype: str | None = None
    # torchtitan reduces gradients in fp32 under bf16 parameters (its default
    # mixed_precision_reduce), and so accumulates them in fp32 between microbatches
    reduce_dtype: str = "float32"
    intra_gbps: float = H100_NVLINK
    inter_gbps: float = NIC_400G
    memory_gib: float | None = None  # published peak memory per GPU
    tokens_per_gpu: float | None = None  # published tokens/s per GPU
    mfu: float | None = None  # published BF16 MFU
    not_modeled: str = ""  # what the run did that the estimate leaves out


def _ac(mode: str) -> tuple[str, dict[str, Any]]:
    # torchtitan's selective "op" policy saves every other matmul's output, the attention
    # kernels' outputs and the reduce-scatters'
    selective = {"matmul_every": 2, "save": ["matmul", "attention", "collectives"]}
    return ("activation_checkpoint", {"mode": mode, **(selective if mode == "selective"
                                                       else {})})


FSDP_BF16 = ("fsdp2", {"mixed_precision": "bf16"})
FSDP_KEPT = ("fsdp2", {"mixed_precision": "bf16", "reshard_after_forward": False})
TP_SP = ("tp", {"sequence_parallel": True, "loss_parallel": True})


def _rows() -> list[Row]:
    rows = []
    # torchtitan Table 1 / 3: Llama 3.1 8B, FSDP, local batch 2, selective AC, seq 8192
    for gpus, table, results in (
            (8, "Table 1", [("FSDP", None, "", 5762, 82.4),
                            ("FSDP + compile", None, "torch.compile", 6667, 77.0),
                            ("FSDP + compile + Float8", "float8", "torch.compile", 8532,
                             76.8)]),
            (128, "Table 3", [("FSDP", None, "", 5605, 67.0),
                              ("FSDP + compile", None, "torch.compile", 6514, 62.0),
                              ("FSDP + compile + Float8", "float8", "torch.compile", 8380,
                               61.8)])):
        for label, matmul, missing, tokens, memory in results:
            rows.append(Row(f"8B {gpus} GPUs {label}", f"{TORCHTITAN} {table}", "llama3-8b",
                            gpus // 8, {"dp_shard": gpus}, (FSDP_BF16, _ac("selective")),
                            8192, 2, matmul_dtype=matmul, memory_gib=memory,
                            tokens_per_gpu=tokens, not_modeled=missing))
    # Table 2: 8B, 8 GPUs, FSDP x CP, local batch 1, full AC, compile + Float8
    for shard, cp, seq, tokens, memory in ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2),
                                           (2, 4, 131072, 1071, 84.0),
                                           (1, 8, 262144, 548, 84.5)):
        mesh = {"dp_shard": shard, "cp": cp} if cp > 1 else {"dp_shard": shard}
        plugins = [FSDP_BF16, _ac("full")]
        if cp > 1:
            plugins.insert(1, ("cp", {"mode": "ring", "seq_len": seq}))
        rows.append(Row(f"8B 8 GPUs FSDP {shard} CP {cp} seq {seq}", f"{TORCHTITAN} Table 2",
                        "llama3-8b", 1, mesh, tuple(plugins), seq, 1, matmul_dtype="float8",
                        memory_gib=memory, tokens_per_gpu=tokens, not_modeled="torch.compile"))
    # Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compile + Float8
    for label, tokens, memory, missing in (("2D", 829, 71.9, "torch.compile"),
                                           ("2D + AsyncTP", 876, 67.6,
                                            "torch.compile, async TP")):
        rows.append(Row(f"70B 256 GPUs FSDP 32 TP 8 {label}", f"{TORCHTITAN} Table 4",
                        "llama3-70b", 32, {"dp_shard": 32, "tp": 8},
                        (TP_SP, FSDP_BF16, _ac("full")), 8192, 16, matmul_dtype="float8",
                        memory_gib=memory, tokens_per_gpu=tokens, not_modeled=missing))
    # Table 5: 405B, 512 GPUs, PP 8 x FSDP 8 x TP 8, local batch 32, full AC. The
    # microbatches are not stated: torchtitan's default then was the pipeline degree
    # (experimental.pipeline_parallel_microbatches unset), 8 microbatches of 4 sequences.
    for schedule, per_rank, tokens, memory in (("1F1B", None, 100, 82.5),
                                               ("Interleaved1F1B", 2, 128, 72.7)):
        pp: dict[str, Any] = {"schedule": schedule, "microbatches": 8}
        if per_rank:
            pp["stages_per_rank"] = per_rank
        rows.append(Row(f"405B 512 GPUs PP 8 FSDP 8 TP 8 {schedule}", f"{TORCHTITAN} Table 5",
                        "llama3-405b", 64, {"pp": 8, "dp_shard": 8, "tp": 8},
                        (("pp", pp), TP_SP, FSDP_KEPT, _ac("full")), 8192, 4,
                        matmul_dtype="float8", memory_gib=memory, tokens_per_gpu=tokens,
                        not_modeled="torch.compile, async TP"))
    # Table 6: 405B, 512 GPUs, PP 8 x FSDP x CP x TP 8, 1F1B, local batch 8, full AC
    for shard, cp, seq, tokens, memory in ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9),
                                           (2, 4, 131072, 31, 77.1),
                                           (1, 8, 262144, 16, 84.9)):
        mesh = {"pp": 8, "dp_shard": shard, **({"cp": cp} if cp > 1 else {}), "tp": 8}
        plugins = [("pp", {"schedule": "1F1B", "microbatches": 8}), TP_SP, FSDP_KEPT,
                   _ac("full")]
        if cp > 1:
            plugins.insert(2, ("cp", {"mode": "ring", "seq_len": seq}))
        rows.append(Row(f"405B 512 GPUs FSDP {shard} CP {cp} seq {seq}",
                        f"{TORCHTITAN} Table 6", "llama3-405b", 64, mesh, tuple(plugins),
                        seq, 1, matmul_dtype="float8", memory_gib=memory,
                        tokens_per_gpu=tokens, not_modeled="torch.compile, async TP"))
    # Llama 3 405B, BF16, no activation checkpointing (the paper's 3.3.2: "we could
    # pre-train Llama 3 on sequences of 8K tokens without activation checkpointing"),
    # interleaved 1F1B. The stages per rank are not stated as a number; the paper's
    # balancing is: "the first model chunk on the first stage has only the embedding, and
    # the last model chunk on the last stage has only output projection and loss", after
    # taking one layer from each, so a chunk holds one layer: 126 layers and the two ends
    # on 128 chunks, 8 per rank of pp 16 (its bubble, (pp - 1) / (8 x microbatches), is
    # the paper's formula).
    for gpus, cp, seq, per_dp, mfu in ((8192, 1, 8192, 32, 0.43), (16384, 1, 8192, 16, 0.41),
                                       (16384, 16, 131072, 16, 0.38)):
        dp = gpus // (8 * cp * 16)
        mesh = {"pp": 16, "dp_shard": dp, **({"cp": cp} if cp > 1 else {}), "tp": 8}
        plugins = [("pp", {"schedule": "Interleaved1F1B", "stages_per_rank": 8,
                           "microbatches": per_dp}), TP_SP, FSDP_KEPT]
        if cp > 1:
            plugins.insert(2, ("cp", {"mode": "allgather", "seq_len": seq}))
        rows.append(Row(f"405B {gpus} GPUs TP 8 CP {cp} PP 16 DP {dp} seq {seq}", LLAMA3,
                        "llama3-405b", gpus // 8, mesh, tuple(plugins), seq, 1, mfu=mfu,
                        not_modeled="Meta's kernels, its schedule's memory and early frees"))
    # DeepSeek-V3: PP 16 x EP 64 x DP 2 (ZeRO-1: FSDP2 keeping parameters gathered), FP8,
    # 15360 sequences a step: 120 per data shard (ep x dp). Its DualPipe as torch's
    # DualPipeV writes it (two stages per rank, V-shaped, one copy of the parameters),
    # with pp's overlap: each overlapped forward and backward runs its halves at once,
    # so the all-to-alls of the paired passes (80-86 % of each stage's) run behind the
    # other half's compute; the rest wait. DeepSeek recomputed its norms and MLA
    # up-projections only; DualPipeV's split backward recomputes each block twice,
    # which torch's selective checkpointing refuses (CP606), so the plan runs full.
    rows.append(Row("DeepSeek-V3 2048 H800 PP 16 EP 64 DP 2", DEEPSEEK, "deepseek-v3", 256,
                    {"pp": 16, "dp_shard": 2, "ep": 64},
                    (("pp", {"schedule": "DualPipeV", "stages_per_rank": 2,
                             "microbatches": 120, "overlap": True}), ("ep", {}), FSDP_KEPT,
                     _ac("full")), 4096, 1, device="h800", matmul_dtype="float8",
                    intra_gbps=H800_NVLINK, tokens_per_gpu=1543,
                    not_modeled="node-limited routing; its selective recompute (full "
                    "here); how much of each pair's compute the all-to-alls' kernels "
                    "take"))
    return rows


def _plan(row: Row) -> Any:
    from composer_par import MeshSpec, ParallelPlan, Registry, Topology

    reg = Registry()
    plan = ParallelPlan(MeshSpec(**row.mesh), topology=Topology(
        row.nodes, 8, intra_node_gbps=row.intra_gbps, inter_node_gbps=row.inter_gbps))
    for name, options in row.plugins:
        plan.use(reg.get(name)(**options))
    return plan


def estimate_row(row: Row) -> Any:
    """The row's estimate; a plan that does not validate is no row (it would not run)."""
    from composer_par.estimate import Workload, estimate_plan, preset

    plan = _plan(row)
    errors = [f for f in plan.validate(world_size=row.nodes * 8).findings
              if f.severity.value == "error"]
    if errors:
        raise SystemExit(f"{row.name}: the plan does not validate:\n"
                         + "\n".join(f.format() for f in errors))
    return estimate_plan(plan, preset(row.model),
                         Workload(seq=row.seq, micro_batch=row.micro_batch, dtype="bf16",
                                  reduce_dtype=row.reduce_dtype,
                                  matmul_dtype=row.matmul_dtype),
                         world_size=row.nodes * 8, device=row.device)


def _ratio(predicted: float, published: float | None, target: float) -> tuple[str, str]:
    if published is None:
        return "-", ""
    ratio = predicted / published
    return f"{ratio:.2f}", "ok" if abs(ratio - 1) <= target else "MISS"


def estimate_table() -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for row in _rows():
        started = time.perf_counter()
        est = estimate_row(row)
        step = est.step
        memory = est.memory.total / GIB
        m_ratio, m_ok = _ratio(memory, row.memory_gib, MEMORY_TARGET)
        t_ratio, t_ok = _ratio(step.tokens_per_second_per_device, row.tokens_per_gpu,
                               TOKENS_TARGET)
        f_ratio, f_ok = _ratio(step.mfu, row.mfu, TOKENS_TARGET)
        out.append((row.name, f"{memory:.1f}", f"{row.memory_gib or '-'}",
                    f"{m_ratio} {m_ok}".strip(),
                    f"{step.tokens_per_second_per_device:,.0f}",
                    f"{row.tokens_per_gpu or '-'}", f"{t_ratio} {t_ok}".strip(),
                    f"{step.mfu:.1%}", f"{row.mfu:.0%}" if row.mfu else "-",
                    f"{f_ratio} {f_ok}".strip(), row.not_modeled or "-",
                    f"{time.perf_counter() - started:.1f}s", row.source))
    return out


@attrs.frozen
class Cluster:
    name: str
    source: str
    model: str
    nodes: int
    memory_gib: float
    seq: int
    global_batch: int
    published: dict[str, int]  # mesh sizes of the published layout (data dims merged)
    device: str = "h100"
    matmul_dtype: str | None = None
    intra_gbps: float = H100_NVLINK
    options: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    max_sizes: dict[str, int] = attrs.field(factory=dict)


CLUSTERS = [
    Cluster("Llama 3 405B, 16384 H100", LLAMA3, "llama3-405b", 2048, 80, 8192, 2048,
            {"tp": 8, "cp": 1, "pp": 16, "ep": 1, "data": 128},
            # the stages per rank left to suggest (2, 4, 8): each layout at its best
            options={"pp": {"schedule": "Interleaved1F1B"}}),
    Cluster("DeepSeek-V3, 2048 H800", DEEPSEEK, "deepseek-v3", 256, 80, 4096, 15360,
            {"tp": 1, "cp": 1, "pp": 16, "ep": 64, "data": 2}, device="h800",
            matmul_dtype="float8", intra_gbps=H800_NVLINK,
            # the published schedule: DualPipe, its pairs running at once
            options={"pp": {"schedule": "DualPipeV", "overlap": True}}),
]


def _published(candidate: Any, layout: dict[str, int]) -> bool:
    sizes = {d: candidate.size(d) for d in ("tp", "cp", "pp", "ep")}
    data = candidate.size("dp_replicate") * candidate.size("dp_shard")
    return sizes == {d: layout[d] for d in sizes} and data == layout["data"]


def main() -> None:
    from composer_par.tables import table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    print("predicted / published, per row (memory: GiB per GPU at peak; tokens/s per GPU; "
          f"MFU against the dense BF16 peak); targets: memory +-{MEMORY_TARGET:.0%}, "
          f"tokens/s and MFU +-{TOKENS_TARGET:.0%}")
    print(table(estimate_table(), ("ROW", "MEM", "PUB", "RATIO", "TOK/S", "PUB", "RATIO",
                                   "MFU", "PUB", "RATIO", "NOT MODELED", "TIME", "SOURCE"),
                right=(1, 2, 4, 5, 7, 8)))


if __name__ == "__main__":
    main()
