"""Training block swap (`memory.block_swap: N`): the last N blocks of a LoRA run's frozen base live in pinned host
memory and are copied to the GPU one block ahead, host-to-device only (musubi-tuner's `blocks_to_swap`).

```python
swap = apply_block_swap(transformer, family.block_lists(transformer), 20, torch.device("cuda:0"))
# then activation checkpointing (`train.activation_checkpointing: full`), DDP, the optimizer, as always
```

How it works, per block list (one per expert):
- Each swapped block's frozen parameters (`requires_grad` False, not a peft adapter) are kept in host memory (pinned
  on CUDA); its LoRA adapters, trainable parameters and buffers stay on the device (fp32 masters, small).
- A forward pre-hook on every block makes its own weights resident (waiting on the copy's CUDA event when it was
  prefetched, else copying now) and starts the copy of the next swapped block on a side stream (`record` / `wait`
  events); a forward hook drops the block's device copy (its parameters point at the host copy again: frozen, so
  nothing is copied back).
- The backward needs the weights again (the gradient of a LoRA layer's input goes through W). With activation
  checkpointing (required: `train.activation_checkpointing: full`, checked at config time) each block's forward is
  recomputed in the backward, so the same pre-hook brings its weights back, and prefetches the block before it
  (the backward runs the blocks in reverse: detected with `torch._C._current_graph_task_id()`), and drops the
  block after it, whose backward is done (non-reentrant checkpointing stops a recomputation once it has what the
  backward needs, so the block's own forward hook may not run). Without
  recomputation autograd's saved tensors would keep every block's device copy alive until its backward, so the
  swap would save nothing.

Why own hooks rather than diffusers' `apply_group_offloading(offload_type="block_level", use_stream=True)`: diffusers
0.42.1's group offloading is written for inference (`hooks/group_offloading.py`): its prefetch order is the order
of the first forward, it has no notion of the backward's reverse order or of recomputation, and it offloads a
group's every parameter, so the LoRA adapters (trainable, fp32) would be moved off the device with the base and their
gradients and optimizer state would no longer be on the device; with `use_stream` it also keeps a pinned copy of
everything it moves. These hooks are ~100 lines and leave the adapters alone.

On CPU (tests) the same hooks run with the "device" copy a clone of the host copy (no stream): the losses and
gradients are bitwise those of the unswapped model (`tests/unit/test_block_swap.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from vidray.models.storage import ADAPTER_PATTERN

__all__ = ["BlockSwap", "apply_block_swap"]


class _SwappedBlock:
    """One block's frozen parameters: the host copies and, while resident, the device ones."""

    def __init__(self, block: torch.nn.Module, device: torch.device):
        self.params: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for name, param in block.named_parameters():
            if param.requires_grad or ADAPTER_PATTERN in name:
                param.data = param.data.to(device)
                continue
            host = param.data.to("cpu", copy=True)
            if device.type == "cuda":
                host = host.pin_memory()
            param.data = host
            self.params.append((param, host))
        for module in block.modules():  # buffers (rope tables, ...) are small: resident
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
        self.device_copies: list[torch.Tensor] | None = None
        self.event: Any = None

    def start_copy(self, device: torch.device, stream: Any) -> None:
        """Copy the host weights to `device` (on `stream` with an event when CUDA); no-op when already copied."""
        if self.device_copies is not None:
            return
        if stream is None:
            self.device_copies = [host.to(device, copy=True) for _, host in self.params]
            return
        with torch.cuda.stream(stream):
            self.device_copies = [host.to(device, non_blocking=True) for _, host in self.params]
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def make_resident(self, device: torch.device, stream: Any) -> None:
        """Point the parameters at their device copies (copying now when no prefetch started)."""
        self.start_copy(device, stream)
        if self.event is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(self.event)
            for tensor in self.device_copies:
                tensor.record_stream(current)  # allocated on the side stream, used on this one
            self.event = None
        for (param, _), tensor in zip(self.params, self.device_copies):
            param.data = tensor

    def drop(self) -> None:
        """Point the parameters back at the host copies; the device copies are freed once nothing uses them."""
        for param, host in self.params:
            param.data = host
        self.device_copies = None


class BlockSwap:
    """The hooks of one block list: blocks `first_swapped..len(blocks)-1` swapped (see the module docstring)."""

    def __init__(self, blocks: torch.nn.ModuleList, num_swapped: int, device: torch.device):
        self.device = device
        self.num_blocks = len(blocks)
        self.first_swapped = self.num_blocks - num_swapped
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.swapped = {i: _SwappedBlock(blocks[i], device) for i in range(self.first_swapped, self.num_blocks)}
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(i)))
            if i in self.swapped:
                self.handles.append(block.register_forward_hook(self._post_hook(i)))

    def _pre_hook(self, index: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if index in self.swapped:
                self.swapped[index].make_resident(self.device, self.stream)
            backward = torch._C._current_graph_task_id() != -1  # a recomputation inside the backward
            if backward and index + 1 in self.swapped:
                # The block after this one has finished its backward. Its recomputation may have stopped before
                # its forward hook ran (checkpoint's early stop), so drop its device copy here.
                self.swapped[index + 1].drop()
            ahead = self.swapped.get(index - 1 if backward else index + 1)
            if ahead is not None and self.stream is not None:  # on CPU nothing overlaps: copy when used
                ahead.start_copy(self.device, self.stream)
        return hook

    def _post_hook(self, index: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.swapped[index].drop()
        return hook

    def host_bytes(self) -> int:
        """Bytes of the swapped blocks' weights held in host memory."""
        return sum(host.numel() * host.element_size() for block in self.swapped.values() for _, host in block.params)


def apply_block_swap(transformer: torch.nn.Module, block_lists: list[torch.nn.ModuleList] | None, num_swapped: int,
                     device: torch.device | str) -> list[BlockSwap]:
    """Swap the last `num_swapped` blocks of each of `block_lists` (the family's, `ModelFamily.block_lists`: one per
    expert) of a transformer built in host memory, and move the rest of it to `device`. Call after `apply_lora`
    and `apply_storage_dtype`, before activation checkpointing and DDP. Returns the `BlockSwap` of each list.

    Raises ValueError when the model has no block list, or `num_swapped` is not below its block count (one line
    naming memory.block_swap and the count)."""
    device = torch.device(device)
    if not block_lists:
        raise ValueError(f"memory.block_swap: {num_swapped} needs a transformer with a list of blocks "
                         f"({type(transformer).__name__} has none): use memory.block_swap: 0")
    count = min(len(blocks) for blocks in block_lists)
    if not 0 < num_swapped < count:
        raise ValueError(f"memory.block_swap: {num_swapped} must be in 1..{count - 1}: the model has {count} "
                         "transformer blocks and at least one must stay on the device")
    swapped = {id(blocks[i]) for blocks in block_lists for i in range(len(blocks) - num_swapped, len(blocks))}
    _to_device_except(transformer, swapped, device)
    return [BlockSwap(blocks, num_swapped, device) for blocks in block_lists]


def _to_device_except(module: torch.nn.Module, skip: set[int], device: torch.device) -> None:
    """`module.to(device)` for every submodule but those in `skip` (by id) and their children."""
    for child in module.children():
        if id(child) not in skip:
            _to_device_except(child, skip, device)
    for param in module._parameters.values():
        if param is not None:
            param.data = param.data.to(device)
    for key, buffer in list(module._buffers.items()):
        if buffer is not None:
            module._buffers[key] = buffer.to(device)
