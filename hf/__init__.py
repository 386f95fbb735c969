"""outcore's Hugging Face wing: what the engine needs to know of transformers and peft models
(runtime/model_family.py asks, hf/model_family.py answers), fine-tuning data as SFT tools read it
(`sft_dataset`), and the Trainer integration.

    from outcore.hf import outcore_trainer
    SFTTrainer = outcore_trainer(trl.SFTTrainer)

Names load on first use, so that importing `outcore.hf` imports neither torch nor transformers.
"""

from typing import TYPE_CHECKING

from outcore.offload.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from outcore.hf.quantization import quantized_config as quantized_config
    from outcore.hf.sft_data import sft_dataset as sft_dataset
    from outcore.hf.trainer import Trainer as Trainer
    from outcore.hf.trainer import outcore_trainer as outcore_trainer

_EXPORTS = {
    "quantized_config": "outcore.hf.quantization",
    "sft_dataset": "outcore.hf.sft_data",
    "outcore_trainer": "outcore.hf.trainer",
    "Trainer": "outcore.hf.trainer",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
