"""A Hugging Face model directory as `outcore train` and `estimate` see it: its config, its own
tokenizer and, optionally, LoRA adapters. Local files only: nothing is looked up on a hub.

The model is built from `config.json` under `deferred_init()` (no weights in memory); the engine
then reads its weight files itself (`Engine(weights=DIR)`).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from outcore.hf.config_sizes import check_sizes
from outcore.hf.declared_quantization import check_declared
from outcore.hf.model_info import parameter_adapters
from outcore.runtime.materialize import deferred_init

log = logging.getLogger(__name__)
_PEFT_DEPRECATION = "`is_gradient_checkpointing` is deprecated"


def is_hf_directory(spec: str) -> bool:
    return os.path.isdir(spec)


@dataclass(frozen=True)
class HFModel:
    directory: str
    lora_rank: int | None = None  # None: full fine-tuning
    lora_alpha: int | None = None  # None: twice the rank
    lora_targets: tuple[str, ...] | None = None  # module names peft matches; None: every linear module
    lora_init: str | None = None  # peft's init_lora_weights; None: its default (A random, B zero)
    dora: bool = False  # peft's use_dora
    vocab_size: int | None = None  # the vocabulary resized to this (tokens added to the tokenizer); None: config's
    # Training packs text for a causal LM; sizing memory (`outcore estimate`) takes any model, built
    # with its LM head where transformers has one (a causal or a sequence-to-sequence LM).
    causal_only: bool = True
    attn_implementation: str | None = None  # transformers' own choice where None
    config_overrides: tuple[tuple[str, Any], ...] = ()  # settings of config.json changed, as from_pretrained(**kw)
    task_class: str | None = None  # the transformers Auto class to build (a trainer's, hf/trainer_model.py)

    def __post_init__(self) -> None:
        if not os.path.exists(os.path.join(self.directory, "config.json")):
            raise ValueError(f"--model {self.directory!r} has no config.json; name a Hugging Face model "
                             "directory (config.json, its weights and the tokenizer's files).")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"--lora {self.lora_rank}: the adapters' rank must be at least 1.")

    def config(self):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.directory, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, huggingface_hub's strict field checks
            if isinstance(e, MemoryError):
                raise
            said = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"--model {self.directory!r}: its config.json does not load ({said[:300]}).") from e
        for key, value in self.config_overrides:
            if not hasattr(config, key):
                raise ValueError(f"model_init_kwargs {key}={value!r}: not a setting of {type(config).__name__} "
                                 f"({self.directory}), nor one outcore takes.")
            setattr(config, key, value)
        check_sizes(config, self.directory)
        check_declared(self.directory, config)
        return config

    def build(self) -> nn.Module:
        """The model, parameters on the meta device, with LoRA adapters when asked for (on the meta
        device too: the engine initializes them as peft would once their weights are read): on the
        modules `lora_targets` names, or every linear module ("all-linear"), but not on bare
        parameters, which the engine cannot page."""
        import peft

        model = self._base()
        if self.lora_rank is None:
            return model
        targets: str | list[str] = list(self.lora_targets) if self.lora_targets else "all-linear"
        self._check_targets(model)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                with deferred_init():  # the adapters too: the engine initializes them as their weights are read
                    tuned = peft.get_peft_model(model, self._lora(targets, model))
            except ValueError as e:
                if not self.lora_targets:
                    raise
                first = str(e).strip().splitlines()[0]
                raise ValueError(f"--lora-targets {','.join(self.lora_targets)}: {first}") from e
        if parameter_adapters(tuned):
            # Under transformers 5, "all-linear" also wraps a mixture of experts' fused experts
            # and router, which are parameters, not linear modules (runtime/units.py refuses them).
            # What peft said of those is moot: the adapters are made again without them.
            modules = sorted(tuned.peft_config["default"].target_modules)
            log.warning("--lora: adapters on %s; the fused experts and router of %s are parameters, not linear "
                        "modules, and get none", ", ".join(modules), self.directory)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                base = self._base()
                with deferred_init():
                    tuned = peft.get_peft_model(base, self._lora(modules, base))
        for w in said:
            if _PEFT_DEPRECATION not in str(w.message):  # peft reads transformers' old name; nothing to act on
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self._check_rank(tuned)
        return tuned

    def _check_rank(self, tuned: nn.Module) -> None:
        """A rank above an adapted layer's smaller dimension adds parameters and no capacity (B·A cannot
        exceed that rank): refused, naming the first such module."""
        for name, module in tuned.named_modules():
            base = getattr(module, "base_layer", None)
            weight = getattr(base, "weight", None)
            if not isinstance(getattr(module, "lora_A", None), nn.ModuleDict) or weight is None or weight.dim() != 2:
                continue
            smaller = min(weight.shape)
            if (self.lora_rank or 0) > smaller:
                inner = name.removeprefix("base_model.model.")
                raise ValueError(f"--lora {self.lora_rank}: above the smaller dimension of {inner} "
                                 f"({weight.shape[0]} x {weight.shape[1]}), where an adapter's rank is at most "
                                 f"{smaller}; give --lora {smaller} or less, or leave {inner.rsplit('.', 1)[-1]} out "
                                 "of --lora-targets.")

    def _check_targets(self, model: nn.Module) -> None:
        """Every name in `lora_targets` names a module: peft adapts what matches and ignores the rest."""
        names = [n for n, _ in model.named_modules() if n]
        missing = [t for t in self.lora_targets or () if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ValueError(f"--lora-targets {','.join(self.lora_targets or ())}: no module of {self.directory!r} is "
                             f"named {', '.join(repr(t) for t in missing)}; its linear modules are named "
                             f"{', '.join(linear)}.")

    def _lora(self, targets: str | list[str], model: nn.Module) -> Any:
        import peft
        from transformers.pytorch_utils import Conv1D

        rank = self.lora_rank or 1
        seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        # GPT-2's projections are Conv1D, their weights stored transposed: peft would set this itself, warning
        transposed = any(isinstance(m, Conv1D) for m in model.modules())
        alpha = self.lora_alpha if self.lora_alpha is not None else 2 * rank
        init: Any = self.lora_init or True  # peft types the names it knows as literals; the flag checked them
        return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                               fan_in_fan_out=transposed, task_type="SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM",
                               init_lora_weights=init, use_dora=self.dora,
                               trainable_token_indices=self._new_token_rows(model))

    def _new_token_rows(self, model: nn.Module) -> dict[str, list[int]] | None:
        """For a resized vocabulary, the new tokens' rows to train beside the adapters: of the input
        embedding, and of the output head unless tied to it (peft then follows the embedding's)."""
        before = getattr(self.config(), "vocab_size", None)
        if self.vocab_size is None or not isinstance(before, int):
            return None
        rows = list(range(before, self.vocab_size))
        names = {m: n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
        embedding = getattr(model, "get_input_embeddings")()  # noqa: B009 - a method mypy sees as a Tensor
        head = getattr(model, "get_output_embeddings")()  # noqa: B009
        ends = [embedding] + ([head] if head is not None and head.weight is not embedding.weight else [])
        return {names[m]: rows for m in ends}

    def _base(self) -> nn.Module:
        import transformers
        from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

        config = self.config()
        kinds = [AutoModelForCausalLM] if self.causal_only else [AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModel]
        if self.task_class is not None:
            kinds = [getattr(transformers, self.task_class)]
        first: ValueError | None = None  # transformers lists every config class it knows, over many lines
        with deferred_init():
            for kind in kinds:
                try:
                    model = kind.from_config(config, **({"attn_implementation": self.attn_implementation}
                                                        if self.attn_implementation else {}))
                except ValueError as e:
                    first = first or e
                    continue
                if self.vocab_size is not None:  # the engine fills the new rows: transformers' mean needs weights
                    model.resize_token_embeddings(self.vocab_size, mean_resizing=False)
                # Absolute: where a checkpoint says the model came from, and the base peft's adapters name
                # (get_peft_model copies it), so they load from any working directory.
                model.name_or_path = os.path.abspath(self.directory)
                return model
        what = f"--model {self.directory!r} is a {config.model_type!r} model ({type(config).__name__}), which"
        if self.task_class is not None:
            raise ValueError(f"{what} transformers builds no {self.task_class} from.") from first
        if self.causal_only:
            raise ValueError(f"{what} transformers builds no causal language model from; the command line "
                             "fine-tunes causal LMs. Other models train through outcore.Engine in Python.") from first
        raise ValueError(f"{what} transformers builds no model from.") from first

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.directory, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--model {self.directory!r}: no tokenizer found in it ({type(e).__name__}); "
                             "save one there with tokenizer.save_pretrained(DIR).") from e


def copy_tokenizer(source: str, out: str) -> bool:
    """The tokenizer (or processor's tokenizer files) saved in `source`, saved again into `out`, as
    `from_pretrained(out)` loads it; False where `source` holds none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError):
        return False
    tokenizer.save_pretrained(out)
    return True
