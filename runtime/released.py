"""What a module's parameter attribute holds while its unit is released (ZeRO-3).

A gathered unit's parameters are views of its flat buffer. When the unit is released, that
buffer's memory goes back to the store (or is freed), and a view left on the module would point
at nothing: reading it would crash the process or return another key's bytes. So every release
puts a `ReleasedParameter` in its place: a tensor with the parameter's shape, dtype and device
and no memory (a meta tensor underneath), which answers questions about its shape and raises
`ReleasedParameterError`, naming the parameter and what to do, for anything that would read its
values. FSDP's sharded parameters play the same part; here the shard may be on NVMe, so there is
nothing to hand out in its place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class ReleasedParameterError(RuntimeError):
    """Something read the values of a parameter whose unit is released."""


# What a released parameter still answers: its metadata, never its values.
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,  # type: ignore[attr-defined]
    torch.Tensor.element_size, torch.Tensor.is_floating_point,
}
_DEVICE = torch.Tensor.device.__get__


class ReleasedParameter(torch.Tensor):
    """Stands on a module in place of parameter `name` of unit `unit` while that unit is released."""

    param_name: str
    unit_name: str
    home_device: torch.device
    engine_closed: bool  # set by Engine.close(): the values are gone, not just elsewhere

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, requires_grad: bool, device: torch.device,
                name: str, unit: str) -> ReleasedParameter:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"), requires_grad)
        t.param_name, t.unit_name, t.home_device = name, unit, device
        t.engine_closed = False
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func == _DEVICE:  # where the values are while the unit runs (`x.to(p.device)` keeps working)
            return args[0].home_device
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs or {}))
        released = next(t for t in leaves if isinstance(t, ReleasedParameter))
        if released.engine_closed:
            raise ReleasedParameterError(
                f"{released.param_name} was read after the engine holding it was closed: its values went with "
                "the engine's store. Read trained weights before close() (engine.full_state_dict(), "
                "engine.export(path)), or load a checkpoint or an export into a model built anew.")
        raise ReleasedParameterError(
            f"{released.param_name} was read while its unit ({released.unit_name}) is released: under ZeRO-3 "
            "a unit's parameters exist only while its module runs. Between steps, read the weights with "
            "engine.full_state_dict(). Inside forward, a module that reads another module's weight directly "
            "(say `x @ self.emb.weight.T`) must own it: tie it by registration (`head.weight = emb.weight`), or "
            "name the block classes in Config.unit_classes, which keeps the other modules in the root unit.")
