"""The encode stages: the frozen VAE and text encoder as Ray Data actor operators, with the latent cache.

A rank's loader (`vidray.data.pipeline.RankLoader`) chains, per micro-batch:

```
ClipLoader (decode, placement.decode)  frames (B, F, H, W, 3) uint8, captions, clip_sha (sha256 of each mp4)
  -> EncodeStage("vae", placement.vae)   latents (B, C_lat, F_lat, H_lat, W_lat) float32   (frames dropped)
  -> EncodeStage("text", placement.text) prompt_embeds (B, L, D) float32, prompt_attention_mask (B, L) bool
  -> the DiT trainer (placement.dit), which loads neither encoder
```
When `placement.vae` and `placement.text` ask for the same nodes and resources the two run as one operator
(`EncodeStage("vae+text")`: one actor, one model load, one process less per rank).

**Latent cache** (`data.latent_cache`; `LatentCache`). Each clip's latents and each caption's prompt embeddings
are written once, as one safetensors file, under a key that names everything they depend on:

- latents: `vae/<vae identity>/<sha256(clip sha256, bucket)>.safetensors`, the clip's sha256 being that of its
  stored mp4 bytes (a clip replaced under the same name has new bytes, so a new key);
- prompt embeddings: `text/<text encoder identity>-L<max_sequence_length>/<sha256(caption)>.safetensors`;
- identity (`module_identity`): sha256 of the module's class, config and every weight tensor (name, dtype,
  shape, bytes): another VAE, or the same VAE with one weight changed, never reads the old latents, and nobody
  deletes caches by hand.

Later epochs of a run and later runs read the cache instead of encoding. An in-memory LRU of the stage
(`data.hot_bytes`) holds recent entries (the hot tier for latents). Files are written whole
(`vidray.storage.Storage.write_bytes`: temp file + rename locally, one upload on object stores), so a reader
never sees half an entry; two ranks writing the same key write the same bytes.

**Determinism.** Latents are the posterior's mode (`ModelFamily.encode_video`, no sampling) and every clip and
caption is encoded alone (batch of 1), so a clip's latents do not depend on which clips shared its micro-batch:
cached and online training see bit-identical inputs (tests/integration/test_encode_stages.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

import numpy as np

ENCODE_STAT_KEYS = ("vae_s", "vae_hits", "vae_misses", "text_s", "text_hits", "text_misses")
"""Per-micro-batch counters of the encode stages: seconds busy (cache reads + encoding + writes), cache hits (hot
or stored) and misses (encoded here)."""
ENCODE_SPAN_KEYS = ("vae_start_unix", "vae_end_unix", "text_start_unix", "text_end_unix")
"""Wall-clock seconds (`time.time()` on the stage's node) between which each encode stage worked on a micro-batch:
the trainer counts only the part inside its log window (`vidray.metrics.TrainMetrics.add_stage`)."""

CACHE_FORMAT = 1
"""Part of every identity: bump it when the stored layout or the encoding changes."""


def block_rows(block: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The rows of a Ray Data numpy block ({column: (S, ...) array}), each {column: (1, ...) view}."""
    return [{k: v[r:r + 1] for k, v in block.items()} for r in range(len(next(iter(block.values()))))]


def concat_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One numpy block of rows ({column: (n_i, ...) array} each, same columns): {column: (sum n_i, ...)}."""
    return {k: np.concatenate([row[k] for row in rows]) for k in rows[0]}


def module_identity(module: Any, *, extra: str = "") -> str:
    """sha256 hex of a torch module's class, its `config` (diffusers / transformers; JSON) and every
    `state_dict` tensor (name, dtype, shape, bytes), plus `extra` and `CACHE_FORMAT`. Same weights -> same id on
    any machine; one changed weight -> another id. Takes about 1 s per GB of weights on a CPU."""
    import torch  # heavy: torch

    digest = hashlib.sha256(f"vidray-encoder/{CACHE_FORMAT}/{type(module).__name__}/{extra}".encode())
    config = getattr(module, "config", None)
    if config is not None:
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        as_dict = {k: v for k, v in as_dict.items() if not k.startswith("_")}  # _name_or_path, versions
        digest.update(json.dumps(as_dict, sort_keys=True, default=str).encode())
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


class LatentCache:
    """Content-addressed store of encoder outputs under `root` (a local folder or a URI, `vidray.storage`).

    `get(rel)` returns {name: tensor} or None (absent, or unreadable: a damaged entry is a miss and is rewritten);
    `put(rel, tensors)` writes a safetensors file whole. Entry names come from `latents_entry` / `prompt_entry`.
    """

    def __init__(self, root: str):
        from vidray.storage import open_storage  # heavy: pyarrow

        self.root = str(root)
        self.storage = open_storage(root, setting="data.latent_cache")

    @staticmethod
    def latents_entry(vae_id: str, clip_sha256: str, bucket: tuple[int, int, int]) -> str:
        """Relative name of a clip's latents: `vae/<vae_id[:32]>/<ab>/<sha256(clip, bucket)>.safetensors`."""
        key = hashlib.sha256(f"{clip_sha256}|{tuple(int(x) for x in bucket)}".encode()).hexdigest()
        return f"vae/{vae_id[:32]}/{key[:2]}/{key}.safetensors"

    @staticmethod
    def prompt_entry(text_id: str, max_sequence_length: int, caption: str) -> str:
        """Relative name of a caption's prompt embeddings:
        `text/<text_id[:32]>-L<max_sequence_length>/<ab>/<sha256(caption)>.safetensors`."""
        key = hashlib.sha256(caption.encode()).hexdigest()
        return f"text/{text_id[:32]}-L{int(max_sequence_length)}/{key[:2]}/{key}.safetensors"

    def get(self, rel: str, *, as_numpy: bool = False) -> dict[str, Any] | None:
        """{name: torch tensor} of entry `rel` (numpy arrays with `as_numpy`: no torch import, for the decode
        operator), or None."""
        if as_numpy:
            from safetensors.numpy import load  # heavy: safetensors
        else:
            from safetensors.torch import load  # heavy: torch, safetensors

        try:
            return load(self.storage.read_bytes(rel))
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - damaged or half-visible entry: a miss, re-encoded and rewritten
            return None

    def put(self, rel: str, tensors: dict[str, Any]) -> None:
        from safetensors.torch import save  # heavy: torch, safetensors

        self.storage.write_bytes(rel, save({k: v.contiguous() for k, v in tensors.items()}))


class EncodeStage:
    """A Ray Data actor operator running the frozen encoder(s) of one stage on each micro-batch.

    Args:
        what: "vae" (frames -> latents), "text" (captions -> prompt_embeds + mask) or "vae+text".
        model: `ModelConfig.to_dict()` of the job; seed: `train.seed` (random-init encoders are built under it,
            `ModelFamily.build_encoders`).
        max_sequence_length: L of prompt_embeds.
        latent_cache: root of the latent cache (folder or URI), or "" for none.
        hot_bytes: LRU budget of encoder outputs held in memory (0 = none).
        num_gpus: > 0 runs the encoder(s) on this actor's GPU (`cuda`), else on the CPU.
        torch_threads: intra-op threads of the CPU encoders.
        identities: {"vae" | "text": the encoder's `module_identity`, as a str or a one-item list holding the
            ObjectRef of the task computing it (`encoder_identity_refs`)}; a stage missing here is hashed from the
            encoder this actor builds.

    The encoders are built on the first cache miss, not before: a run whose latents and prompt embeddings are all
    cached never imports the family's modules or loads its VAE and text encoder here (the identities name the
    cache entries without them). Built, each encoder is hashed once and must match the identity it was given
    (RuntimeError otherwise: the model's files changed while the run went on).

    `__call__` takes the previous operator's batch of one micro-batch: "vae" needs "frames" (1, B, F, H, W, 3)
    uint8 and "clip_sha" (1,) JSON list of B sha256 hex ("" = not cacheable); "text" needs "captions" (1,) JSON
    list of B str. It returns the batch without "frames" (after "vae"), with "latents" (1, B, C, F_lat, H_lat,
    W_lat) float32 (for an image-to-video model also "inpaint_latents" (1, B, C_in, F_lat, H_lat, W_lat) float32,
    and with `model.i2v.image_encoder` "image_embeds" (1, B, T, D_img) float32, `EncodeStage.latents`) and/or "prompt_embeds" (1, B, L, D) float32 + "prompt_attention_mask" (1, B, L) bool, the
    `ENCODE_STAT_KEYS` counters of this batch (added to those already present), the stage's `ENCODE_SPAN_KEYS`
    (when it started and ended the batch, wall clock) and "<stage>_node" (1,) JSON
    {"node_id", "labels"} of the node the actor runs on.
    """

    def __init__(self, what: str, model: dict[str, Any], seed: int, *, max_sequence_length: int,
                 latent_cache: str = "", hot_bytes: int = 0, num_gpus: float = 0.0, torch_threads: int = 1,
                 identities: dict[str, Any] | None = None, storage: dict[str, str] | None = None):
        import torch  # heavy: torch

        if what not in ("vae", "text", "vae+text"):
            raise ValueError(f"EncodeStage: what must be 'vae', 'text' or 'vae+text', got {what!r}")
        self.do_vae, self.do_text = "vae" in what, "text" in what
        self.device = torch.device("cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(torch_threads)))
        self.model, self.seed = dict(model), int(seed)
        self.condition = (self.model.get("i2v") or {}).get("condition")  # an image-to-video model's condition frames
        self.clip = bool((self.model.get("i2v") or {}).get("image_encoder"))  # ... also CLIP-embedded (Wan 2.1 I2V)
        self.image_encoder = self.image_processor = None
        self.max_sequence_length = int(max_sequence_length)
        self._given = {k: v for k, v in (identities or {}).items() if v}
        self._ids: dict[str, str] = {}
        self.family = self.model_cfg = self.vae = self.text_encoder = self.tokenizer = None  # built on the first miss
        self.cache = LatentCache(latent_cache) if latent_cache else None
        self.storage = {"vae": "fp32", "text": "fp32", **(storage or {})}  # `memory.storage_dtype`, resolved
        self.hot_bytes = int(hot_bytes)
        self.hot: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.hot_used = 0
        self.node = json.dumps(node_info())

    # -- the encoders, built on the first miss ---------------------------------------------------------------

    @property
    def vae_id(self) -> str:
        """`latents_identity` of this stage's VAE and condition ("" when it runs no VAE)."""
        return self._identity("vae") if self.do_vae else ""

    @property
    def text_id(self) -> str:
        """`module_identity` of this stage's text encoder, tokenizer class included ("" when it runs none)."""
        return self._identity("text") if self.do_text else ""

    def _identity(self, stage: str) -> str:
        if stage not in self._ids:
            given = self._given.get(stage)
            if isinstance(given, str):
                self._ids[stage] = given
            elif isinstance(given, (list, tuple)) and given:
                import ray  # heavy: ray

                self._ids[stage] = str(ray.get(given[0]))
            else:
                self._load_encoders()
        return self._ids[stage]

    def _load_encoders(self) -> None:
        """Build the family's encoders this stage runs (once) and set or check their identities."""
        if self.family is not None:
            return
        from vidray.config import ModelConfig  # heavy: pydantic
        from vidray.models.registry import get_family  # heavy: torch, pydantic

        model_cfg = self.model_cfg = ModelConfig(**self.model)
        family = get_family(model_cfg.family)
        encoders = family.build_encoders(model_cfg, seed=self.seed)
        from vidray.models.storage import apply_storage_dtype  # heavy: torch

        built = {}
        if self.do_vae:
            image_id = ""
            if self.clip:
                image_id = image_encoder_identity(encoders.image_encoder, encoders.image_processor)
                apply_storage_dtype(encoders.image_encoder, self.storage["vae"], self.device)
                self.image_encoder = encoders.image_encoder.to(self.device)
                self.image_processor = encoders.image_processor
            built["vae"] = stored_identity(latents_identity(module_identity(encoders.vae), self.model, image_id),
                                           self.storage["vae"])
            apply_storage_dtype(encoders.vae, self.storage["vae"], self.device)  # in host memory, then moved
            self.vae = encoders.vae.to(self.device)
        if self.do_text:
            built["text"] = stored_identity(text_encoder_identity(encoders.text_encoder, encoders.tokenizer),
                                            self.storage["text"])
            apply_storage_dtype(encoders.text_encoder, self.storage["text"], self.device)
            self.text_encoder = encoders.text_encoder.to(self.device)
            self.tokenizer = encoders.tokenizer
        for stage, identity in built.items():
            known = self._ids.get(stage)
            if known is None and stage in self._given:
                known = self._identity(stage)
            if known is not None and known != identity:
                raise RuntimeError(f"the {stage} encoder this stage loaded hashes to {identity[:12]}, not "
                                   f"{known[:12]} as the run's identity task found: the model's files changed "
                                   "while the run went on; restart the run")
            self._ids[stage] = identity
        self.family = family

    def _autocast(self, stage: str) -> Any:
        """bf16 autocast around a stage's encoder when its weights are stored in bf16 / fp8 (the fp32 frames and
        the weights then meet in bf16); nothing for fp32."""
        import torch  # heavy: torch

        if self.storage[stage] == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # -- the hot tier and the store -------------------------------------------------------------------------

    def _lookup(self, rel: str) -> dict[str, Any] | None:
        hit = self.hot.get(rel)
        if hit is not None:
            self.hot.move_to_end(rel)
            return hit
        found = self.cache.get(rel) if self.cache is not None else None
        if found is not None:
            self._keep(rel, found)
        return found

    def _keep(self, rel: str, tensors: dict[str, Any]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if not self.hot_bytes or size > self.hot_bytes or rel in self.hot:
            return
        self.hot[rel] = tensors
        self.hot_used += size
        while self.hot_used > self.hot_bytes:
            _, old = self.hot.popitem(last=False)
            self.hot_used -= sum(t.numel() * t.element_size() for t in old.values())

    def _store(self, rel: str, tensors: dict[str, Any]) -> None:
        self._keep(rel, tensors)
        if self.cache is not None:
            self.cache.put(rel, tensors)

    # -- encoding -------------------------------------------------------------------------------------------

    def latents(self, frames: np.ndarray, clip_sha: list[str], bucket: tuple[int, int, int],
                cached: dict[int, dict[str, Any]] | None = None) -> tuple[Any, Any, Any, int, int]:
        """latents (B, C, F_lat, H_lat, W_lat) float32 of uint8 frames (B, F, H, W, 3), and for an image-to-video
        model (`model.i2v`) each clip's condition, inpaint_latents (B, C_in, F_lat, H_lat, W_lat) float32
        (`ModelFamily.condition` of the clip's own `model.i2v.condition` frames: no extra decode), else
        None, and for a model with CLIP image embeddings (`model.i2v.image_encoder`) each clip's image_embeds (B, T,
        D_img) float32 (the same call's, of the same frames), else None; each clip from the
        cache or encoded alone (then stored, all in one entry); returns (latents, inpaint_latents, image_embeds,
        hits, misses). `cached`: {slot: entry ({"latents"[, "inpaint_latents"]}: (C, F_lat,
        H_lat, W_lat) float32 each)} the decode operator already read from this cache (those clips were not
        decoded: their frames are zeros), counted as hits."""
        import torch  # heavy: torch

        entries, hits, misses, done = [], 0, 0, {}
        cached = cached or {}
        for b in range(frames.shape[0]):
            sha = clip_sha[b]
            rel = LatentCache.latents_entry(self.vae_id, sha, bucket) if sha else None
            if rel is not None and rel in done:
                entries.append(done[rel])
                hits += 1
                continue
            found = cached.get(b)
            if found is not None:
                if rel is not None:
                    self._keep(rel, found)
            else:
                found = self._lookup(rel) if rel is not None else None
            if found is not None and (self.condition is None or "inpaint_latents" in found) and \
                    (not self.clip or "image_embeds" in found):
                hits += 1
            else:
                found = self._encode_clip(np.array(frames[b:b + 1]))  # a writable copy of Ray's read-only block
                misses += 1
                if rel is not None:
                    self._store(rel, found)
            if rel is not None:
                done[rel] = found
            entries.append(found)
        latents = torch.stack([e["latents"] for e in entries])
        inpaint = torch.stack([e["inpaint_latents"] for e in entries]) if self.condition is not None else None
        image_embeds = torch.stack([e["image_embeds"] for e in entries]) if self.clip else None
        return latents, inpaint, image_embeds, hits, misses

    def _encode_clip(self, frames: np.ndarray) -> dict[str, Any]:
        """One clip's cache entry: {"latents"[, "inpaint_latents"[, "image_embeds" (T, D_img)]]} (each (C, F_lat,
        H_lat, W_lat) float32, CPU) of
        uint8 frames (1, F, H, W, 3), encoded on this stage's device."""
        import torch  # heavy: torch

        from vidray.models.vae import frames_to_video  # heavy: torch, accelerate, safetensors

        self._load_encoders()
        video = frames_to_video(frames).to(self.device)
        with torch.no_grad(), self._autocast("vae"):
            entry = {"latents": self.family.encode_video(self.vae, video)[0].float().cpu()}
            condition = self.family.condition(self.model_cfg, encoders=self, clip=video)  # None: text-to-video
            if condition is not None:  # its tensors under their own names: inpaint_latents[, image_embeds]
                entry.update({name: tensor[0].float().cpu() for name, tensor in condition.predict_kwargs().items()})
        return entry

    def prompts(self, captions: list[str]) -> tuple[Any, Any, int, int]:
        """prompt_embeds (B, L, D) float32 and prompt_attention_mask (B, L) bool of B captions, each from the
        cache or encoded alone (then stored); returns (prompt_embeds, mask, hits, misses)."""
        import torch  # heavy: torch

        embeds, masks, hits, misses = [], [], 0, 0
        for caption in captions:
            rel = LatentCache.prompt_entry(self.text_id, self.max_sequence_length, caption)
            found = self._lookup(rel)
            if found is None:
                self._load_encoders()
                with torch.no_grad(), self._autocast("text"):
                    e, m = self.family.encode_prompt(self.text_encoder, self.tokenizer, [caption],
                                                     max_sequence_length=self.max_sequence_length)
                found = {"prompt_embeds": e[0].float().cpu(), "prompt_attention_mask": m[0].cpu()}
                self._store(rel, found)
                misses += 1
            else:
                hits += 1
            embeds.append(found["prompt_embeds"])
            masks.append(found["prompt_attention_mask"].bool())
        return torch.stack(embeds), torch.stack(masks), hits, misses

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A block of S micro-batches (rows; `vidray.data.pipeline.ClipLoader`'s columns) -> the same S rows with
        "latents" (S, B, C, F_lat, H_lat, W_lat) float32 (and "inpaint_latents" for an image-to-video model)
        instead of "frames" (vae), "prompt_embeds" (S, B, L, D)
        float32 and "prompt_attention_mask" (S, B, L) bool (text), and the `ENCODE_STAT_KEYS` counters added."""
        return concat_rows([self._row(row) for row in block_rows(batch)])

    def _row(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(batch)
        stats = {k: float(out[k][0]) if k in out else 0.0 for k in ENCODE_STAT_KEYS}
        spans: dict[str, float] = {}
        if self.do_vae:
            t0, spans["vae_start_unix"] = time.perf_counter(), time.time()
            frames = batch["frames"][0]  # (B, F, H, W, 3)
            clip_sha = json.loads(str(batch["clip_sha"][0]))
            vae_id, cached = unpack_cached_latents(out.pop("cached_latents")[0]) if "cached_latents" in out \
                else ("", {})
            if cached and vae_id != self.vae_id:  # both hash the same config and files: only a VAE changed mid-run
                raise RuntimeError(f"the decode operator read cached latents of VAE {vae_id[:12]} but this encode "
                                   f"stage runs VAE {self.vae_id[:12]}: the model's VAE files changed while the "
                                   "loader ran; restart the run")
            latents, inpaint, image_embeds, hits, misses = self.latents(frames, clip_sha, tuple(frames.shape[1:4]),
                                                                        cached)
            out.pop("frames")
            out["latents"] = latents.numpy()[None]
            if inpaint is not None:
                out["inpaint_latents"] = inpaint.numpy()[None]
            if image_embeds is not None:
                out["image_embeds"] = image_embeds.numpy()[None]
            stats["vae_hits"] += hits
            stats["vae_misses"] += misses
            stats["vae_s"] += time.perf_counter() - t0
            spans["vae_end_unix"] = time.time()
            out["vae_node"] = np.array([self.node], dtype=object)
        if self.do_text:
            t0, spans["text_start_unix"] = time.perf_counter(), time.time()
            embeds, mask, hits, misses = self.prompts(json.loads(str(batch["captions"][0])))
            out["prompt_embeds"] = embeds.numpy()[None]
            out["prompt_attention_mask"] = mask.numpy()[None]
            stats["text_hits"] += hits
            stats["text_misses"] += misses
            stats["text_s"] += time.perf_counter() - t0
            spans["text_end_unix"] = time.time()
            out["text_node"] = np.array([self.node], dtype=object)
        out.update({k: np.array([v], dtype=np.float64) for k, v in (*stats.items(), *spans.items())})
        return out


def pack_cached_latents(vae_id: str, cached: dict[int, dict[str, np.ndarray]]) -> bytes:
    """{slot: cache entry ({"latents"[, "inpaint_latents"]}: (C, F_lat, H_lat, W_lat) float32 numpy arrays)} read
    from the entries of `vae_id` (`latents_identity`) -> one safetensors byte string (b"" for none): the decode
    operator's "cached_latents" cell of a micro-batch (`vidray.data.pipeline.ClipLoader`, which never imports
    torch). Tensor names: `<slot>/<entry name>`."""
    from safetensors.numpy import save  # heavy: safetensors

    if not cached:
        return b""
    return save({f"{slot}/{name}": np.ascontiguousarray(a) for slot, entry in cached.items()
                 for name, a in entry.items()}, metadata={"vae_id": vae_id})


def unpack_cached_latents(cell: Any) -> tuple[str, dict[int, dict[str, Any]]]:
    """The inverse of `pack_cached_latents`: (vae_id, {slot: {entry name: torch tensor}}); ("", {}) for b"" or
    None."""
    from safetensors.torch import load  # heavy: torch, safetensors

    if not cell:
        return "", {}
    data = bytes(cell)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])  # the safetensors header (its spec)
    out: dict[int, dict[str, Any]] = {}
    for key, tensor in load(data).items():
        slot, name = key.split("/", 1)
        out.setdefault(int(slot), {})[name] = tensor
    return str(header.get("__metadata__", {}).get("vae_id", "")), out


def latents_identity(vae_id: str, model: dict[str, Any], image_id: str = "") -> str:
    """The id naming a clip's latent cache entries (`LatentCache.latents_entry`): the VAE's `module_identity`
    `vae_id` for a text-to-video model; for an image-to-video one (`model.i2v`, whose entries hold the condition
    latents too, `ModelFamily.condition`), sha256 of the VAE's id and the condition frames
    (`model.i2v.condition`), so the two kinds of entry never meet; with CLIP image embeddings in the entries
    (`model.i2v.image_encoder`), the image encoder's `image_encoder_identity` `image_id` too."""
    i2v = model.get("i2v") or {}
    if not i2v:
        return vae_id
    clip = f"|clip:{image_id}" if image_id else ""
    return hashlib.sha256(f"{vae_id}|i2v:{i2v.get('condition', 'first')}{clip}".encode()).hexdigest()


def stored_identity(identity: str, storage: str) -> str:
    """The identity of an encoder stored in `storage` (`fp32`, `bf16`, `fp8`: `memory.storage_dtype` resolved for
    its stage): `identity` (of the fp32 module) for fp32, else sha256 of it and the dtype (bf16 / fp8 encoders
    write other latents and embeddings: their cache entries never meet fp32 ones)."""
    if storage == "fp32":
        return identity
    return hashlib.sha256(f"{identity}|storage:{storage}".encode()).hexdigest()


def image_encoder_identity(image_encoder: Any, image_processor: Any) -> str:
    """The identity of an image encoder in latent cache entries: `module_identity` of the encoder with its
    processor's settings (another resize or normalisation over the same weights embeds differently)."""
    return module_identity(image_encoder, extra=image_processor.to_json_string())


def vae_identity(model: dict[str, Any], seed: int) -> str:
    """The `latents_identity` of the VAE an `EncodeStage` of this model section (`ModelConfig` as a dict) and
    `train.seed` loads: the `vae_id` of its latent cache entries, with the VAE built alone
    (`ModelFamily.load_latent_models`: a pretrained folder's `vae/` only, never the text encoder; a model with CLIP
    image embeddings also its image encoder alone, `ModelFamily.load_condition_models(..., text=False)`). The
    decode operator uses it to find cached latents before it decodes a clip (`vidray.data.pipeline.ClipLoader`).
    Raises what `load_latent_models` raises for a bad model section."""
    from vidray.config import ModelConfig  # heavy: pydantic
    from vidray.models.registry import get_family  # heavy: torch, pydantic

    model_cfg = ModelConfig(**model)
    family = get_family(model_cfg.family)
    vae_id = module_identity(family.load_latent_models(model_cfg, seed=int(seed)).vae)
    clip = family.load_condition_models(model_cfg, seed=int(seed), text=False)  # Wan 2.1 I2V's CLIP alone, or None
    return latents_identity(vae_id, model, "" if clip.image_encoder is None else
                            image_encoder_identity(clip.image_encoder, clip.image_processor))


def text_identity(model: dict[str, Any], seed: int) -> str:
    """The `module_identity` (tokenizer class included) of the text encoder an `EncodeStage` of this model section
    (`ModelConfig` as a dict) and `train.seed` loads: the identity in its prompt-embedding cache entries. Raises
    what `ModelFamily.build_encoders` raises for a bad model section."""
    from vidray.config import ModelConfig  # heavy: pydantic
    from vidray.models.registry import get_family  # heavy: torch, pydantic

    model_cfg = ModelConfig(**model)
    encoders = get_family(model_cfg.family).build_encoders(model_cfg, seed=int(seed))
    return text_encoder_identity(encoders.text_encoder, encoders.tokenizer)


def text_encoder_identity(text_encoder: Any, tokenizer: Any) -> str:
    """The identity in prompt-embedding cache entries: `module_identity` of the text encoder with its tokenizer's
    class (another tokenizer over the same weights tokenizes, so encodes, differently)."""
    return module_identity(text_encoder, extra=type(tokenizer).__name__)


def node_info() -> dict[str, Any]:
    """{"node_id", "labels"} of the node this process runs on ({} outside Ray)."""
    import ray  # heavy: ray

    if not ray.is_initialized():
        return {}
    runtime = ray.get_runtime_context()
    return {"node_id": runtime.get_node_id(), "labels": runtime.get_node_labels()}
