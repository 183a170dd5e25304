"""GPU row of issue 47: a Serve Denoiser replica spanning 2 GPUs (`denoiser.gpus: 2`, NCCL), for a lent machine
with 2+ GPUs (`tests/gpu/run.sh` runs it after `parallel_rows.py`).

`python tests/gpu/serve_parallel_rows.py`: the tiny random Wan model, exported as a run exports it, served by the
shipped app (`serve/serve_config.yaml`, `vidray.serve.app:build_app`) on a local Ray cluster bound to 127.0.0.1,
its Denoiser replica a STRICT_PACK placement group of 2 bundles {GPU: 1, CPU: 1} (rank 1 a `DenoiserRank` actor in
the second), once per split:
- `serve_2gpu_cfg_parallel_psnr_db`: `denoiser: {gpus: 2}` (CFG parallel: one guidance branch a GPU);
- `serve_2gpu_context_parallel_psnr_db`: `denoiser: {gpus: 2, cfg_parallel: false}` (both branches, each GPU
  half of the sequence: context degree 2, Ulysses over NCCL).
Each serves one guided request through the Videos API (`POST /v1/videos`, poll, `GET .../content`, lossless mp4)
and compares it with the video one-GPU `vidray generate` makes with the same seed (goal >= 40 dB). The replica's
`stats()` must report the split (`ranks` 2 and the expected `cfg_parallel` x `context_parallel`): a figure whose
replica reports another is a miss naming it. The start-up memory check (`check_generation_fits` with the replica's
cfg and context degrees) runs in each replica before it loads; a replica it refused fails its deploy, a miss here.

With fewer than 2 GPUs visible (the single-GPU kinds lent so far, or CPU) every figure is a miss saying so and the
script exits 0; `tests/unit/test_gpu_rows.py` runs that path on CPU. The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks._figures import miss  # noqa: E402

SPLITS = {
    "serve_2gpu_cfg_parallel_psnr_db": ({"gpus": 2}, (2, 1)),
    "serve_2gpu_context_parallel_psnr_db": ({"gpus": 2, "cfg_parallel": False}, (1, 2)),
}
"""{figure: (the serve config's `denoiser` section, the (cfg_parallel, context_parallel) its replica must report)}"""

GUIDANCE, SEED, STEPS, PROMPT = 4.0, 7, 4, "a red ball bouncing"
GOAL = ">= 40"


def visible_gpus() -> int:
    """CUDA devices torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skipped(gpus: int) -> dict[str, Any]:
    """The row's JSON object when there are fewer than 2 GPUs: every figure a miss saying why."""
    why = f"needs 2 GPUs for a Denoiser replica spanning 2 (denoiser.gpus: 2); this machine has {gpus}"
    return {"benchmark": "gpu_serve_parallel_rows",
            "figures": {name: miss(why, unit="dB", goal=GOAL) for name in SPLITS}, "details": {"gpus": gpus}}


def _deploy(folder: Path, store: Path, port: int, denoiser: dict[str, Any], timeout_s: float = 240.0) -> float:
    """Deploy the shipped app on `folder` with `denoiser` as its `denoiser:` section, HTTP on 127.0.0.1:`port`;
    seconds until RUNNING. Raises RuntimeError / TimeoutError (with Serve's message) when it does not get there."""
    import yaml
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "serve/serve_config.yaml").read_text())
    config["http_options"].update(host="127.0.0.1", port=port)
    app = config["applications"][0]
    num_frames, height, width = _bucket()
    app["args"].update(model_path=str(folder), store_dir=str(store), default_num_inference_steps=STEPS, crf=0,
                       denoiser=denoiser, auth={"token_env": "VIDRAY_API_TOKEN"},
                       limits={**app["args"]["limits"], "max_num_frames": num_frames, "max_height": height,
                               "max_width": width})
    for deployment in app["deployments"]:
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = 1
        # the spanning Denoiser's options must fit one bundle {GPU: 1, CPU: 1}; the other stages stay on the CPU
        deployment["ray_actor_options"] = ({"num_gpus": 1, "num_cpus": 1} if deployment["name"] == "Denoiser" else
                                           {"num_cpus": 0.1, "num_gpus": 0})
    start = time.perf_counter()
    client = serve_api.serve_start(http_options=config["http_options"], proxy_location=config["proxy_location"])
    client.deploy_apps(ServeDeploySchema.model_validate(config), _blocking=False)
    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications.get(app["name"])) is None or status.status != "RUNNING":
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"Serve app {status.status}: {' '.join(str(status.message).split())[:300]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve app not RUNNING after {timeout_s:.0f} s ({None if status is None else status})")
        time.sleep(0.5)
    return time.perf_counter() - start


def _bucket() -> tuple[int, int, int]:
    from benchmarks.context_parallel import GENERATE_BUCKET

    return tuple(GENERATE_BUCKET)


def _render(port: int) -> bytes:
    """One guided request through the Videos API; its mp4's bytes. Raises RuntimeError / TimeoutError."""
    from ray_rows import render_video  # tests/gpu: the script's own folder is on sys.path

    num_frames, height, width = _bucket()
    return render_video(f"http://127.0.0.1:{port}", {"prompt": PROMPT, "size": f"{width}x{height}",
                                                     "num_frames": num_frames, "seed": SEED,
                                                     "num_inference_steps": STEPS, "guidance_scale": GUIDANCE})


def measure(tmp: Path) -> dict[str, Any]:
    """The row on a machine with 2+ GPUs (module docstring)."""
    import ray
    import torch
    from ray import serve

    from benchmarks.context_parallel import _psnr, _wan_folder
    from ray_rows import TOKEN, _free_port
    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file

    os.environ["VIDRAY_API_TOKEN"] = TOKEN  # the token ray_rows._request sends
    folder = _wan_folder(tmp)
    num_frames, height, width = _bucket()
    reference = generate_to_file(folder, PROMPT, tmp / "one_gpu.mp4", bucket=f"{num_frames}x{height}x{width}",
                                 num_inference_steps=STEPS, guidance_scale=GUIDANCE, seed=SEED, fps=8.0, crf=0)
    one_gpu = decode_mp4(reference.read_bytes())
    torch.cuda.empty_cache()
    ray.init(num_gpus=visible_gpus(), include_dashboard=False)
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": visible_gpus()}
    try:
        for name, (denoiser, degrees) in SPLITS.items():
            port = _free_port()
            try:
                deploy_s = _deploy(folder, tmp / f"store-{name}", port, denoiser)
                start = time.perf_counter()
                served = decode_mp4(_render(port))
                render_s = time.perf_counter() - start
                stats = serve.get_deployment_handle("Denoiser", "vidray").stats.remote().result()
                split = (stats["cfg_parallel"], stats["context_parallel"])
                details[name] = {"deploy_s": deploy_s, "render_s": render_s, "ranks": stats["ranks"],
                                 "cfg_parallel": split[0], "context_parallel": split[1]}
                if stats["ranks"] != 2 or split != degrees:
                    figures[name] = miss(f"the replica reports ranks {stats['ranks']}, cfg x context {split}; "
                                         f"expected 2 and {degrees}", unit="dB", goal=GOAL)
                else:
                    figures[name] = {"value": _psnr(served, one_gpu), "unit": "dB", "goal": GOAL}
            except Exception as err:  # one split's failure is its figure's miss; the other still runs
                figures[name] = miss(f"{type(err).__name__}: {err}"[:300], unit="dB", goal=GOAL)
                details[f"{name}_traceback"] = traceback.format_exc()[-3000:]
            finally:
                serve.shutdown()
    finally:
        ray.shutdown()
    return {"benchmark": "gpu_serve_parallel_rows", "figures": figures, "details": details}


def main() -> dict[str, Any]:
    gpus = visible_gpus()
    if gpus < 2:
        out = skipped(gpus)
    else:
        from vidray.runtime import apply_ray_env_defaults

        apply_ray_env_defaults()  # before `import ray`: every listener on 127.0.0.1
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # ray_rows, when imported rather than run
        with tempfile.TemporaryDirectory(prefix="vidray-gpu-serve-parallel-") as tmp:
            out = measure(Path(tmp))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
