"""Issue 45 part 5: vidray through Ray on the lent GPU, one process, one JSON line last (`tests/gpu/run.sh`).

Parts (each reports figures or a miss with its reason, `benchmarks/_figures.py`):
- `ray_train`: the tiny job (`jobs/configs/tiny_t2v.yaml`: prepare, then `run_training`, what `vidray train` runs)
  through Ray Train on one worker with `scaling.use_gpu` on CUDA (Ray Train's TorchConfig then makes the process
  group NCCL; `NCCL_DEBUG=INFO` lines in the session's worker logs are counted as the proof) and bf16 mixed
  precision, on a local Ray cluster bound to 127.0.0.1 (`vidray.runtime`). The text encoder is `tiny_random`: the
  lent machine has no MiniLM wheel (an 88 MB package) and needs none to show Train works. Figures: steps/s, the last
  over the first loss, the NCCL log lines; its export (`<run>/diffusers`) is what `ray_serve` serves.
- `ray_serve`: `serve/serve_config.yaml` (the shipped app, `serve.app:build_app`) deployed in the same cluster with
  the run's export, its Denoiser and VaeDecoder given a share of the GPU (`ray_actor_options.num_gpus`), HTTP on
  127.0.0.1; one real request through the Videos API (`POST /v1/videos`, poll, `GET .../content`). Figures: deploy
  time, render time of a 9x64x64 clip, the mp4's bytes, and whether the Denoiser replica's process holds GPU memory
  (`nvidia-smi --query-compute-apps`, matched by the replica actor's PID).

On CPU (`--device cpu`) the same code runs with `use_gpu` off and the GPU shares at 0: `tests/unit/test_ray_pack.py`
runs it from the Ray pack in a clean virtual environment, so that this script cannot rot between GPU loans.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks._figures import miss  # noqa: E402
from tests.integration.serve_configs import serve_config_for  # noqa: E402

TOKEN = "gpu-rows-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_ray_train(args, cuda: bool, tmp: Path) -> dict[str, Any]:
    from vidray.config import load_job_config
    from vidray.data.ingest import prepare_data
    from vidray.train.trainer import run_training

    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.source={REPO / 'samples/metadata.json'}", f"data.shards_dir={tmp}/shards", f"storage.path={tmp}/runs",
        f"scaling.use_gpu={str(cuda).lower()}", "scaling.num_workers=1", "model.text_encoder=tiny_random",
        f"train.max_steps={args.steps}", f"train.log_every_steps={args.steps}", f"checkpoint.every_steps={args.steps}",
        *(["train.mixed_precision=bf16"] if cuda else [])])
    prepare_data(job.data, job.model, progress=None)
    result = run_training(job)
    losses = [loss for _, loss in result.losses]
    logs = glob.glob("/tmp/ray/session_latest/logs/*worker*")
    nccl_lines = sum(Path(f).read_text(errors="replace").count("NCCL INFO") for f in logs)
    figures = {
        "ray_train_steps_per_s": {"value": result.steps_per_s, "unit": "1/s"},
        "ray_train_loss_last_over_first": {"value": losses[-1] / losses[0], "unit": "ratio"},
        "ray_train_nccl_log_lines": ({"value": nccl_lines, "unit": "lines", "goal": "> 0"} if cuda else
                                     miss("no CUDA: Ray Train's process group is gloo on CPU", unit="lines",
                                          goal="> 0")),
    }
    return {"figures": figures, "export": result.diffusers_dir,
            "details": {"ray_train": {"steps": len(losses), "losses": losses, "run_dir": str(result.run_dir)}}}


def _request(method: str, url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {TOKEN}",
                                                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def render_video(base: str, body: dict[str, Any], timeout_s: float = 240.0) -> bytes:
    """POST `body` to `base`/v1/videos, poll the video until it is completed, and return its mp4's bytes. Raises
    RuntimeError (an answer other than 200, a failed video, content that is not an mp4) or TimeoutError (still
    queued or in progress after `timeout_s`)."""
    code, answer = _request("POST", f"{base}/v1/videos", body)
    if code != 200:
        raise RuntimeError(f"POST /v1/videos answered {code}: {answer[:300]!r}")
    video = json.loads(answer)
    deadline = time.monotonic() + timeout_s
    while video["status"] not in ("completed", "failed"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"video {video['id']} still {video['status']} after {timeout_s:.0f} s")
        time.sleep(0.2)
        video = json.loads(_request("GET", f"{base}/v1/videos/{video['id']}")[1])
    if video["status"] != "completed":
        raise RuntimeError(f"video {video['id']} failed: {video.get('error')}")
    code, mp4 = _request("GET", f"{base}/v1/videos/{video['id']}/content")
    if code != 200 or mp4[4:8] != b"ftyp":
        raise RuntimeError(f"GET .../content answered {code} with {mp4[:32]!r}, not an mp4")
    return mp4


def _gpu_pids() -> dict[int, float]:
    """{pid: MiB of GPU memory} of the processes nvidia-smi lists on the GPU ({} without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(p): float(m) for p, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}


def part_ray_serve(args, cuda: bool, tmp: Path, export: str) -> dict[str, Any]:
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema
    from ray.util.state import list_actors

    config = serve_config_for(export, tmp / "store", one_replica=True, default_num_inference_steps=args.serve_steps,
                              auth={"token_env": "VIDRAY_API_TOKEN"})
    port = _free_port()
    config["http_options"].update(host="127.0.0.1", port=port)
    app = config["applications"][0]
    gpu_share = {"Denoiser": 0.5, "VaeDecoder": 0.25}
    for deployment in app["deployments"]:
        deployment["ray_actor_options"]["num_gpus"] = gpu_share.get(deployment["name"], 0) if cuda else 0
    t0 = time.perf_counter()
    client = serve_api.serve_start(http_options=config["http_options"], proxy_location=config["proxy_location"])
    client.deploy_apps(ServeDeploySchema.model_validate(config), _blocking=False)
    deadline = time.monotonic() + args.deploy_timeout_s  # Serve's own blocking deploy gives up after 60 s
    while (status := serve.status().applications.get(app["name"])) is None or status.status != "RUNNING":
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"Serve app {status.status}: {' '.join(str(status.message).split())[:300]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve app not RUNNING after {args.deploy_timeout_s:.0f} s "
                               f"({None if status is None else status.status})")
        time.sleep(0.5)
    deploy_s = time.perf_counter() - t0
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    mp4 = render_video(base, {"prompt": "a red ball rolls", "size": "64x64", "num_frames": 9, "seed": 1})
    render_s = time.perf_counter() - t0
    denoisers = [a["pid"] for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
                 if "Denoiser" in a["class_name"]]
    on_gpu = _gpu_pids()
    figures = {"ray_serve_deploy_s": {"value": deploy_s, "unit": "s"},
               "ray_serve_render_s": {"value": render_s, "unit": "s"},
               "ray_serve_mp4_bytes": {"value": len(mp4), "unit": "B", "goal": "> 0"}}
    if cuda:
        figures["ray_serve_denoiser_gpu_mib"] = {"value": sum(on_gpu.get(p, 0.0) for p in denoisers), "unit": "MiB",
                                                 "goal": "> 0"}
    else:
        figures["ray_serve_denoiser_gpu_mib"] = miss("no CUDA: the Denoiser replica runs on the CPU", unit="MiB",
                                                     goal="> 0")
    return {"figures": figures, "details": {"ray_serve": {"denoiser_pids": denoisers}}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees one)")
    ap.add_argument("--steps", type=int, default=4, help="training steps of the tiny job")
    ap.add_argument("--serve-steps", type=int, default=4, help="denoising steps of the served request")
    ap.add_argument("--deploy-timeout-s", type=float, default=240.0, help="longest wait for the Serve app, s")
    args = ap.parse_args(argv)
    os.environ.setdefault("VIDRAY_API_TOKEN", TOKEN)
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    from vidray.runtime import apply_ray_env_defaults

    apply_ray_env_defaults()  # before `import ray`: every listener on 127.0.0.1
    import torch

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    try:
        import ray

        details["ray"] = ray.__version__
    except ImportError as err:
        reason = f"ray is not installed here ({err}): bash tests/gpu/run.sh --fetch-wheels builds the Ray pack"
        figures = {name: miss(reason, unit=unit) for name, unit in [
            ("ray_train_steps_per_s", "1/s"), ("ray_serve_render_s", "s")]}
        out = {"benchmark": "gpu_ray", "figures": figures, "details": details}
        print(json.dumps(out), flush=True)
        return out
    with tempfile.TemporaryDirectory(prefix="vidray-gpu-ray-") as tmp:
        export = None
        for name in ("ray_train", "ray_serve"):
            start = time.perf_counter()
            try:
                if name == "ray_train":
                    result = part_ray_train(args, cuda, Path(tmp))
                    export = result.pop("export")
                elif export is None:
                    result = {"figures": {"ray_serve_render_s": miss("ray_train left no export to serve", unit="s")}}
                else:
                    result = part_ray_serve(args, cuda, Path(tmp), export)
            except Exception as err:  # one part's failure is its figures' miss; the other still runs
                result = {"figures": {f"{name}_part": miss(f"{type(err).__name__}: {err}"[:300], unit="s")},
                          "details": {f"{name}_traceback": traceback.format_exc()[-3000:]}}
            figures.update(result["figures"])
            details.update(result.get("details", {}))
            details[f"{name}_wall_s"] = time.perf_counter() - start
        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 - Serve never started
            pass
        ray.shutdown()
    out = {"benchmark": "gpu_ray", "figures": figures, "details": details}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
