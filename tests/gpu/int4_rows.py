"""GPU row of issue 47 part 4: `train.grad_compression: int4`'s hook over NCCL on the GPU (gloo on CPU).

`python tests/gpu/int4_rows.py` (run by `tests/gpu/run.sh`): one process, a process group of one rank (NCCL on a
GPU, gloo without one, on 127.0.0.1), a DDP model of two linear layers on the device with
`vidray.train.compressed_allreduce.int4_compress_hook`: its codes go through NCCL's all_to_all_single and
all_gather_single (uint8 and bf16) and its quantization runs on the device. Figure `int4_hook_max_error`: the
largest |DDP gradient - the plain backward's| over the largest |gradient|, goal <= 1/7 (two roundings of half a
step, a step being at most the largest |value| / 7: `tests/unit/test_compressed_allreduce.py` checks the same bound
on 2 and 3 CPU processes). The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vidray.train.compressed_allreduce import QMAX, int4_compress_hook  # noqa: E402

GOAL = 1 / QMAX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 64)).to(device)


def measure(device: torch.device) -> dict:
    """{"value", "unit", "goal"} of `int4_hook_max_error` on `device` (module docstring)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1)).to(device)
        plain = _mlp(device)
        plain(x).square().mean().backward()
        model = torch.nn.parallel.DistributedDataParallel(
            _mlp(device), **({"device_ids": [device]} if device.type == "cuda" else {}))
        model.register_comm_hook(None, int4_compress_hook)
        model(x).square().mean().backward()
        error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), plain.parameters()))
        largest = max(q.grad.abs().max().item() for q in plain.parameters())
        del model
    finally:
        dist.destroy_process_group()
    return {"value": error / largest, "unit": "ratio", "goal": f"<= {GOAL:.4f}"}


def main() -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    figure = measure(device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(json.dumps({"benchmark": "gpu_int4_rows", "device": name, "figures": {"int4_hook_max_error": figure}}))


if __name__ == "__main__":
    main()
