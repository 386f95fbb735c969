"""`transformers.Trainer`, TRL's `SFTTrainer` and their subclasses, training through outcore's engine.

    SFTTrainer = outcore.hf.outcore_trainer(trl.SFTTrainer)
    trainer = SFTTrainer(model="/models/llama-8b", args=trl.SFTConfig(...), train_dataset=ds,
                         peft_config=peft.LoraConfig(r=16), outcore_config=outcore.Config(...))

Accelerate has no place for a third backend (its DistributedType is a closed set), so the class
`outcore_trainer` makes owns what a backend owns, and leaves the rest (data, logging, evaluation,
callbacks, the trainer's state and RNG files) to the trainer it extends. It has two parts:

- in front of the trainer, `OutcoreTrainerMixin` (here): the model built from a path under
  `deferred_init()` as the trainer would build it (hf/trainer_model.py), its weights streamed by the
  engine (`weights=`); a `peft_config` applied before the engine, its adapters drawn as peft draws
  them after the trainer's `set_seed(args.seed)` (hf/adapter_init.py `draw_as_peft`); a frozen
  reference where a preference trainer would load a second copy (hf/reference_model.py); the lines
  the run says (hf/run_report.py);
- under it, right above `transformers.Trainer`, `EngineBackend` (hf/trainer_backend.py): the step,
  the optimizer and scheduler, and the checkpoints, so that what the trainer wraps around them still
  wraps them.

What the engine cannot honour (another optimizer, `torch_compile`, a DeepSpeed or FSDP config) is
refused in one line before anything is written.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import transformers
from torch import nn

from outcore.hf.adapter_init import draw_as_peft
from outcore.hf.dataset_columns import check_columns
from outcore.hf.generation import generates, generation_note, generation_refusals
from outcore.hf.model_info import hf_checkpointing, is_peft
from outcore.hf.model_init import ModelInit, compute_dtype, given_quantization, hidden_from_trainer, model_init
from outcore.hf.quantization import quantized_config
from outcore.hf.reference_model import (
    check_reference_vocabulary,
    hashed_by_files,
    reference_built_from,
    reference_engine,
    takes_reference,
    wants_reference,
)
from outcore.hf.rewards import check_rewards
from outcore.hf.run_report import dropout_note, end_line, start_line
from outcore.hf.source import HFModel
from outcore.hf.trained_model import answer_through_engine
from outcore.hf.trainer_backend import EngineBackend
from outcore.hf.trainer_checkpoint import new_run_id
from outcore.hf.trainer_model import built_class, draw_new_head
from outcore.offload.scratch_dir import DirectoryLock
from outcore.runtime.config import Config
from outcore.runtime.engine import Engine
from outcore.runtime.optimizer import AdamW

log = logging.getLogger(__name__)

MIN_TRANSFORMERS = "5.25"  # the oldest release the Trainer integration is tested against (pyproject's hf extra)
# The trainers tested equal to their plain selves (tests/hf); another is built, and said once to be untested.
TESTED = ("Trainer", "SFTTrainer", "DPOTrainer", "KTOTrainer", "ORPOTrainer", "CPOTrainer", "RewardTrainer",
          "GRPOTrainer", "RLOOTrainer")
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")  # the Trainer's names for torch's AdamW
T = TypeVar("T", bound=type)


def refusals(args: Any, kwargs: dict[str, Any]) -> list[str]:
    """The trainer arguments outcore cannot honour, each as the sentence that says so."""
    out = []
    optim = getattr(args, "optim", None)
    optim = str(getattr(optim, "value", optim))  # an OptimizerNames member, or a string
    if args is not None and optim not in ADAMW_NAMES:
        out.append(f"optim={optim!r}: outcore steps its own AdamW over the sharded states; leave optim at "
                   f"{ADAMW_NAMES[0]!r} (AdamW's betas, eps and weight decay are honoured).")
    if getattr(args, "torch_compile", False):
        out.append("torch_compile=True: outcore's hooks page each unit in and out around its forward, which "
                   "torch.compile cannot trace; leave it False.")
    if getattr(args, "deepspeed", None):
        out.append("deepspeed=...: outcore is the ZeRO engine here; translate the DeepSpeed config with "
                   "outcore.Config.from_deepspeed(...) and pass it as outcore_config=.")
    if getattr(args, "fsdp", None):
        out.append("fsdp=...: outcore shards the model itself; drop the fsdp setting and set stages and offload "
                   "in outcore_config=.")
    if any(o is not None for o in kwargs.get("optimizers") or ()) or kwargs.get("optimizer_cls_and_kwargs"):
        out.append("optimizers=/optimizer_cls_and_kwargs=: outcore steps its own AdamW; set learning_rate, "
                   "adam_beta1/2, adam_epsilon, weight_decay and lr_scheduler_type in the arguments instead.")
    if (getattr(args, "gradient_checkpointing_kwargs", None) or {}).get("use_reentrant"):
        out.append("gradient_checkpointing_kwargs use_reentrant=True: the engine sees a unit's backward through "
                   "non-reentrant checkpointing only; leave use_reentrant unset or False.")
    if kwargs.get("model_init") is not None:
        out.append("model_init=: give model= (a path, or a module built under outcore.deferred_init()).")
    return out


def engine_config(config: Config, args: Any, init: ModelInit | None = None) -> Config:
    """`config` with what the trainer's arguments decide: the compute dtype (or `model_init_kwargs`'
    where the flags leave it open), clipping and the accumulation window. A dtype set in `config`
    that the arguments contradict is refused."""
    dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    dtype = (compute_dtype(init, args) if init is not None else None) or dtype
    if config.dtype not in ("fp32", dtype):
        raise ValueError(f"outcore_config dtype={config.dtype!r} and the trainer's arguments ({dtype}) disagree; "
                         f"set bf16=/fp16= in the arguments, which decide it.")
    return dataclasses.replace(config, dtype=dtype, grad_clip=args.max_grad_norm or None,
                               grad_accumulation=args.gradient_accumulation_steps)


class OutcoreTrainerMixin:
    """What `outcore_trainer` puts in front of a Trainer class (see the module's docstring)."""

    engine: Engine
    args: Any
    model: nn.Module
    train_dataset: Any
    eval_dataset: Any

    def __init__(self, *positional: Any, outcore_config: Config | None = None, **kwargs: Any) -> None:
        kwargs = _by_keyword(super().__init__, positional, kwargs)
        model, args = kwargs.pop("model", None), kwargs.pop("args", None)
        said = refusals(args, kwargs) + (generation_refusals(args) if generates(type(self)) else [])
        if said:
            raise ValueError(f"{type(self).__name__}: {said[0]}")
        check_columns(type(self), {k: kwargs.get(k) for k in ("train_dataset", "eval_dataset")})
        init = model_init(getattr(args, "model_init_kwargs", None))
        quantization = given_quantization(init, kwargs)
        weights, source = None, None
        transformers.set_seed(getattr(args, "seed", 42))  # as the trainer seeds before it builds the model
        if isinstance(model, (str, os.PathLike)):
            weights = os.path.abspath(os.fspath(model))
            task_class, settings = built_class(type(self))
            source = HFModel(weights, attn_implementation=init.attn_implementation, task_class=task_class,
                             config_overrides=tuple({**init.config_overrides, **settings}.items()))
            model = source.build()
            draw_new_head(model, weights)
        elif getattr(args, "model_init_kwargs", None):
            raise ValueError(f"{type(self).__name__}: args.model_init_kwargs set with model= a module, which is built "
                             "already; give model= the model's directory, or leave model_init_kwargs out.")
        elif not isinstance(model, nn.Module):
            raise ValueError(f"{type(self).__name__}: model= a Hugging Face model directory or a module; got "
                             f"{type(model).__name__}.")
        peft_config = kwargs.pop("peft_config", None)
        if peft_config is None and is_peft(model) and takes_reference(super().__init__):
            raise ValueError(f"{type(self).__name__}: model= a peft model: TRL copies its adapter as the reference, "
                             "which needs its values before outcore has read them; give the base as model= and the "
                             "adapters' LoraConfig as peft_config=.")
        if peft_config is not None:
            model = _with_adapters(model, peft_config)
        if args is not None and args.gradient_checkpointing:
            enable = hf_checkpointing(model)
            if enable is None:
                raise ValueError(f"gradient_checkpointing=True: {type(model).__name__} has no activation "
                                 "checkpointing of its own; leave it False.")
            enable()
        self.reference: Engine | None = None  # a frozen reference without peft (hf/reference_model.py)

        def reference() -> nn.Module:
            if source is None:
                raise ValueError(f"{type(self).__name__}: model= a module and no ref_model=: give model= the model's "
                                 "directory, which outcore reads in place as the reference too.")
            given = outcore_config or Config()
            self.reference = reference_engine(source, engine_config(given, args, init) if args else given,
                                              seed=getattr(args, "seed", 42))
            return self.reference.module

        if wants_reference(super().__init__, kwargs, args, adapters=is_peft(model)):
            kwargs["ref_model"] = reference()
        check_reference_vocabulary(model, kwargs.get("ref_model"))
        self._resume_from: str | None = None
        self._run_id = new_run_id()  # ties each checkpoint-N to this run (hf/trainer_checkpoint.py)
        self._last_stats: dict[str, Any] = {}
        self._pending: list[dict[str, Any]] = []
        self._deferred_precompute: list[tuple[str, int]] = []
        with hashed_by_files(type(self), weights), reference_built_from(type(self), weights, reference), \
                hidden_from_trainer(args):
            super().__init__(model=model, args=args, **kwargs)  # type: ignore[call-arg]
        _drop_reference_copy(self.model)
        decay = set(self.get_decay_parameter_names(self.model))  # type: ignore[attr-defined]
        no_decay = frozenset(n for n, p in self.model.named_parameters() if p.requires_grad and n not in decay)
        hp = AdamW(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                   eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay, no_decay=no_decay)
        config = quantized_config(engine_config(outcore_config or Config(), self.args, init), quantization)
        self.engine = Engine(self.model, config, hp, weights=weights, seed=self.args.seed)
        self._precompute_deferred()
        answer_through_engine(self.model, self.engine, self.save_model)  # type: ignore[attr-defined]

    # -- DPO's reference log-probs, computed ahead once the engine can run the model ----------------

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """`DPOTrainer(precompute_ref_log_probs=True)` runs the reference over the data inside its
        `__init__`, before the engine exists: put off until it does."""
        if getattr(self, "engine", None) is None:
            self._deferred_precompute.append((name, batch_size))
            return dataset
        return super()._precompute_ref_logps(dataset, name, batch_size)  # type: ignore[misc]

    def _precompute_deferred(self) -> None:
        for name, batch_size in self._deferred_precompute:
            if name == "train":
                self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
            elif isinstance(self.eval_dataset, dict):
                self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)
            else:
                self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)
        self._deferred_precompute = []

    # -- GRPO's and RLOO's rewards, checked -----------------------------------------------------------

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # type: ignore[misc]
        said = self.__dict__.setdefault("_said_rewards", set())  # names said once
        check_rewards(rewards, self.reward_func_names, said)  # type: ignore[attr-defined]
        return rewards

    # -- the run, said -----------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The trainer's own loop, between the two lines hf/run_report.py says of the run."""
        said = self.is_world_process_zero()  # type: ignore[attr-defined]
        if said:
            print(start_line(self.engine), file=sys.stderr)
            generating = generation_note(self.engine, self.args) if generates(type(self)) else None
            notes = [dropout_note(self.model), generating]
            for note in filter(None, notes):
                print(note, file=sys.stderr)
        at_start, step = self.engine.stats(), self.engine.global_step
        # output_dir is this trainer's while it trains: another trainer on it (in this process too) is
        # refused before it writes a checkpoint-N, and after train() it is free again for the next one.
        os.makedirs(self.args.output_dir, exist_ok=True)
        held = DirectoryLock(self.args.output_dir, self.engine.group.rank, what="output_dir",
                             prefix=".outcore-trainer-")
        try:
            result = super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            held.release(remove=True)
            self.engine.sharded.writer_lock.release()  # the checkpoint-N it saved into last
        if said:
            print(end_line(self.engine, self.engine.global_step - step, at_start), file=sys.stderr)
        return result


def _by_keyword(init: Callable[..., None], positional: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of the trainer underneath by its name: the order of its positional parameters
    differs from class to class (`DPOTrainer`'s second is `ref_model`, `GRPOTrainer`'s `reward_funcs`)."""
    names = [p.name for p in inspect.signature(init).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) > len(names):
        raise TypeError(f"the trainer takes {len(names)} positional arguments ({', '.join(names)}); "
                        f"{len(positional)} were given.")
    both = [n for n in names[: len(positional)] if n in kwargs]
    if both:
        raise TypeError(f"the trainer got {both[0]!r} both by position and by keyword.")
    return {**dict(zip(names, positional, strict=False)), **kwargs}


def _drop_reference_copy(model: nn.Module) -> None:
    """TRL's preference trainers, given a model peft wraps already, copy its adapter as their reference
    (a "ref" adapter); plain TRL given `peft_config` makes none and takes the base with the adapters
    off. Here the trainer underneath always sees a wrapped model, so the copy it made of adapters
    made from `peft_config` is removed, as plain TRL would not have made it."""
    if "ref" in (getattr(model, "peft_config", None) or {}):
        model.delete_adapter("ref")  # type: ignore[operator]


def _with_adapters(model: nn.Module, peft_config: Any) -> nn.Module:
    """`model` wrapped by peft as `SFTTrainer` wraps it: its adapters drawn from the RNG (seeded by
    the trainer's seed, and a new head drawn first) as peft draws them; those computed from the base weights
    (PiSSA, OLoRA, DoRA's magnitude) are left to the engine, which reads the weights."""
    import peft

    if is_peft(model):
        raise ValueError("peft_config= with a model peft already wraps: give one of them.")
    before = torch.get_rng_state()
    wrapped = peft.get_peft_model(model, peft_config)  # its adapters name the base by model.name_or_path
    draw_as_peft(wrapped, before)
    return wrapped


@functools.cache
def outcore_trainer(cls: T) -> T:
    """`cls` (transformers.Trainer or a subclass: trl.SFTTrainer, ...) training through outcore:
    the same arguments, plus `outcore_config=outcore.Config(...)`, and `peft_config=` for any of them."""
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"outcore_trainer takes transformers.Trainer or a subclass of it; got {cls!r}.")
    if not callable(getattr(transformers.Trainer, "_prepare_for_training", None)):  # where the loop calls out to us
        raise ImportError(f"outcore's Trainer needs transformers >= {MIN_TRANSFORMERS} (this is "
                          f"{transformers.__version__}): pip install 'outcore[hf]'.")
    nearest = next(c.__name__ for c in cls.__mro__ if c.__module__.split(".")[0] in ("trl", "transformers"))
    if nearest not in TESTED:
        log.warning("outcore_trainer(%s): %s is not among the trainers tested equal to their plain selves under "
                    "outcore (%s); compare a few steps with the plain trainer before a long run", cls.__name__,
                    nearest, ", ".join(TESTED))
    bases = (OutcoreTrainerMixin, EngineBackend) if cls is transformers.Trainer else (OutcoreTrainerMixin, cls,
                                                                                       EngineBackend)
    return type(f"Outcore{cls.__name__}", bases,  # type: ignore[return-value]
                {"__module__": __name__, "__qualname__": f"Outcore{cls.__name__}", "__doc__": cls.__doc__})


Trainer: Callable[..., Any] = outcore_trainer(transformers.Trainer)
