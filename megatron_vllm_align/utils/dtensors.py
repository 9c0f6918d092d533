"""This rank's part of a tensor that may be a ``torch.distributed.tensor.DTensor`` (an FSDP2-sharded
parameter, its gradient or optimizer state), without importing the distributed tensor package for
plain tensors' callers."""
from __future__ import annotations

import torch


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view, ``to_local``); any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
