"""`transformers.Trainer`, TRL's `SFTTrainer` and their subclasses, training through outcore's engine.

    SFTTrainer = outcore.hf.outcore_trainer(trl.SFTTrainer)
    trainer = SFTTrainer(model="/models/llama-8b", args=trl.SFTConfig(...), train_dataset=ds,
                         peft_config=peft.LoraConfig(r=16), outcore_config=outcore.Config(...))

Accelerate has no place for a third backend (its DistributedType is a closed set), so the subclass
owns what a backend owns, and leaves the rest (data, logging, evaluation, callbacks, the trainer's
state and RNG files) to the trainer it extends:

- the model: built from a path under `deferred_init()` and its weights streamed by the engine
  (`weights=`); a `peft_config` applied before the engine, its adapters drawn as peft draws them
  after the trainer's `set_seed(args.seed)` (hf/adapter_init.py `draw_as_peft`);
- the step: the micro-batches the trainer gathers for one optimizer step run as one
  `engine.train_batch` (each unit read once for all of them), each through the trainer's own
  `compute_loss`, scaled as the trainer scales it; the engine clips, updates and steps the LR
  scheduler, which the trainer built on `engine.optimizer`;
- checkpoints: `checkpoint-N/outcore/` holds the engine's sharded checkpoint beside the trainer's
  state and RNG files; `save_model` exports an HF directory, or peft adapters.

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
from outcore.hf.model_info import hf_checkpointing, is_peft
from outcore.hf.model_init import ModelInit, compute_dtype, given_quantization, hidden_from_trainer, model_init
from outcore.hf.quantization import quantized_config
from outcore.hf.reference_model import hashed_by_files, reference_engine, takes_reference, wants_reference
from outcore.hf.run_report import dropout_note, end_line, start_line
from outcore.hf.source import HFModel
from outcore.hf.trained_model import answer_through_engine
from outcore.hf.trainer_checkpoint import (
    CHECKPOINT_SUBDIR,
    check_resumable,
    identity,
    new_run_id,
    write_checkpoint_readme,
    write_identity,
)
from outcore.runtime.config import Config
from outcore.runtime.engine import Engine
from outcore.runtime.optimizer import AdamW

log = logging.getLogger(__name__)

MIN_TRANSFORMERS = "5.25"  # the oldest release the Trainer integration is tested against (pyproject's hf extra)
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


class SteppedByEngine:
    """The trainer's view of the LR scheduler the engine steps: the trainer's own `step()` after
    each update does nothing (the engine stepped it already, after the update it applied)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def step(self, *_: Any, **__: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, load_state_dict, ...
        return getattr(self.scheduler, name)


class OutcoreTrainerMixin:
    """The methods `outcore_trainer` puts in front of a Trainer class (see the module's docstring)."""

    engine: Engine
    args: Any
    model: nn.Module
    train_dataset: Any
    eval_dataset: Any

    def __init__(self, *positional: Any, outcore_config: Config | None = None, **kwargs: Any) -> None:
        kwargs = _by_keyword(super().__init__, positional, kwargs)
        model, args = kwargs.pop("model", None), kwargs.pop("args", None)
        said = refusals(args, kwargs)
        if said:
            raise ValueError(f"{type(self).__name__}: {said[0]}")
        init = model_init(getattr(args, "model_init_kwargs", None))
        quantization = given_quantization(init, kwargs)
        weights, source = None, None
        if isinstance(model, (str, os.PathLike)):
            weights = os.path.abspath(os.fspath(model))
            source = HFModel(weights, attn_implementation=init.attn_implementation,
                             config_overrides=tuple(init.config_overrides.items()))
            model = source.build()
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
            model = _with_adapters(model, peft_config, args)
        if args is not None and args.gradient_checkpointing:
            enable = hf_checkpointing(model)
            if enable is None:
                raise ValueError(f"gradient_checkpointing=True: {type(model).__name__} has no activation "
                                 "checkpointing of its own; leave it False.")
            enable()
        self.reference: Engine | None = None  # DPO's or KTO's frozen reference without peft (hf/reference_model.py)
        if wants_reference(super().__init__, kwargs, args, adapters=is_peft(model)):
            if source is None:
                raise ValueError(f"{type(self).__name__}: model= a module and no ref_model=: give model= the model's "
                                 "directory, which outcore reads in place as the reference too.")
            given = outcore_config or Config()
            self.reference = reference_engine(source, engine_config(given, args, init) if args else given,
                                              seed=getattr(args, "seed", 42))
            kwargs["ref_model"] = self.reference.module
        self._resume_from: str | None = None
        self._run_id = new_run_id()  # ties each checkpoint-N to this run (hf/trainer_checkpoint.py)
        self._last_stats: dict[str, Any] = {}
        self._pending: list[dict[str, Any]] = []
        self._deferred_precompute: list[tuple[str, int]] = []
        with hashed_by_files(type(self), weights), hidden_from_trainer(args):
            super().__init__(model=model, args=args, **kwargs)  # type: ignore[call-arg]
        _drop_reference_copy(self.model)
        decay = set(self.get_decay_parameter_names(self.model))  # type: ignore[attr-defined]
        no_decay = frozenset(n for n, p in self.model.named_parameters() if p.requires_grad and n not in decay)
        hp = AdamW(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                   eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay, no_decay=no_decay)
        config = quantized_config(engine_config(outcore_config or Config(), self.args, init), quantization)
        self.engine = Engine(self.model, config, hp, weights=weights, seed=self.args.seed)
        self._precompute_deferred()
        answer_through_engine(self.model, self.engine, self.save_model)

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

    # -- the model stays where the engine puts it ---------------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        return None  # the engine pages its shards; the module holds no parameters of its own

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return self.model  # the engine reduces gradients itself: no DDP around it

    # -- optimizer and scheduler: the engine's ----------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.engine.lr_scheduler is None:
            base = super().create_scheduler  # type: ignore[misc]
            self.lr_scheduler = None

            def build(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
                return base(num_training_steps, optimizer=opt)

            self.engine.use_lr_scheduler(build)
        assert self.engine.lr_scheduler is not None
        self.lr_scheduler = SteppedByEngine(self.engine.lr_scheduler)
        return self.lr_scheduler

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The trainer's own loop, between the two lines hf/run_report.py says of the run."""
        said = self.is_world_process_zero()  # type: ignore[attr-defined]
        if said:
            print(start_line(self.engine), file=sys.stderr)
            note = dropout_note(self.model)
            if note is not None:
                print(note, file=sys.stderr)
        at_start, step = self.engine.stats(), self.engine.global_step
        result = super().train(*args, **kwargs)  # type: ignore[misc]
        if said:
            print(end_line(self.engine, self.engine.global_step - step, at_start), file=sys.stderr)
        return result

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        if self._resume_from is not None:  # after the scheduler exists, so that its state comes back too
            self.engine.load_checkpoint(os.path.join(self._resume_from, CHECKPOINT_SUBDIR))
            self._resume_from = None
        self.model_wrapped = self.model
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))  # type: ignore[attr-defined]
        self.callback_handler.train_dataloader = train_dataloader  # type: ignore[attr-defined]
        return self.model, train_dataloader

    # -- the step ---------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Gather the window's micro-batches; at its last, run them as one `engine.train_batch`.
        The losses are returned at the window's end (zero before): what the trainer sums for its
        log is the same."""
        self.model.train()
        self._pending.append(self._prepare_inputs(inputs))  # type: ignore[attr-defined]
        count = self.current_gradient_accumulation_steps  # type: ignore[attr-defined]
        if len(self._pending) < count:
            return torch.zeros((), device=self.args.device)
        batch, self._pending = self._pending, []
        losses: list[torch.Tensor] = []

        def compute_loss(micro_batch: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager():  # type: ignore[attr-defined]
                loss = self.compute_loss(model, micro_batch,  # type: ignore[attr-defined]
                                         num_items_in_batch=num_items_in_batch)
            if not self._loss_scaled_for_window(num_items_in_batch):
                loss = loss / count
            losses.append(loss.detach())
            return loss * count  # the engine averages the window's micro-batches, the trainer sums them

        if not self._calls_model_again():
            self._last_stats = self.engine.train_batch(batch, compute_loss=compute_loss)
        else:  # each micro-batch forward and backward in turn: each unit read once a micro-batch and a pass
            for micro_batch in batch:
                self.engine.backward(compute_loss(micro_batch))
            self._last_stats = self.engine.step()
        return torch.stack(losses).sum().to(self.args.device)

    def _calls_model_again(self) -> bool:
        """Whether the trainer's `compute_loss` may call the model more than once a micro-batch, for
        a reference (DPO's or KTO's with the adapters off, or a frozen reference model) or a KL
        estimate. The engine's vertical schedule (runtime/vertical.py) needs one call: interleaved
        micro-batches would share the adapters' on/off switch and the reference's units."""
        again = {"DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer"}
        return any(c.__name__ in again for c in type(self).__mro__)

    def _loss_scaled_for_window(self, num_items_in_batch: Any) -> bool:
        """As the Trainer decides it: a loss normalized over the whole window (by `num_items_in_batch`,
        or by the user's `compute_loss_func`) is not divided by the window's length again."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)  # type: ignore[attr-defined]
                    or self.compute_loss_func is not None)  # type: ignore[attr-defined]

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        return self._last_stats.get("grad_norm")  # the engine clipped, at args.max_grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self._last_stats.get("grad_norm")

    def _get_learning_rate(self) -> float:
        """The rate of the update just applied, as the plain trainer reads it before its scheduler steps."""
        return float(self._last_stats.get("lr", self.engine.lr))

    # -- checkpoints ------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An HF directory (`from_pretrained` loads it) or, for a peft model, its adapters
        (`PeftModel.from_pretrained` loads them), with the tokenizer or processor beside. Every rank
        calls it (each gathers its shards); rank 0 writes. Inside a checkpoint folder a full model's
        weights are not exported: `checkpoint-N/outcore/` holds them (`outcore export` writes them),
        unless `save_only_model=True`, which leaves the engine's checkpoint out and exports the model."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        adapters = is_peft(self.model)
        if adapters or not _internal_call or self.args.save_only_model:
            self.engine.export(output_dir, adapters_only=adapters)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            if not adapters and _internal_call and not self.args.save_only_model:
                write_checkpoint_readme(self.model, output_dir)
            if self.processing_class is not None:  # type: ignore[attr-defined]
                self.processing_class.save_pretrained(output_dir)  # type: ignore[attr-defined]
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        record = identity(self._run_id, self.state.global_step)  # type: ignore[attr-defined]
        self.engine.save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR),
                                    tag=f"global_step{self.engine.global_step}", client_state={"trainer": record})
        if self.args.should_save:
            write_identity(output_dir, record)

    def _save_scaler(self, output_dir: str) -> None:
        return None  # the engine's checkpoint keeps its loss scale

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Checked here (hf/trainer_checkpoint.py), and loaded once the scheduler is built
        (`_prepare_for_training`); the run goes on under the checkpoint's run id."""
        self._run_id = check_resumable(resume_from_checkpoint)
        self._resume_from = resume_from_checkpoint

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        return None  # in the engine's checkpoint, loaded with it

    def _load_scaler(self, checkpoint: str | None) -> None:
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        log.info("loading the best checkpoint, %s", best)
        self.engine.load_checkpoint(os.path.join(best, CHECKPOINT_SUBDIR))


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


def _with_adapters(model: nn.Module, peft_config: Any, args: Any) -> nn.Module:
    """`model` wrapped by peft as `SFTTrainer` wraps it: after `set_seed(args.seed)`, its adapters
    drawn from the RNG as peft draws them; those that are computed from the base weights
    (PiSSA, OLoRA, DoRA's magnitude) are left to the engine, which reads the weights."""
    import peft

    if is_peft(model):
        raise ValueError("peft_config= with a model peft already wraps: give one of them.")
    transformers.set_seed(args.seed if args is not None else 42)
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
    return type(f"Outcore{cls.__name__}", (OutcoreTrainerMixin, cls),  # type: ignore[return-value]
                {"__module__": __name__, "__qualname__": f"Outcore{cls.__name__}", "__doc__": cls.__doc__})


Trainer: Callable[..., Any] = outcore_trainer(transformers.Trainer)
