"""Generation over several processes, one per GPU (`vidray generate --gpus N`): classifier-free guidance (CFG)
parallel, and context parallel for the rest (issue 47, part 2).

With guidance the sampler runs the transformer on two branches, the unconditional (negative prompt) and the
conditional one, and mixes the two predictions: `uncond + guidance_scale * (cond - uncond)`. Under CFG parallel
(`cfg` 2) the ranks of a "cfg" pair each run one branch (cfg rank 0 the unconditional, 1 the conditional), so each
GPU holds a batch of B, not 2B, and the two predictions are all-gathered before the formula; every rank then takes
the same sampler step, so the latents stay identical everywhere (the initial noise is drawn from one seeded CPU
generator on every rank already). diffusers has no CFG parallel (a TODO in its `_modeling_parallel.py`); xDiT's
"CFG parallel" is the same split.

The ranks left over, `world_size / cfg`, split each branch's sequence (context parallel, Ulysses, over the mesh's
"ring" and "ulysses" dimensions: `GenerationParallel.parallelize` calls
`vidray.models.context_parallel.enable_context_parallel` on the loaded transformer). That needs a family whose card
has `context_parallel`: without it, `generation_parallel_problem` refuses the world size in one line.

The processes: `run_ranks` starts them from a forkserver (never a fork of a process that ran torch ops: a fork
copies locks that another thread holds), with a `torch.distributed.TCPStore` on 127.0.0.1 that the parent holds on a
port the OS picks (no race for a "free" port); each rank joins the default group (NCCL on GPUs, gloo on CPU) and
`setup_generation_parallel` builds the ("cfg", "ring", "ulysses") device mesh.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vidray.cards import get_card
from vidray.errors import UserError

__all__ = ["GenerationParallel", "MESH_DIMS", "generation_degrees",
           "generation_parallel_problem", "join_rank", "run_ranks", "setup_generation_parallel"]

MESH_DIMS = ("cfg", "ring", "ulysses")
"""The generation mesh's dimensions, outer to inner: the guidance branch, then context parallel's ring and Ulysses
groups (the last two as in `vidray.models.context_parallel`'s training mesh, whose outer "dp" plays "cfg"'s part)."""


@dataclass(frozen=True)
class GenerationParallel:
    """Where this process stands among the ranks generating one video: `rank` of `world_size` (the default process
    group), the degrees `cfg` (2: the guidance branches on separate ranks; 1: every rank runs both), `ulysses` and
    `ring` (context parallel: world_size = cfg x ring x ulysses), and the `mesh`
    (`torch.distributed.device_mesh.DeviceMesh` over `MESH_DIMS`). Built by `setup_generation_parallel`; the
    sampler (`vidray.inference.sampler.denoise_step`) takes it as `parallel=`."""

    rank: int
    world_size: int
    cfg: int
    ulysses: int
    ring: int
    mesh: Any

    @property
    def context(self) -> int:
        """The context-parallel degree: ranks that split one branch's sequence."""
        return self.ulysses * self.ring

    @property
    def cfg_rank(self) -> int:
        """Which guidance branch this rank runs under CFG parallel: 0 the unconditional, 1 the conditional."""
        return self.mesh.get_local_rank("cfg")

    @property
    def is_writer(self) -> bool:
        """Whether this rank decodes and writes the result (rank 0 only)."""
        return self.rank == 0

    def parallelize(self, transformer: torch.nn.Module, family_name: str) -> torch.nn.Module:
        """Ready the loaded `transformer` of a `family_name` model for this mesh, in place, and return it: with a
        context degree above 1, context parallel over the mesh's "ring" and "ulysses" dimensions
        (`vidray.models.context_parallel.enable_context_parallel`); nothing under CFG parallel alone."""
        if self.context > 1:
            from vidray.models.context_parallel import enable_context_parallel  # heavy: diffusers' hooks

            enable_context_parallel(transformer, self.mesh, family=family_name)
        return transformer

    def gather_cfg(self, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's branch prediction (B, C, F, H, W) -> (pred_uncond, pred_cond), each (B, C, F, H, W), the same
        on every rank of the "cfg" group (an all-gather over it, in `pred`'s dtype). Raises ValueError when cfg is
        not 2."""
        if self.cfg != 2:
            raise ValueError(f"gather_cfg needs CFG parallel (cfg 2), this rank has cfg {self.cfg}")
        parts = [torch.empty_like(pred) for _ in range(self.cfg)]
        dist.all_gather(parts, pred.contiguous(), group=self.mesh.get_group("cfg"))
        return parts[0], parts[1]


def generation_degrees(world_size: int, guidance: bool) -> tuple[int, int]:
    """(cfg, context) degrees for `world_size` ranks: cfg 2 when `guidance` (guidance_scale > 1) and world_size is
    even, else 1; context = world_size / cfg, the ranks that split the sequence. Raises ValueError for
    world_size < 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cfg = 2 if guidance and world_size % 2 == 0 else 1
    return cfg, world_size // cfg


def generation_parallel_problem(world_size: int, *, guidance: bool, family_name: str, flag: str = "--gpus"
                                ) -> str | None:
    """Why `world_size` ranks cannot generate one video of a `family_name` model (None when they can): more than
    the guidance branches means context parallel, which needs the family card's `context_parallel`. `flag` names
    the option in the message."""
    cfg, context = generation_degrees(world_size, guidance)
    if context == 1:
        return None
    why = (f"{flag} {world_size} without guidance (--guidance-scale 1) splits each video's sequence over "
           f"{world_size} ranks" if not guidance else
           f"{flag} {world_size} with guidance puts the two guidance branches on 2 ranks each split over {context}"
           if cfg == 2 else
           f"{flag} {world_size} is odd, so the two guidance branches cannot each get half of the ranks, and all "
           f"{world_size} would split each video's sequence")
    if not get_card(family_name).context_parallel:
        return (f"{why} (context parallel), which the {family_name} family does not support; use {flag} 2 with "
                "--guidance-scale above 1 (CFG parallel), or 1")
    return None


def setup_generation_parallel(world_size: int, rank: int, *, guidance: bool, device_type: str,
                              family_name: str) -> GenerationParallel:
    """In a rank of an initialized default process group of `world_size`: the ("cfg", "ring", "ulysses") device
    mesh on `device_type` ("cuda" or "cpu") for `generation_degrees(world_size, guidance)` (a context degree all
    Ulysses, ring 1), as this rank's GenerationParallel; its `parallelize` then readies the loaded transformer.
    Raises UserError when the degrees need what a `family_name` model or this build lacks
    (`generation_parallel_problem`)."""
    from torch.distributed.device_mesh import init_device_mesh  # heavy: torch.distributed's tensor package

    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise ValueError(f"setup_generation_parallel needs the default process group of {world_size} ranks")
    cfg, context = generation_degrees(world_size, guidance)
    if context > 1:
        problem = generation_parallel_problem(world_size, guidance=guidance, family_name=family_name)
        if problem:
            raise UserError(problem)
    mesh = init_device_mesh(device_type, (cfg, 1, context), mesh_dim_names=MESH_DIMS)
    return GenerationParallel(rank=rank, world_size=world_size, cfg=cfg, ulysses=context, ring=1, mesh=mesh)


def join_rank(rank: int, world_size: int, port: int, backend: str, *, store: Any = None, gpu_index: int | None = None,
              cpu_threads: bool = True) -> torch.device:
    """Join the default process group of `world_size` ranks through the TCP store on 127.0.0.1:`port` (`store`:
    the caller's own master store, else a client of it), with `backend`: nccl on this rank's GPU, cuda:`gpu_index`
    (None: cuda:`rank`, the ranks `run_ranks` starts on one node; a Ray actor sees its one GPU as 0); gloo on the
    CPU, with os.cpu_count() / world_size torch threads when `cpu_threads`. Returns the rank's device."""
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    if backend == "nccl":
        device = torch.device("cuda", rank if gpu_index is None else gpu_index)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
        return device
    if cpu_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return torch.device("cpu")


def _rank_entry(rank: int, fn: Callable, args: tuple, world_size: int, port: int, backend: str, errors) -> None:
    """One process of `run_ranks`: join, run `fn(rank, device, *args)`, leave. A UserError goes to `errors` (the
    parent raises it as one line) and the process exits 2, which stops the other ranks."""
    try:
        device = join_rank(rank, world_size, port, backend)
        try:
            fn(rank, device, *args)
        finally:
            dist.destroy_process_group()
    except UserError as err:
        errors.put(f"{type(err).__module__}:{type(err).__qualname__}:{err}")
        raise SystemExit(2) from None


def _user_error(record: str) -> UserError:
    """The UserError of `_rank_entry`'s "module:class:message" record: of its own class when that imports and takes
    the message alone (`NonFiniteLatentsError`, `GenerateOutputError`), else a UserError with the message."""
    module, name, message = record.split(":", 2)
    try:
        cls = getattr(importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, UserError):
            return cls(message)
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt: the message is what matters
        pass
    return UserError(message)


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "vidray.inference.sampler", "vidray.generate"]
"""What the forkserver imports once before forking the ranks (their imports cost ~7 s each when spawned)."""


def run_ranks(fn: Callable, args: tuple, world_size: int, backend: str) -> None:
    """Run `fn(rank, device, *args)` in `world_size` fresh processes joined in one default process group
    (`join_rank`; `backend` nccl or gloo) and wait for all. `fn` must be a module-level function and `args`
    picklable. A UserError in any rank is raised here as one UserError with its message (the first rank's to
    fail); any other failure as torch.multiprocessing's ProcessRaisedException / ProcessExitedException with the
    rank's traceback."""
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    errors = multiprocessing.get_context("forkserver").SimpleQueue()
    # The parent holds the store's server, on a port the OS picks: the ranks connect as clients.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(_rank_entry, args=(fn, args, world_size, store.port, backend, errors),
                           nprocs=world_size, start_method="forkserver")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        if not errors.empty():
            raise _user_error(errors.get()) from None
        raise
    finally:
        del store
