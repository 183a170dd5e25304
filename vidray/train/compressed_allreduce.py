"""`train.grad_compression: int4`: a DDP communication hook that all-reduces each gradient bucket as 4-bit integers.

The two-phase compressed all-reduce of 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed", section 4.1; DeepSpeed's `compressed_allreduce`), with a
4-bit code instead of a sign: each rank

1. splits its bucket into `world_size` equal slices and quantizes them (`quantize_int4`: per chunk of `CHUNK`
   values, a bf16 scale max|x| / 7 and round-to-nearest integers in [-7, 7], two to a byte);
2. sends slice j to rank j (`all_to_all_single`), which dequantizes the `world_size` copies of its slice and takes
   their mean;
3. quantizes that mean again, and every rank gathers every mean slice (`all_gather_single`).

Per rank and bucket of n fp32 values this sends 2 (W-1)/W x n (1/2 + 2/CHUNK) bytes, against 2 (W-1)/W x 4n for
a ring all-reduce: 0.133 of the bytes at any worker count W (`benchmarks/train_scale.py` part (e) measures it).

No error feedback: the hook keeps no state (nothing to checkpoint; a resume at another worker count is exact).
Measured with AdamW on `benchmarks/train_scale.py`'s run (issue 47, tiny model): error feedback made the loss gap
larger (one-phase, chunk 64: 0.011 with, 0.0055 without; two-phase: 0.014 and 0.008; chunk 256: 0.020 and 0.016).
Chunks of 64 rather than 128 (0.015) or 256 (0.016): the scale follows the gradient's local magnitude, at 0.031
bytes a value. On a 512-wide model single runs move by several percent with any change to the gradients, so those
cells do not decide it (docs/training-at-scale.md).

The collectives are synchronous inside the hook (no overlap of one bucket's exchange with the rest of the
backward): every rank issues them in bucket order, over gloo and NCCL alike.

No `from __future__ import annotations` here: DDP's `register_comm_hook` checks the hook's annotations as objects.
"""

import torch
import torch.distributed as dist

__all__ = ["CHUNK", "INT4_WIRE_BYTES_RATIO", "QMAX", "dequantize_int4", "int4_compress_hook", "quantize_int4"]

CHUNK = 64
"""Values sharing one scale."""

INT4_WIRE_BYTES_RATIO = (0.5 + 2 / CHUNK) / 4
"""Bytes the hook sends per rank over a ring all-reduce's, for fp32 gradients: 0.133 (half a byte a value and a
2-byte scale a chunk, against 4 bytes; both send 2 (W-1)/W of their payload)."""

QMAX = 7
"""Largest magnitude of the symmetric 4-bit code (-8 unused, so 0 is exact and the code is symmetric)."""


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) of a 1-D float tensor `x` of n values, n a multiple of `CHUNK`: packed, uint8 (n/2,), two
    4-bit codes q + 8 a byte (q = round(x / scale) in [-7, 7]); scales, bf16 (n / CHUNK,), max |x| / 7 per chunk (0
    for an all-zero chunk). A NaN or inf in a chunk makes its scale NaN or inf, so it survives dequantization (as
    NaN) instead of turning into a finite value. Raises ValueError for another shape."""
    if x.dim() != 1 or x.numel() % CHUNK:
        raise ValueError(f"quantize_int4 takes a 1-D tensor of a multiple of {CHUNK} values, got shape "
                         f"{tuple(x.shape)}")
    chunks = x.float().view(-1, CHUNK)
    scales = (chunks.abs().amax(dim=1, keepdim=True) / QMAX).to(torch.bfloat16)
    divisor = scales.float()
    divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    codes = torch.round(chunks / divisor).clamp_(-QMAX, QMAX).nan_to_num_(0).to(torch.int16).add_(8).view(-1, 2)
    packed = (codes[:, 0] << 4 | codes[:, 1]).to(torch.uint8)
    return packed, scales.view(-1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values (2 x packed.numel(),) of `quantize_int4`'s output (see there for the layouts)."""
    wide = packed.to(torch.int16)
    codes = torch.stack((wide >> 4, wide & 0xF), dim=1).view(-1, CHUNK).float().sub_(8)
    return (codes * scales.float().view(-1, 1)).view(-1)


def int4_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (`DistributedDataParallel.register_comm_hook(process_group, int4_compress_hook)`):
    the mean over `process_group`'s ranks (None: every rank) of `bucket`'s gradients, exchanged as 4-bit codes in
    two phases (module docstring). Returns a completed future of the bucket's buffer, overwritten with the mean in
    its own dtype. Every rank ends with the same values."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    n = buffer.numel()
    per_rank = -(-n // (world * CHUNK)) * CHUNK
    padded = torch.zeros(world * per_rank, dtype=torch.float32, device=buffer.device)
    padded[:n] = buffer
    packed, scales = quantize_int4(padded)
    mine_packed, mine_scales = torch.empty_like(packed), torch.empty_like(scales)
    dist.all_to_all_single(mine_packed, packed, group=group)  # slice j of every rank to rank j
    dist.all_to_all_single(mine_scales, scales, group=group)
    mean = dequantize_int4(mine_packed, mine_scales).view(world, per_rank).mean(dim=0)
    mean_packed, mean_scales = quantize_int4(mean)
    all_packed = torch.empty(world * mean_packed.numel(), dtype=torch.uint8, device=buffer.device)
    all_scales = torch.empty(world * mean_scales.numel(), dtype=torch.bfloat16, device=buffer.device)
    dist.all_gather_single(all_packed, mean_packed, group=group)
    dist.all_gather_single(all_scales, mean_scales, group=group)
    buffer.copy_(dequantize_int4(all_packed, all_scales)[:n])
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
