"""Measuring the tensor bytes a training step holds, on any device, CPU included: what `vidray.train.plan` predicts
is checked against these measurements (`tests/unit/test_plan.py`, `benchmarks/train_scale.py` figure (d)).

- `TensorBytesTracker`: a `TorchDispatchMode` that counts every storage an op creates (or that it is given, e.g.
  parameters) once, until the storage is freed (a `weakref.finalize` on the storage: torch keeps one Python object
  per live storage), and keeps the peak. This is tensor bytes, what `torch.cuda.max_memory_allocated` reports on a
  GPU minus the caching allocator's rounding; not RSS (which counts the allocator's free lists, the libraries and
  the interpreter).
- `saved_tensor_census`: the tensors autograd saves for backward while a callable runs (one per storage), with the
  op that made each: the listing the planner's per-block activation formulas were derived from.
- `measure_training_step`: the peak of steady-state training steps (forward + backward + AdamW step) of a
  transformer, the way `vidray.train.loop` runs them (fused AdamW, `zero_grad(set_to_none=True)` before the forward,
  autocast around the forward only), single process.

No Ray here; everything runs on CPU in unit tests.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SavedTensor", "StepMeasurement", "TensorBytesTracker", "measure_meta_step", "measure_training_step",
           "saved_tensor_census"]


class TensorBytesTracker(TorchDispatchMode):
    """Live tensor bytes (`current_bytes`) and their maximum (`peak_bytes`) while the mode is active.

    Every tensor an op returns, and every tensor passed to `track`, has its storage counted once (views share it)
    until torch frees the storage. Storages made before the mode started count only once `track`ed or seen as an op
    output (pass parameters, gradients and inputs to `track` first). `reset_peak()` sets the peak to the bytes live
    now. Zero-size and meta tensors count 0 bytes. Not thread-safe beyond what the autograd engine does (CPU backward
    runs on the calling thread).
    """

    def __init__(self, *, count_meta: bool = False) -> None:
        super().__init__()
        self.count_meta = count_meta
        """Count meta tensors at the bytes they would take (`measure_meta_step`); default: 0 bytes."""
        self._live: dict[int, int] = {}  # id(storage) -> nbytes
        self.current_bytes = 0
        self.peak_bytes = 0

    def track(self, *tensors: Any) -> None:
        """Count the storages of `tensors` (any nesting of lists, tuples, dicts; non-tensors are skipped)."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and (self.count_meta or t.device.type != "meta"):
                self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd saved for backward: its size in bytes, dtype, the shape it was saved with, the op
    that made it (`aten` overload name; "input" for a storage made before the census started, such as the block's
    inputs) and whether it is a parameter's."""

    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    made_by: str
    is_parameter: bool


class _Producers(TorchDispatchMode):
    """The op that first made each storage while the mode is on. Every output is held until the mode exits, so no
    address is freed and given to a later storage (which would be named after the earlier, freed one's op)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, str] = {}
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.setdefault(t.untyped_storage().data_ptr(), func.__name__)
                self.held.append(t)
        return out

    def __exit__(self, *exc):
        self.held.clear()
        return super().__exit__(*exc)


def saved_tensor_census(fn: Callable[[], Any], parameters: list[torch.nn.Parameter] = ()) -> list[SavedTensor]:
    """Run `fn()` and list what autograd saves for its backward, one entry per storage (largest first).

    `parameters`: the module's parameters, flagged `is_parameter` (a saved parameter costs no new bytes). The
    result of `fn` is dropped. Used to derive and test `vidray.train.plan`'s per-block activation formulas.
    """
    seen: dict[int, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    held: list[torch.Tensor] = []  # every saved tensor stays alive until the census ends: a storage freed inside
    # fn (a branch whose output fn drops) would otherwise give its address to a later one, counted once for two

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage.nbytes(), t.dtype, tuple(t.shape)))
        held.append(t)
        return t

    with _Producers() as producers, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    params = {p.untyped_storage().data_ptr() for p in parameters}
    census = [SavedTensor(nbytes, dtype, shape, producers.made.get(ptr, "input"), ptr in params)
              for ptr, (nbytes, dtype, shape) in seen.items()]
    held.clear()
    return sorted(census, key=lambda s: -s.nbytes)


@dataclass
class StepMeasurement:
    """Tensor bytes of training steps measured by `measure_training_step`, all in bytes."""

    peak_bytes: int
    """Peak live tensor bytes over the measured (steady-state) steps: parameters, gradients, optimizer state,
    activations, inputs and every temporary."""
    parameter_bytes: int
    """Bytes of the model's parameters and buffers (before the steps)."""
    optimizer_bytes: int
    """Bytes of the optimizer's state after the steps (AdamW: exp_avg, exp_avg_sq, step)."""
    trainable_parameters: int
    """Number of parameters with requires_grad (the optimizer's)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Peak bytes within each phase of the last step: `forward`, `backward`, `optimizer`."""


def measure_training_step(
    transformer: torch.nn.Module,
    make_inputs: Callable[[], dict[str, torch.Tensor]],
    *,
    autocast_dtype: torch.dtype | None = None,
    num_steps: int = 2,
) -> StepMeasurement:
    """Peak tensor bytes of `num_steps` training steps of `transformer` on CPU, single process.

    `make_inputs()` returns the transformer's keyword inputs for one micro-batch (e.g. `hidden_states`
    (B, C, F, H, W), `timestep` (B,), `encoder_hidden_states` (B, L, D)); the loss is the mean square of the
    output `sample` (the flow-matching loss's shape; its target is one more tensor the size of the output,
    counted). Each step: `zero_grad(set_to_none=True)`, forward under `torch.autocast("cpu", autocast_dtype)`
    when given, backward outside it, AdamW step (`fused=True`, as `vidray.train.optim.build_optimizer`). The peak
    is taken over the last step only (the first allocates the optimizer state: the steady state starts at step 2).
    Activation checkpointing, LoRA adapters and frozen parameters are whatever `transformer` is set up with.
    Raises ValueError when `num_steps` < 2 (no steady-state step) or nothing is trainable.
    """
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (the first step allocates the optimizer state), got {num_steps}")
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    tracker = TensorBytesTracker()
    phase_peaks: dict[str, int] = {}
    with tracker:
        tracker.track(list(transformer.parameters()), list(transformer.buffers()))
        parameter_bytes = tracker.current_bytes
        for step in range(1, num_steps + 1):
            optimizer.zero_grad(set_to_none=True)
            inputs = make_inputs()
            tracker.track(inputs)
            if step == num_steps:
                tracker.reset_peak()
            start = tracker.peak_bytes
            autocast = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                        else contextlib.nullcontext())
            with autocast:
                model_pred = transformer(**inputs, return_dict=False)[0]
            target = torch.randn_like(model_pred, dtype=torch.float32)
            loss = torch.nn.functional.mse_loss(model_pred.float(), target)
            phase_peaks["forward"] = tracker.peak_bytes
            tracker.reset_peak()
            loss.backward()
            del loss, model_pred, target
            phase_peaks["backward"] = tracker.peak_bytes
            tracker.reset_peak()
            optimizer.step()
            phase_peaks["optimizer"] = tracker.peak_bytes
            del inputs
        peak = max(max(phase_peaks.values()), start)
        optimizer_bytes = sum(t.untyped_storage().nbytes() for state in optimizer.state.values()
                              for t in state.values() if isinstance(t, torch.Tensor))
    return StepMeasurement(peak_bytes=peak, parameter_bytes=parameter_bytes, optimizer_bytes=optimizer_bytes,
                           trainable_parameters=sum(p.numel() for p in trainable), phase_peaks=phase_peaks)


class _FusedAttentionShapes(torch.autograd.Function):
    """`scaled_dot_product_attention` as a fused GPU kernel (flash / memory-efficient) holds it, in shapes only:
    the output, and for the backward q, k, v, the output and a float32 log-sum-exp per query; no (queries x keys)
    matrix. On the meta device torch runs the math kernel, which keeps that matrix (gigabytes at 512x512)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention_shapes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    return _FusedAttentionShapes.apply(query, key, value)


def measure_meta_step(module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(bytes of `module`'s parameters and buffers, peak tensor bytes of one forward and backward) of a module built
    on the meta device: `loss()` runs the forward on meta inputs and returns the loss; `TensorBytesTracker` counts
    every meta storage at the bytes it would take (shapes only: nothing is allocated or computed, so a
    billion-parameter model at a real bucket takes seconds). Attention is held as a fused GPU kernel holds it
    (`_FusedAttentionShapes`: no queries x keys matrix). The peak includes the parameters, the gradients made
    so far and every activation autograd keeps; no optimizer state (none exists yet). What the planner uses for a
    family it has no per-block formulas for (`vidray.train.plan`, AnimateDiff's UNet); on the tiny AnimateDiff UNet
    the plan built on it is ~7 % above `measure_training_step`'s peak (`tests/unit/test_plan.py` allows 15 %)."""
    tracker = TensorBytesTracker(count_meta=True)
    fused = mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _fused_attention_shapes)
    with fused, tracker:
        tracker.track(list(module.parameters()), list(module.buffers()))
        parameter_bytes = tracker.current_bytes
        value = loss()
        value.backward()
        del value
    return parameter_bytes, tracker.peak_bytes
