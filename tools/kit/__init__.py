"""The kits that measure and soak outcore, each a `python -m outcore.tools.kit.NAME` command: the
engine's step against plain PyTorch and its peers, pretrained fine-tuning, generation, the step
prediction against a run, long runs, and the GPU kit."""
