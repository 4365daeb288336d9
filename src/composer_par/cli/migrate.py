"""``import``: a plan file from an accelerate config, a DeepSpeed JSON, or the Hugging
Face Trainer's ``--fsdp`` / ``--fsdp_config`` / ``--deepspeed`` values.

    composer-par import accelerate_config.yaml -o plan.toml
    composer-par import ds_config.json --explain
    composer-par import --fsdp "full_shard auto_wrap offload" --fsdp-config fsdp.json

Exit codes: 0 the plan was written (findings are warnings or info), 1 the written plan
has validation errors, 2 the source could not be read or holds a value its tool does not
accept (CP901, CP902, CP913). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from composer_par.cli.common import EXIT_INPUT, InputError, Output, bounded_int
from composer_par.migrate import KINDS, ImportFailed, ImportResult
from composer_par.planfile import MAX_RANKS


def import_arguments(parser: argparse.ArgumentParser) -> None:
    ranks = bounded_int(1, MAX_RANKS)
    parser.add_argument("source", metavar="SOURCE", nargs="?",
                        help="an accelerate config YAML, a DeepSpeed JSON, or a transformers "
                        "DistributedConfig JSON (or a model's config.json holding one)")
    parser.add_argument("--from", dest="kind", choices=KINDS,
                        help="what SOURCE is (default: told by its suffix and keys)")
    parser.add_argument("-o", "--output", metavar="PLAN.toml",
                        help="write the plan file here (default: print it)")
    parser.add_argument("--explain", action="store_true",
                        help="print each source setting beside the plan line it became")
    trainer = parser.add_argument_group("the Hugging Face Trainer's arguments (instead of "
                                        "SOURCE)")
    trainer.add_argument("--fsdp", metavar="OPTIONS",
                         help="the Trainer's --fsdp, e.g. \"full_shard auto_wrap offload\"")
    trainer.add_argument("--fsdp-config", metavar="JSON",
                         help="the Trainer's --fsdp_config: a JSON file or JSON text")
    trainer.add_argument("--deepspeed", metavar="JSON",
                         help="the Trainer's --deepspeed: a DeepSpeed JSON file")
    trainer.add_argument("--bf16", action="store_true", help="the Trainer's --bf16")
    trainer.add_argument("--fp16", action="store_true", help="the Trainer's --fp16")
    trainer.add_argument("--gradient-checkpointing", action="store_true",
                         help="the Trainer's --gradient_checkpointing")
    where = parser.add_argument_group("where it runs (overrides what the source says)")
    where.add_argument("--nodes", type=ranks, metavar="N", help="number of nodes")
    where.add_argument("--world-size", type=ranks, metavar="N",
                       help="number of ranks, to validate the plan against")


def _fsdp_config(text: str | None) -> object:
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        from composer_par.migrate.reading import load_json

        return load_json(text, "--fsdp-config")
    return Path(text)


def _result(args: argparse.Namespace) -> ImportResult:
    from composer_par.migrate import import_config, import_trainer_args

    trainer = args.fsdp is not None or args.deepspeed is not None
    if trainer and args.source is not None:
        raise InputError("give SOURCE or the Trainer's arguments (--fsdp, --deepspeed), "
                         "not both")
    if not trainer and args.source is None:
        raise InputError("give SOURCE (an accelerate YAML or a DeepSpeed JSON), or the "
                         "Trainer's --fsdp / --deepspeed")
    if args.fsdp_config is not None and args.fsdp is None:
        raise InputError("--fsdp-config goes with --fsdp")
    if trainer:
        return import_trainer_args(
            fsdp=args.fsdp, fsdp_config=_fsdp_config(args.fsdp_config),  # type: ignore[arg-type]
            deepspeed=args.deepspeed, bf16=args.bf16, fp16=args.fp16,
            gradient_checkpointing=args.gradient_checkpointing, nodes=args.nodes,
            world_size=args.world_size)
    return import_config(args.source, kind=args.kind, nodes=args.nodes,
                         world_size=args.world_size)


def run_import(args: argparse.Namespace, out: Output) -> int:
    try:
        result = _result(args)
    except ImportFailed as exc:
        data = {"source": exc.source, "exit_code": EXIT_INPUT, **exc.report.to_dict()}
        out.result(data, f"{exc.source}: cannot import\n{out.severities(exc.report.format())}")
        return EXIT_INPUT
    code = 1 if result.report.errors else 0
    if args.output:
        Path(args.output).write_text(result.text(), encoding="utf-8")
    parts = []
    if args.explain:
        parts.append(result.explain())
    if not args.output:
        parts.append(result.text())
    else:
        parts.append(f"wrote {args.output}")
    parts.append(out.severities(result.report.format()))
    out.result({**result.to_dict(), "output": args.output, "exit_code": code},
               "\n\n".join(parts))
    return code


__all__ = ["import_arguments", "run_import"]
