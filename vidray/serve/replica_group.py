"""A Denoiser replica that spans several GPUs (or, for tests, CPU processes): one torch process group inside the
replica's placement group (issue 47, part 2, serving).

The replica is rank 0. At start it holds a `torch.distributed.TCPStore` on 127.0.0.1 (the ranks share one node: the
deployment's placement group is STRICT_PACK) and starts `world_size - 1` `DenoiserRank` actors, one per other
bundle of its placement group (`PlacementGroupSchedulingStrategy`, bundle i for rank i). Every rank joins one
default process group (NCCL on GPUs, gloo on CPU), loads the transformer as the Denoiser does and readies it with
`vidray.inference.parallel.setup_generation_parallel(...).parallelize(...)`.

The ranks hold no state. Each step the replica sends the running batch's `DenoiseState`s, as they are before the
step, to every rank (`DenoiserRank.step`, started before its own step and awaited after it) and steps them itself;
the ranks compute the same step and throw their latents away, and their collectives (the CFG all-gather, the
context-parallel all-to-alls) pair with the replica's. One step at a time: the replica's step loop is one task, and
each rank actor runs one call at a time (max_concurrency 1), so the collectives of two steps never interleave.

The degrees are fixed when the group starts (`generation_degrees(world_size, cfg_parallel)`): the transformer's
context-parallel hooks cannot change per batch. Every request is correct under either: with CFG parallel a batch
without guidance runs whole on both cfg halves (the same work twice), and without it a guided batch runs both
branches split over the sequence.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vidray.inference.parallel import join_rank, setup_generation_parallel

__all__ = ["DenoiserRank", "ReplicaGroup"]

logger = logging.getLogger("ray.serve")


def _parallel(world_size: int, rank: int, transformer: torch.nn.Module, family_name: str, cfg_parallel: bool,
              device_type: str):
    """This rank's `GenerationParallel` for the group, with `transformer` readied for it."""
    parallel = setup_generation_parallel(world_size, rank, guidance=cfg_parallel, device_type=device_type,
                                         family_name=family_name)
    parallel.parallelize(transformer, family_name)
    return parallel


class DenoiserRank:
    """Rank `rank` (>= 1) of a spanning Denoiser replica: joins the group, loads the transformer as the replica
    does (`load(*load_args, **load_kwargs)`: the Denoiser's `vidray.serve.stages._load`, passed in), and steps
    what the replica sends. Made a Ray actor by `ReplicaGroup.start` (max_concurrency 1)."""

    def __init__(self, rank: int, world_size: int, port: int, backend: str, cfg_parallel: bool,
                 load: Callable[..., Any], load_args: tuple, load_kwargs: dict):
        self.device = join_rank(rank, world_size, port, backend, gpu_index=0, cpu_threads=False)
        model = load(*load_args, **load_kwargs)
        self.family, self.flow = model.family, model.flow
        self.transformer = model.components.transformer.eval()
        self.parallel = _parallel(world_size, rank, self.transformer, model.family.name, cfg_parallel,
                                  self.device.type)

    def ready(self) -> int:
        """This actor's process id, once it has joined and loaded."""
        return os.getpid()

    def step(self, states: list) -> None:
        """Step a copy of the replica's batch `states` (`vidray.inference.sampler.step_states`) for the
        collectives; the result stays here."""
        from vidray.inference.sampler import step_states  # heavy: diffusers

        with torch.inference_mode():
            step_states(self.family, self.transformer, states, num_train_timesteps=self.flow.num_train_timesteps,
                        parallel=self.parallel)


class ReplicaGroup:
    """The replica's side: rank 0 of `world_size` (`backend` nccl or gloo). `start` joins the group and starts the
    other ranks; `parallel` is rank 0's `GenerationParallel`; `step_remote(states)` sends a step to every other rank
    and returns their refs, to await after the replica's own step."""

    def __init__(self, world_size: int, backend: str, cfg_parallel: bool):
        if world_size < 2:
            raise ValueError(f"a ReplicaGroup needs 2 or more ranks, got {world_size}")
        self.world_size, self.backend, self.cfg_parallel = world_size, backend, cfg_parallel
        self.ranks: list = []
        self.parallel = None

    def start(self, transformer: torch.nn.Module, family_name: str, load: Callable[..., Any], load_args: tuple,
              load_kwargs: dict) -> None:
        """Hold the store on a port the OS picks, start ranks 1.. as actors (in bundles 1.. of this replica's
        placement group when it has one; GPU actors ask for 1 GPU each), join as rank 0, ready `transformer`,
        then wait for every rank to have loaded. Raises the rank's error when one fails to start."""
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
        pg = get_current_placement_group()
        gpu = self.backend == "nccl"
        actor = ray.remote(DenoiserRank)
        for rank in range(1, self.world_size):
            options: dict[str, Any] = {"max_concurrency": 1, "num_cpus": 1, "num_gpus": 1 if gpu else 0}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank)
            self.ranks.append(actor.options(**options).remote(
                rank, self.world_size, store.port, self.backend, self.cfg_parallel, load, load_args, load_kwargs))
        device = join_rank(0, self.world_size, store.port, self.backend, store=store, gpu_index=0, cpu_threads=False)
        self._store = store
        self.parallel = _parallel(self.world_size, 0, transformer, family_name, self.cfg_parallel, device.type)
        pids = ray.get([r.ready.remote() for r in self.ranks])
        logger.info("Denoiser replica spans %d ranks (%s; cfg %d, context %d), rank pids %s", self.world_size,
                    self.backend, self.parallel.cfg, self.parallel.context, pids)

    def step_remote(self, states: list) -> list:
        """Send `states` (as they are now, before the replica's own step) to every other rank; their ObjectRefs."""
        return [r.step.remote(states) for r in self.ranks]
