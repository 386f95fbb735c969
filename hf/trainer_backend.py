"""What a Trainer's backend owns, done by outcore's engine: the class `outcore_trainer` puts under
the trainer it extends, right above `transformers.Trainer`, so that what a subclass wraps around
these methods (TRL's `training_step` counts generations and times steps; GRPO's
`_load_optimizer_and_scheduler` restores its entropy control) wraps the engine's version.

- the model stays where the engine puts it: no device move, no DDP;
- the optimizer and LR scheduler are the engine's, which steps the scheduler after each update;
- the step: the micro-batches the trainer gathers for one optimizer step run as one
  `engine.train_batch` (each unit read once for all of them), each through the trainer's own
  `compute_loss`, scaled as the trainer scales it;
- checkpoints: `checkpoint-N/outcore/` holds the engine's sharded checkpoint beside the trainer's
  state and RNG files; `save_model` exports an HF directory, or peft adapters.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers
from torch import nn

from outcore.hf.model_info import is_peft
from outcore.hf.trainer_checkpoint import (
    CHECKPOINT_SUBDIR,
    check_resumable,
    identity,
    write_checkpoint_readme,
    write_identity,
)
from outcore.runtime.engine import Engine

log = logging.getLogger(__name__)


class SteppedByEngine:
    """The trainer's view of the LR scheduler the engine steps: the trainer's own `step()` after
    each update does nothing (the engine stepped it already, after the update it applied)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def step(self, *_: Any, **__: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, load_state_dict, ...
        return getattr(self.scheduler, name)


class EngineBackend(transformers.Trainer):
    """The Trainer methods the engine answers (see the module's docstring). The attributes are set
    by `OutcoreTrainerMixin.__init__` (hf/trainer.py)."""

    engine: Engine
    model: nn.Module  # the peft or HF model the engine pages, set before the Trainer's __init__ runs
    lr_scheduler: Any  # SteppedByEngine
    _resume_from: str | None
    _run_id: str
    _last_stats: dict[str, Any]
    _pending: list[dict[str, Any]]

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
            base = super().create_scheduler
            self.lr_scheduler = None

            def build(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
                return base(num_training_steps, optimizer=opt)

            self.engine.use_lr_scheduler(build)
        assert self.engine.lr_scheduler is not None
        self.lr_scheduler = SteppedByEngine(self.engine.lr_scheduler)
        return self.lr_scheduler

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        if self._resume_from is not None:  # after the scheduler exists, so that its state comes back too
            self.engine.load_checkpoint(os.path.join(self._resume_from, CHECKPOINT_SUBDIR))
            self._resume_from = None
        self.model_wrapped = self.model
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    # -- the step ---------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Gather the window's micro-batches; at its last, run them as one `engine.train_batch`.
        The losses are returned at the window's end (zero before): what the trainer sums for its
        log is the same."""
        self.model.train()
        self._pending.append(self._prepare_inputs(inputs))
        count = self.current_gradient_accumulation_steps
        if len(self._pending) < count:
            return torch.zeros((), device=self.args.device)
        batch, self._pending = self._pending, []
        losses: list[torch.Tensor] = []

        def compute_loss(micro_batch: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, micro_batch, num_items_in_batch=num_items_in_batch)
            assert isinstance(loss, torch.Tensor)  # asked without return_outputs
            if not self._loss_scaled_for_window(num_items_in_batch):
                loss = loss / count
            losses.append(loss.detach())
            return loss * count  # the engine averages the window's micro-batches, the trainer sums them

        if not self._calls_model_again():
            self._last_stats = self.engine.train_batch(batch, compute_loss=compute_loss)
        else:  # each micro-batch forward and backward in turn: each unit read once a micro-batch and a pass
            for micro_batch in batch:
                with self.engine.activations.forward():  # the model is called directly: paged as engine(...) pages
                    loss = compute_loss(micro_batch)
                self.engine.backward(loss)
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
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

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
        assert output_dir is not None  # TrainingArguments sets a default
        adapters = is_peft(self.model)
        if adapters or not _internal_call or self.args.save_only_model:
            self.engine.export(output_dir, adapters_only=adapters)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            if not adapters and _internal_call and not self.args.save_only_model:
                write_checkpoint_readme(self.model, output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        record = identity(self._run_id, self.state.global_step)
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
        best = self.state.best_model_checkpoint
        assert best is not None  # the Trainer calls this only with one
        log.info("loading the best checkpoint, %s", best)
        self.engine.load_checkpoint(os.path.join(best, CHECKPOINT_SUBDIR))
