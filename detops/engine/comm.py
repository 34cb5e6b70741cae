"""torch.distributed helpers that also work in a single process."""
from __future__ import annotations

import os
from typing import Any, List

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def synchronize() -> None:
    if is_dist() and get_world_size() > 1:
        dist.barrier()


def all_gather(obj: Any) -> List[Any]:
    """Every process's `obj` (any picklable object), in rank order."""
    if get_world_size() == 1:
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_mean(values: dict) -> dict:
    """The processes' average of a dict of scalar tensors (for logging)."""
    if get_world_size() == 1:
        return {k: float(v.detach()) for k, v in values.items()}
    keys = sorted(values)
    t = torch.stack([values[k].detach().float().reshape(()) for k in keys])
    dist.all_reduce(t)
    t /= get_world_size()
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def init_distributed(device: str) -> bool:
    """Initialise the default process group when launched by torchrun (WORLD_SIZE > 1):
    NCCL for CUDA devices, gloo otherwise. Returns whether it is distributed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or is_dist():
        return is_dist()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    return True


def shutdown_distributed() -> None:
    """Tear down the default process group, if one was initialised (end of a torchrun job)."""
    if is_dist():
        dist.destroy_process_group()
