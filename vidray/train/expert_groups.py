"""Wan 2.2 A14B's two experts trained in one job as two worker groups (`model.experts` layout groups).

Each Ray Train worker trains one expert: half the workers the high-noise `transformer`, half the low-noise
`transformer_2`. A worker learns its expert from its node's labels (Ray Train assigns ranks by node and GPU, not
in the order of the per-worker label selectors, `vidray.train.trainer.build_trainer_configs`): a rank whose node
matches only one expert's selector takes that expert; the others fill the experts in rank order up to half the
workers each (`vidray.placement.expert_of_ranks`). Each expert's workers then form a data-parallel group of their
own (DDP over a `torch.distributed` subgroup): its gradients are averaged within the group only.

Both groups deal the one sample schedule: each group is a data-parallel world of its own over the same steps
(`group_rank` of `group_size`), so both experts see every sample of an epoch and the data position after a step
is the same on every rank (one position in the checkpoint, exact resume). Each expert draws its training sigmas
on its own side of the boundary (`vidray.models.experts.expert_sigma_range`), as the peers' per-expert runs do
(DiffSynth-Studio's `--min/max_timestep_boundary`, VideoX-Fun's Wan 2.2 scripts), here in one job.

With `scaling.strategy: fsdp` each expert is sharded over its own group (`ExpertGroups.shard_mesh`: the "shard"
dimension of an (expert, shard) mesh), and a pretrained expert builds on the meta device from its own subfolder,
each rank reading that folder's files itself.

The checkpoint is a sharded one (`vidray.train.checkpoint`, DCP): every rank writes its expert's state under
that expert's names (`ExpertSlot`: `transformer.*` / `transformer_2.*`), DCP keeps one copy of what the ranks
of a group hold alike, and the union is the state of `TwoExperts`, which the validator, `vidray generate` and the
export read. Each expert's optimizer state goes under its own key (`optimizer_key`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vidray.models.experts import EXPERTS, expert_sigma_range
from vidray.placement import expert_of_ranks

__all__ = ["ExpertGroups", "form_expert_groups", "full_expert_state", "gather_experts_to_rank0"]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place among the two experts' worker groups.

    expert: "high" or "low", the expert this rank trains. ranks: {expert: its ranks, ascending}. group: this
    expert's process group (DDP's `process_group`). transfer: a gloo group of every rank (the export moves the
    other expert's weights to rank 0 over it). sigma_range: this expert's training sigmas (`expert_sigma_range`).
    """

    rank: int
    expert: str
    ranks: dict[str, list[int]]
    group: Any
    transfer: Any
    sigma_range: tuple[float, float]

    @property
    def group_rank(self) -> int:
        """This rank's index in its expert's group: its data-parallel rank over the schedule."""
        return self.ranks[self.expert].index(self.rank)

    @property
    def group_size(self) -> int:
        """Workers of this rank's expert: the data-parallel world size of its group."""
        return len(self.ranks[self.expert])

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its group's first (the one holding the EMA, as rank 0 does under DDP)."""
        return self.rank == self.ranks[self.expert][0]

    def shard_mesh(self, device_type: str) -> Any:
        """The 1-D `DeviceMesh` of this rank's expert's group, for FSDP within it (`scaling.strategy: fsdp`): the
        "shard" dimension of a 2-D (expert, shard) mesh of the ranks [[high ranks], [low ranks]] (any rank order,
        as `expert_of_ranks` gave them). A collective: every rank calls it at the same point."""
        layout = torch.tensor([self.ranks["high"], self.ranks["low"]])
        return DeviceMesh(device_type, layout, mesh_dim_names=("expert", "shard"))["shard"]

    @property
    def optimizer_key(self) -> str:
        """The sharded checkpoint's key of this expert's optimizer state (each expert's `param_groups` apart)."""
        return f"optimizer_{self.expert}"


def form_expert_groups(rank: int, world_size: int, node_labels: dict[str, str],
                       placement: dict[str, dict[str, str]], boundary_ratio: float) -> ExpertGroups:
    """Agree on every rank's expert and make the process groups (a collective: every rank calls it once, at the
    same point). `node_labels`: this rank's node's labels; `placement`: the resolved {stage: selector}
    (`expert_high`, `expert_low`, `dit`). Raises ValueError as `expert_of_ranks` (on every rank alike)."""
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, dict(node_labels))
    experts = expert_of_ranks(placement, everyone)
    ranks = {expert: [r for r, e in enumerate(experts) if e == expert] for expert in EXPERTS}
    groups = {expert: dist.new_group(ranks=ranks[expert]) for expert in EXPERTS}  # every rank makes both
    transfer = dist.new_group(backend="gloo")
    return ExpertGroups(rank=rank, expert=experts[rank], ranks=ranks, group=groups[experts[rank]], transfer=transfer,
                        sigma_range=expert_sigma_range(experts[rank], boundary_ratio))


def full_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every `DTensor` gathered in full on CPU (`full_tensor`, a collective over its mesh: every rank
    of the expert's group calls it, in the same order); plain tensors as they are. The values may share storage
    with the parameters (a plain tensor, or a group of one rank): copy them before the parameters change."""
    from torch.distributed.tensor import DTensor  # heavy: torch

    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for name, value in state.items()}


def gather_experts_to_rank0(groups: ExpertGroups,
                            state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """The union of the group leaders' `state` ({name: tensor}, names under each expert's prefix) on rank 0, None
    elsewhere (a collective over `groups.transfer`: every rank calls it). Each leader that is not rank 0 sends its
    state to rank 0 (CPU tensors, pickled over gloo: the export's one copy of the other expert); other ranks send
    nothing. `state` is ignored on non-leaders."""
    leaders = sorted(ranks[0] for ranks in groups.ranks.values())
    merged: dict[str, torch.Tensor] = {}
    if groups.rank == 0:
        merged.update(state or {})
        for leader in leaders:
            if leader != 0:
                received: list[Any] = [None]
                dist.recv_object_list(received, src=leader, group=groups.transfer)
                merged.update(received[0])
        return merged
    if groups.rank in leaders:
        cpu = {name: tensor.detach().to("cpu") for name, tensor in (state or {}).items()}
        dist.send_object_list([cpu], dst=0, group=groups.transfer)
    return None
