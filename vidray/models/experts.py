"""Two denoising experts switched at a timestep boundary, as one transformer (Wan 2.2 A14B: a high-noise expert for
the first steps, a low-noise one for the rest).

`TwoExperts` is what a family hands the sampler, serving's denoiser and `vidray generate` for a two-expert model: a
module called like either expert that routes each sample by its timestep, exactly as diffusers'
`WanPipeline` / `WanImageToVideoPipeline` choose per step (diffusers/pipelines/wan/pipeline_wan_i2v.py, 0.42.1:
`if boundary_timestep is None or t >= boundary_timestep: transformer else transformer_2`, with `boundary_timestep =
boundary_ratio * scheduler.config.num_train_timesteps`). Samples of one batch at different steps (serving's
step-level batching) are split between the experts and put back in order, so each gets what its step would get
alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EXPERTS", "EXPERT_ATTRIBUTES", "ExpertSlot", "TwoExperts", "check_boundary_ratio", "check_expert",
           "expert_sigma_range", "expert_steps", "pick_expert"]

EXPERTS = ("high", "low")
"""The experts' names: "high" is diffusers' `transformer` (timesteps >= the boundary), "low" its `transformer_2`."""

EXPERT_ATTRIBUTES = {"high": "transformer", "low": "transformer_2"}
"""Each expert's attribute in `TwoExperts` (and `ExpertSlot`): its parameters' name prefix in a state dict, as in
the stock pipeline's folders."""


def check_boundary_ratio(boundary_ratio: Any, where: str) -> float:
    """`boundary_ratio` as a float in (0, 1). Raises ValueError naming `where` otherwise (0 or 1 would leave one
    expert every step)."""
    if isinstance(boundary_ratio, bool) or not isinstance(boundary_ratio, (int, float)) or not 0 < boundary_ratio < 1:
        raise ValueError(f"{where}: boundary_ratio must be a number in (0, 1) (the high-noise expert takes timesteps "
                         f">= boundary_ratio x num_train_timesteps; 0.9 for Wan2.2-I2V-A14B), got {boundary_ratio!r}")
    return float(boundary_ratio)


class _ExpertsModule(torch.nn.Module):
    """What the sampler, the step and the stock pipelines read of a transformer, from its first expert: `config`
    (the experts share their layout: in_channels, patch_size, text_dim), `dtype` and `device`."""

    @property
    def first_expert(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def config(self) -> Any:
        return self.first_expert.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.first_expert.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.first_expert.parameters()).device


class TwoExperts(_ExpertsModule):
    """`transformer` (the high-noise expert) for timesteps >= `boundary_timestep`, `transformer_2` (the low-noise
    one) below it; both take the same inputs and give the same output shape.

    Args:
        transformer: the high-noise expert (diffusers' `transformer`).
        transformer_2: the low-noise expert (diffusers' `transformer_2`).
        boundary_ratio: in (0, 1), as the pipeline's config holds it.
        num_train_timesteps: the scheduler's; the boundary is `boundary_ratio * num_train_timesteps` in the units
            of the timesteps the experts are called with.
    Raises ValueError for a boundary_ratio outside (0, 1).
    """

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, *, boundary_ratio: float,
                 num_train_timesteps: int = 1000):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = check_boundary_ratio(boundary_ratio, "TwoExperts")
        self.boundary_timestep = self.boundary_ratio * num_train_timesteps

    @property
    def first_expert(self) -> torch.nn.Module:
        """The high-noise expert (its config, dtype and device are the model's)."""
        return self.transformer

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """(B,) bool: which samples the high-noise expert takes, `timestep >= boundary_timestep`."""
        return timestep >= self.boundary_timestep

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs: Any) -> Any:
        """Call each sample's expert: hidden_states (B, C, F, H, W), timestep (B,); every other tensor keyword
        with a leading batch dimension B (encoder_hidden_states (B, L, D), ...) is split with them. Returns what
        the experts return with `return_dict=False` (a tuple whose first item is (B, C_out, F, H, W)), the samples
        in their order. Raises ValueError unless timestep is (B,)."""
        batch_size = hidden_states.shape[0]
        if timestep.shape != (batch_size,):
            raise ValueError(f"TwoExperts routes by a per-sample timestep ({batch_size},), got {tuple(timestep.shape)}")
        high = self.high_noise(timestep)
        if bool(high.all()):
            return self.transformer(hidden_states=hidden_states, timestep=timestep, **kwargs)
        if not bool(high.any()):
            return self.transformer_2(hidden_states=hidden_states, timestep=timestep, **kwargs)
        outputs = []
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            part = {key: value[rows] if isinstance(value, torch.Tensor) and value.shape[:1] == (batch_size,) else value
                    for key, value in kwargs.items()}
            outputs.append((rows, expert(hidden_states=hidden_states[rows], timestep=timestep[rows], **part)[0]))
        first = outputs[0][1]
        merged = first.new_empty((batch_size, *first.shape[1:]))
        for rows, output in outputs:
            merged[rows] = output
        return (merged,)


def check_expert(expert: str) -> str:
    """`expert` when it is one of `EXPERTS`; else ValueError naming them."""
    if expert not in EXPERTS:
        raise ValueError(f"expert {expert!r}: give one of {', '.join(EXPERTS)}")
    return expert


def pick_expert(transformer: torch.nn.Module, expert: str) -> torch.nn.Module:
    """`transformer.transformer` ("high") or `transformer.transformer_2` ("low") of a `TwoExperts`. Raises
    ValueError for another name, or when `transformer` is not two experts (the model has no `model.experts`)."""
    check_expert(expert)
    if not isinstance(transformer, TwoExperts):
        raise ValueError(f"the {expert}-noise expert was asked for, but this model has one transformer (no "
                         "transformer_2 / model.experts): serve it with one Denoiser")
    return transformer.transformer if expert == "high" else transformer.transformer_2


def expert_steps(timesteps: torch.Tensor, boundary_timestep: float, expert: str) -> tuple[int, int]:
    """[start, end) of the steps of a schedule that `expert` takes, the step i calling the transformer at
    `timesteps[i]` ((N,) float, N = num_inference_steps): the high-noise expert the steps with `timesteps[i] >=
    boundary_timestep` (the stock pipelines' per-step rule, module docstring), the low-noise one the rest. A
    decreasing schedule gives the high-noise expert a prefix: one expert hands the latents to the other once (seed
    004's two-GPU layout). Raises ValueError for another name, or a schedule that crosses the boundary twice."""
    check_expert(expert)
    high = (timesteps >= boundary_timestep).tolist()
    split = high.index(False) if False in high else len(high)
    if any(high[split:]):
        raise ValueError(f"the timesteps {timesteps.tolist()} cross the boundary {boundary_timestep} more than once: "
                         "the experts cannot hand the latents over once")
    return (0, split) if expert == "high" else (split, len(high))


class ExpertSlot(_ExpertsModule):
    """One expert of a `TwoExperts` alone, under the attribute `TwoExperts` gives it (`EXPERT_ATTRIBUTES`): what a
    worker of one expert's group trains (`model.experts` layout groups). Its state dict keys are those of that
    expert in `TwoExperts` (`transformer.*` or `transformer_2.*`), so the two groups' checkpoint parts together are
    the state of `TwoExperts`. Called like the expert (returns what it returns).

    Raises ValueError for an unknown expert name."""

    def __init__(self, transformer: torch.nn.Module, expert: str):
        super().__init__()
        self.expert = check_expert(expert)
        setattr(self, EXPERT_ATTRIBUTES[expert], transformer)

    @property
    def first_expert(self) -> torch.nn.Module:
        """The expert itself."""
        return getattr(self, EXPERT_ATTRIBUTES[self.expert])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.first_expert(*args, **kwargs)


def expert_sigma_range(expert: str, boundary_ratio: float) -> tuple[float, float]:
    """The training sigmas (flow matching, timestep = sigma x num_train_timesteps) of `expert`'s side of the
    boundary: "high" [boundary_ratio, 1], "low" [0, b) with b the float32 just below boundary_ratio, so its
    timesteps stay below `TwoExperts.boundary_timestep` as the sampler routes them. Raises ValueError for another
    name or a ratio outside (0, 1)."""
    check_expert(expert)
    ratio = check_boundary_ratio(boundary_ratio, "expert_sigma_range")
    if expert == "high":
        return ratio, 1.0
    below = torch.nextafter(torch.tensor(ratio, dtype=torch.float32), torch.tensor(0.0, dtype=torch.float32))
    return 0.0, float(below)
