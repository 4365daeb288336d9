"""The Hugging Face Trainer with a plan file given on the command line, for torchrun:

    torchrun --nproc-per-node 4 examples/hf_trainer_plan.py \\
        --plan examples/plans/fsdp_tp.toml --output_dir out --max_steps 20 --use_cpu true

Every TrainingArguments option works as usual (``--help`` lists them after ``--plan``);
those that overlap the plan (fsdp, bf16, torch_compile, gradient checkpointing, ...) are
refused before anything is built. The model is a small LlamaForCausalLM built from a
config on meta: the plan shards and initializes it (a plan with a loader reads weights
instead). The data is arithmetic token sequences, enough to see the loss fall.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainingArguments

from composer_par import MetaInit
from composer_par.integrations.hf_trainer import PlanArguments, PlanTrainer


@dataclass
class ModelArguments:
    hidden_size: int = field(default=128, metadata={"help": "the model's hidden size"})
    layers: int = field(default=4, metadata={"help": "decoder layers"})
    seq_len: int = field(default=64, metadata={"help": "tokens per sample"})
    samples: int = field(default=4096, metadata={"help": "samples in the synthetic dataset"})


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``start + stride * i`` modulo the vocabulary: learnable, the same on every rank."""

    def __init__(self, count: int, seq_len: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (count, 1), generator=gen)
        stride = torch.randint(1, 4, (count, 1), generator=gen)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((PlanArguments, ModelArguments, TrainingArguments))
    plan_args, model_args, training_args = parser.parse_args_into_dataclasses(argv)
    plan = plan_args.load()
    if plan.plugin("meta_init") is None and not any(
            p.name.startswith("load_") for p in plan.plugins):
        plan.use(MetaInit(seed=training_args.seed))
    config = LlamaConfig(
        vocab_size=256, hidden_size=model_args.hidden_size,
        intermediate_size=2 * model_args.hidden_size, num_hidden_layers=model_args.layers,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=model_args.seq_len, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    trainer = PlanTrainer(plan, model=model, args=training_args,
                          train_dataset=Sequences(model_args.samples, model_args.seq_len, 256))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)


if __name__ == "__main__":
    main(sys.argv[1:])
