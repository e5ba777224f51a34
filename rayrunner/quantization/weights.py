"""How many bytes a model's weights really take, quantized or not.

`numel * element_size` over parameters is wrong twice over: a quantized tensor subclass reports the logical shape
and dtype, not its packed data and scales, and tied weights (embedding / lm_head) would count twice. So walk the
state dict, open tensor subclasses through `__tensor_flatten__`, and count each underlying storage once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the storages behind `model.state_dict()`, each storage counted once."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in model.state_dict().values():
        for plain in _plain_tensors(tensor):
            storage = plain.untyped_storage()
            seen[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The ordinary tensors a (possibly nested) tensor subclass is made of."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        yield tensor
        return
    inner_names, _ = flatten()
    for name in inner_names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)
