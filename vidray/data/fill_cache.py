"""Filling the latent cache ahead of training (`vidray prepare --encode`): every sample of the prepared shards
through the data plane's decode and encode stages once (`encode_to_cache`), with the checks the CLI and `vidray
doctor` run before it (`encode_cache_root`, `check_encode_resources`). A driver-side module above the stages it
runs (`vidray.data.pipeline`, `vidray.data.encode`)."""

from __future__ import annotations

import time
from typing import Any

from vidray.errors import RequestCannotBeMetError, UserError
from vidray.locations import absolute_location
from vidray.placement import alive_nodes, resolve_placement
from vidray.progress import progress_bar
from vidray.runtime import autoscaler_max_resources

__all__ = ["check_encode_resources", "encode_cache_root", "encode_to_cache"]


def encode_cache_root(job: Any) -> str:
    """The latent cache `encode_to_cache` fills for `job` (`data.latent_cache` resolved,
    `vidray.data.outputs.latent_cache_root`). Raises UserError when it is `off`, ConfigError / UserError when it
    cannot be written (`vidray.data.outputs.check_output_location`: a local folder that cannot be created, an
    object store that does not answer or lacks the bucket): checked before anything is prepared or started."""
    from vidray.data.outputs import check_output_location, latent_cache_root  # heavy: pyarrow, numpy, pydantic

    cache = latent_cache_root(job)
    if not cache:
        raise UserError("data.latent_cache is 'off': set it to 'auto' or a folder/URI to fill a latent cache")
    check_output_location("data.latent_cache", cache)
    return cache


def check_encode_resources(job: Any, cluster: dict[str, float], *, autoscaler_max: dict[str, float] | None = None,
                           where: str = "the cluster") -> None:
    """Refuse an `encode_to_cache` run whose one decode + encode pipeline cannot be placed, before it starts (Ray
    Data would wait for the resources forever): it needs data.loader_cpus plus the encode actors' CPUs and GPUs
    (`placement.vae|text.num_cpus|num_gpus`; one actor for both when they match, `encode_operators`).
    `cluster`: the logical resources now; `autoscaler_max`: what the autoscaler could reach, or None.
    Raises vidray.errors.RequestCannotBeMetError naming the numbers and the keys to lower."""
    from vidray.data.pipeline import encode_operators, encode_spec  # heavy: pyarrow, numpy

    operators = encode_operators(encode_spec(job, {}))
    need = {"CPU": float(job.data.loader_cpus) + sum(op["num_cpus"] for op in operators),
            "GPU": sum(op["num_gpus"] for op in operators)}
    for resource, amount in need.items():
        could = max(float(cluster.get(resource, 0)), float((autoscaler_max or {}).get(resource, 0)))
        if amount > could + 1e-9:
            keys = ("data.loader_cpus, placement.vae.num_cpus and placement.text.num_cpus" if resource == "CPU"
                    else "placement.vae.num_gpus and placement.text.num_gpus")
            raise RequestCannotBeMetError(
                f"filling the latent cache needs {amount:g} {resource}{'' if amount == 1 else 's'} (one decode "
                f"operator and its encode actors: {keys}); {where} has {could:g}. Lower {keys}, or run on a "
                "bigger cluster (RAY_ADDRESS)")


def encode_to_cache(job: Any, *, shards_dir: str | None = None, latent_cache: str | None = None) -> dict[str, Any]:
    """Fill the latent cache ahead of training (`vidray prepare --encode`): every sample of the prepared shards
    passes the decode and encode stages once, in the job's buckets and batch sizes, on the nodes `job.placement`
    selects (one decode and one encode pipeline, on the Ray this process is connected to; the caller starts it).

    `shards_dir`, `latent_cache`: default (when None or empty) the job's (`data.shards_dir`, `data.latent_cache`
    resolved by `encode_cache_root`). Returns {"clips": clips seen, "latent_hits", "latent_misses"
    (encoded now), "prompt_hits", "prompt_misses", "skipped": [{sample_id or file, reason}], "seconds", "cache"}.
    Raises vidray.placement.PlacementError for a selector no node satisfies, UserError when the cache is `off`,
    vidray.errors.RequestCannotBeMetError when the connected cluster cannot hold the pipeline
    (`check_encode_resources`).
    """
    from vidray.data.index import load_sample_index  # heavy: pyarrow, numpy
    from vidray.data.pipeline import RankLoader, encode_spec, plan_rank_steps  # heavy: pyarrow, numpy
    from vidray.data.schedule import job_schedule  # heavy: numpy
    from vidray.data.shards import read_index  # heavy: pyarrow, av, PIL
    import ray  # heavy: ray

    from vidray.models.registry import get_family  # heavy: torch, numpy, pydantic

    shards_dir = absolute_location(shards_dir or job.data.shards_dir)
    cache = latent_cache or encode_cache_root(job)
    started = time.perf_counter()
    autoscaler_max = autoscaler_max_resources()
    check_encode_resources(job, ray.cluster_resources(), autoscaler_max=autoscaler_max)
    placement = resolve_placement(job, alive_nodes(), autoscaler=autoscaler_max is not None)
    index = read_index(shards_dir)
    table = load_sample_index(shards_dir)
    schedule = job_schedule(job, table, get_family(job.model.family).for_model(job.model))  # as the loop's
    steps = plan_rank_steps(schedule, schedule.start(0), world_size=1, rank=0, first_step=1,
                            last_step=schedule.steps_per_epoch(1, 1), micro_batches=1)
    loader = RankLoader(shards_dir, index, table, steps, job.data, label_selector=placement.get("decode"),
                        encode=encode_spec(job, placement, latent_cache=cache))
    totals = dict.fromkeys(("latent_hits", "latent_misses", "prompt_hits", "prompt_misses"), 0)
    seen: set[str] = set()
    skipped: list[dict[str, str]] = []

    bar = progress_bar(len(steps), "encode", "batch")  # drawn on a terminal only
    try:
        for batch in loader:
            seen.update(i for i, w in zip(batch.sample_ids, batch.weights) if w > 0)
            skipped.extend(batch.skipped)
            for stage, tier in (("vae", "latent"), ("text", "prompt")):
                totals[f"{tier}_hits"] += int(batch.stats.get(f"{stage}_hits", 0))
                totals[f"{tier}_misses"] += int(batch.stats.get(f"{stage}_misses", 0))
            bar.set_postfix(clips=len(seen), encoded=totals["latent_misses"], cached=totals["latent_hits"],
                            refresh=False)
            bar.update(1)
    finally:
        bar.close()
        loader.close()
    return {"clips": len(seen), **totals, "skipped": skipped, "seconds": time.perf_counter() - started,
            "cache": cache}
