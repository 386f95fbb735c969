"""The checks `outcore train` makes of its options before anything is built or written: flags that
belong to another flag, and settings that contradict each other, each one line naming the flag."""

from __future__ import annotations

from outcore.hf.data_mix import data_file
from outcore.tools.lr_schedules import SCHEDULES
from outcore.tools.train_options import TrainOptions


def check_flags(opts: TrainOptions) -> None:
    """ValueError naming the first flag `opts` cannot be run with."""
    if opts.lora is not None and opts.model is None:
        raise ValueError("--lora trains adapters of a pretrained model: give --model DIR too.")
    for flag, given in (("--merge-adapters", opts.merge_adapters), ("--lora-alpha", opts.lora_alpha is not None),
                        ("--lora-targets", opts.lora_targets is not None), ("--lora-init", opts.lora_init is not None),
                        ("--dora", opts.dora), ("--quantize", opts.quantize is not None)):
        if given and opts.lora is None:
            raise ValueError(f"{flag} is a setting of LoRA adapters: give --model DIR and --lora R too.")
    for flag, given in (("--chat-template", opts.chat_template is not None),
                        ("--train-on-prompt", opts.train_on_prompt), ("--no-packing", not opts.packing),
                        ("--eval-data", opts.eval_data is not None)):
        if given and opts.model is None:
            raise ValueError(f"{flag} is a setting of fine-tuning data: give --model DIR too.")
    files = [data_file(spec) for spec in opts.data]
    weighted = [f for f in files if f.weight is not None]
    if weighted and opts.model is None:
        raise ValueError(f"--data {weighted[0].path}:{weighted[0].weight:g}: weights mix fine-tuning samples (--model "
                         "DIR); a preset's text files are read one after another. Drop the :W.")
    if opts.lr_scheduler is not None and opts.lr_scheduler not in SCHEDULES:
        raise ValueError(f"--lr-scheduler {opts.lr_scheduler!r}: choose from {', '.join(SCHEDULES)}.")
    if opts.warmup_steps is not None and opts.warmup_ratio is not None:
        raise ValueError("--warmup-steps and --warmup-ratio both set the warm-up: give one.")
    for flag, beta in (("--adam-beta1", opts.adam_beta1), ("--adam-beta2", opts.adam_beta2)):
        if beta is not None and not 0 <= beta < 1:
            raise ValueError(f"{flag} {beta}: AdamW's betas lie in [0, 1).")
