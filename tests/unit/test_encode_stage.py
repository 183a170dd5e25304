"""The encode stage and the latent cache with tiny real encoders (no Ray): keys, hits, misses, determinism, and the
model-family seam (`load_diffusion_models`, `build_encoders`) equal to `build`."""

import dataclasses
import hashlib
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from vidray.config import FlowConfig, ModelConfig  # noqa: E402
from vidray.data.encode import (  # noqa: E402
    ENCODE_SPAN_KEYS,
    ENCODE_STAT_KEYS,
    EncodeStage,
    LatentCache,
    module_identity,
)
from vidray.models import get_family  # noqa: E402

from tests.conftest import run_at_once  # noqa: E402

MODEL = ModelConfig(text_encoder="tiny_random", max_sequence_length=16)
F, H, W = 5, 32, 32


def _frames(seed: int, n: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, F, H, W, 3), dtype=np.uint8)


def _batch(frames: np.ndarray, shas: list[str], captions: list[str]) -> dict[str, np.ndarray]:
    return {"i": np.array([0]), "frames": frames[None], "clip_sha": np.array([json.dumps(shas)]),
            "captions": np.array([json.dumps(captions)])}


def _stage(cache: str = "", model: ModelConfig = MODEL, what: str = "vae+text", seed: int = 0) -> EncodeStage:
    return EncodeStage(what, dataclasses.asdict(model), seed, max_sequence_length=model.max_sequence_length,
                       latent_cache=cache, hot_bytes=0)


def test_family_builds_transformer_and_encoders_alone_equal_to_build():
    family = get_family("easyanimate")
    full = family.build(MODEL, seed=3)
    transformer = family.load_diffusion_models(MODEL, seed=3).transformer
    encoders = family.build_encoders(MODEL, seed=3)
    for name, value in full.transformer.state_dict().items():
        assert torch.equal(value, transformer.state_dict()[name]), name
    assert module_identity(encoders.vae) == module_identity(full.vae)
    assert module_identity(encoders.text_encoder) == module_identity(full.text_encoder)
    assert module_identity(encoders.vae) != module_identity(family.build_encoders(MODEL, seed=4).vae)


def test_stage_outputs_shapes_and_the_cache_returns_the_same_bits(tmp_path):
    frames = _frames(0)
    shas = ["a" * 64, "b" * 64]
    captions = ["a red ball", "waves on a beach"]
    stage = _stage(str(tmp_path))
    before = time.time()
    first = stage(_batch(frames, shas, captions))
    after = time.time()
    assert "frames" not in first
    # When each stage worked on the batch, wall clock (the trainer clips it to its log window): vae, then text.
    spans = [float(first[k][0]) for k in ENCODE_SPAN_KEYS]  # vae start, vae end, text start, text end
    assert before <= spans[0] <= spans[1] <= spans[2] <= spans[3] <= after, spans
    assert spans[1] - spans[0] <= first["vae_s"][0] + 0.05 and spans[3] - spans[2] <= first["text_s"][0] + 0.05
    assert first["latents"].shape == (1, 2, 16, 2, 4, 4) and first["latents"].dtype == np.float32
    assert first["prompt_embeds"].shape == (1, 2, 16, 64) and first["prompt_attention_mask"].dtype == bool
    assert (first["vae_misses"][0], first["vae_hits"][0]) == (2, 0)
    assert (first["text_misses"][0], first["text_hits"][0]) == (2, 0)
    assert len(list((tmp_path / "vae").rglob("*.safetensors"))) == 2
    assert len(list((tmp_path / "text").rglob("*.safetensors"))) == 2

    # A new stage (a later run): every clip and caption comes from the cache, bit for bit.
    again = _stage(str(tmp_path))(_batch(np.zeros_like(frames), shas, captions))  # frames unused on hits
    assert (again["vae_hits"][0], again["vae_misses"][0], again["text_hits"][0]) == (2, 0, 2)
    np.testing.assert_array_equal(again["latents"], first["latents"])
    np.testing.assert_array_equal(again["prompt_embeds"], first["prompt_embeds"])
    assert set(ENCODE_STAT_KEYS) <= set(again)


def test_a_clip_encodes_the_same_alone_or_with_others():
    stage = _stage()
    frames = _frames(1, 3)
    together = stage(_batch(frames, ["", "", ""], ["x", "y", "z"]))["latents"][0]
    alone = stage(_batch(frames[2:3], [""], ["z"]))["latents"][0]
    np.testing.assert_array_equal(together[2], alone[0])


def test_a_changed_clip_misses_and_is_encoded_again(tmp_path):
    frames = _frames(2, 1)
    _stage(str(tmp_path))(_batch(frames, ["c" * 64], ["cap"]))
    new_frames = _frames(3, 1)
    out = _stage(str(tmp_path))(_batch(new_frames, ["d" * 64], ["cap"]))  # same name, new bytes: new sha
    assert (out["vae_misses"][0], out["vae_hits"][0]) == (1, 0)
    expected = _stage()(_batch(new_frames, [""], ["cap"]))["latents"]
    np.testing.assert_array_equal(out["latents"], expected)


def test_a_changed_vae_misses_the_cache(tmp_path):
    """Two pretrained folders that differ in one VAE weight: the second misses and encodes with its own VAE."""
    family = get_family("easyanimate")
    folder = tmp_path / "model"
    family.save_pipeline(family.build(MODEL, seed=0), folder, FlowConfig())
    cache = str(tmp_path / "cache")
    pretrained = dataclasses.replace(MODEL, init="pretrained", pretrained_path=str(folder))
    frames = _frames(4, 1)
    first = _stage(cache, pretrained)(_batch(frames, ["e" * 64], ["cap"]))
    assert first["vae_misses"][0] == 1
    assert _stage(cache, pretrained)(_batch(frames, ["e" * 64], ["cap"]))["vae_hits"][0] == 1

    weights = next((folder / "vae").glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if k.startswith("encoder.conv_in") and k.endswith("weight"))
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, weights)
    changed = _stage(cache, pretrained)(_batch(frames, ["e" * 64], ["cap"]))
    assert (changed["vae_misses"][0], changed["vae_hits"][0]) == (1, 0)
    assert changed["text_hits"][0] == 1  # the text encoder did not change
    assert not np.array_equal(changed["latents"], first["latents"])


def test_a_damaged_entry_is_a_miss_and_is_rewritten(tmp_path):
    frames = _frames(5, 1)
    first = _stage(str(tmp_path), what="vae")(_batch(frames, ["f" * 64], ["cap"]))
    entry = next((tmp_path / "vae").rglob("*.safetensors"))
    entry.write_bytes(b"not safetensors")
    out = _stage(str(tmp_path), what="vae")(_batch(frames, ["f" * 64], ["cap"]))
    assert out["vae_misses"][0] == 1
    np.testing.assert_array_equal(out["latents"], first["latents"])
    assert hashlib.sha256(entry.read_bytes()).hexdigest()  # rewritten whole
    assert load_file(entry)["latents"].shape == (16, 2, 4, 4)


def test_cache_entry_names_key_content_bucket_and_encoder():
    a = LatentCache.latents_entry("v" * 64, "a" * 64, (5, 32, 32))
    assert a != LatentCache.latents_entry("v" * 64, "a" * 64, (9, 32, 32))
    assert a != LatentCache.latents_entry("w" * 64, "a" * 64, (5, 32, 32))
    assert a != LatentCache.latents_entry("v" * 64, "b" * 64, (5, 32, 32))
    p = LatentCache.prompt_entry("t" * 64, 16, "cap")
    assert p != LatentCache.prompt_entry("t" * 64, 32, "cap") and p != LatentCache.prompt_entry("t" * 64, 16, "cap2")


def test_stage_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="'vae', 'text' or 'vae\\+text'"):
        _stage(what="dit")


def _put_ones(root: str, rel: str) -> None:
    """Cache prompt_embeds of ones (4, 8) as entry `rel` of the latent cache at `root` (a `run_at_once` action)."""
    LatentCache(root).put(rel, {"prompt_embeds": torch.ones(4, 8)})


def test_two_processes_caching_the_same_caption_at_once_both_succeed(tmp_path):
    """The reported case (a CI run): two ranks' encode stages cached the prompt embeddings of one caption at the
    same moment; both wrote the same temp file, and the second rename failed with FileNotFoundError, which failed
    the worker. Here 3 processes put one entry 300 times each, started together."""
    rel = LatentCache.prompt_entry("t" * 32, 32, "a caption two ranks share")
    assert run_at_once(_put_ones, str(tmp_path), rel, repeats=300) == []
    assert torch.equal(LatentCache(str(tmp_path)).get(rel)["prompt_embeds"], torch.ones(4, 8))
    assert [p.name for p in (tmp_path / rel).parent.iterdir()] == [(tmp_path / rel).name]  # no temp file left


def test_vae_identity_is_the_stage_vae_id_without_loading_the_text_encoder(tmp_path, monkeypatch):
    from vidray.data.encode import vae_identity
    from vidray.models import easyanimate

    assert vae_identity(dataclasses.asdict(MODEL), 0) == _stage(what="vae").vae_id
    assert vae_identity(dataclasses.asdict(MODEL), 1) != _stage(what="vae").vae_id
    family = get_family("easyanimate")
    folder = tmp_path / "model"
    family.save_pipeline(family.build(MODEL, seed=5), folder, FlowConfig())
    pretrained = dataclasses.replace(MODEL, init="pretrained", pretrained_path=str(folder))
    stage_id = _stage(model=pretrained, what="vae").vae_id

    def no_pipeline(*args, **kwargs):
        raise AssertionError("vae_identity loaded the whole pipeline")

    monkeypatch.setattr(easyanimate.EasyAnimatePipeline, "from_pretrained", no_pipeline)
    assert vae_identity(dataclasses.asdict(pretrained), 0) == stage_id


def test_latents_the_decode_operator_read_from_the_cache_are_used_as_they_are(tmp_path):
    """A slot whose clip the decode operator did not decode (its latents were cached: zeros for frames) gets those
    latents, counted as a hit; latents read for another VAE are an error, never trained on."""
    from vidray.data.encode import pack_cached_latents, unpack_cached_latents

    frames = _frames(6, 2)
    stage = _stage(what="vae")
    encoded = stage(_batch(frames, ["", ""], ["x", "y"]))["latents"][0]
    cached = {1: {"latents": encoded[1]}}
    blank = frames.copy()
    blank[1] = 0
    batch = {**_batch(blank, ["", ""], ["x", "y"]),
             "cached_latents": np.array([pack_cached_latents(stage.vae_id, cached)], dtype=object)}
    out = stage(batch)
    assert (out["vae_hits"][0], out["vae_misses"][0]) == (1, 1) and "cached_latents" not in out
    np.testing.assert_array_equal(out["latents"][0], encoded)
    # a clip repeated in a batch: one tensor in two slots
    assert set(unpack_cached_latents(pack_cached_latents(stage.vae_id, {0: cached[1], 1: cached[1]}))[1]) == {0, 1}
    assert unpack_cached_latents(b"") == ("", {})
    batch["cached_latents"] = np.array([pack_cached_latents("0" * 64, cached)], dtype=object)
    with pytest.raises(RuntimeError, match="VAE files changed"):
        stage(batch)


def _lazy_stage(cache: str, identities: dict[str, str]) -> EncodeStage:
    return EncodeStage("vae+text", dataclasses.asdict(MODEL), 0, max_sequence_length=MODEL.max_sequence_length,
                       latent_cache=cache, hot_bytes=0, identities=identities)


def test_a_stage_given_the_identities_loads_no_encoder_while_every_entry_is_cached(tmp_path):
    """The identity tasks' ids (`vae_identity`, `text_identity`) are the stage's own; a stage given them serves a
    fully cached batch without building either encoder (the same bits as the stage that filled the cache), and
    builds them on its first miss, encoding as a stage that never cached."""
    from vidray.data.encode import text_identity, vae_identity

    frames, shas, captions = _frames(7, 2), ["a" * 64, "b" * 64], ["a red kite", "a blue boat"]
    filler = _stage(str(tmp_path))
    filled = filler(_batch(frames, shas, captions))
    ids = {"vae": vae_identity(dataclasses.asdict(MODEL), 0), "text": text_identity(dataclasses.asdict(MODEL), 0)}
    assert ids == {"vae": filler.vae_id, "text": filler.text_id}

    lazy = _lazy_stage(str(tmp_path), ids)
    out = lazy(_batch(frames, shas, captions))
    assert lazy.family is None and lazy.vae is None and lazy.text_encoder is None  # nothing loaded
    assert (out["vae_misses"][0], out["text_misses"][0]) == (0, 0)
    for key in ("latents", "prompt_embeds", "prompt_attention_mask"):
        np.testing.assert_array_equal(out[key], filled[key])

    other = _frames(8, 1)
    missed = lazy(_batch(other, ["c" * 64], ["a green tram"]))
    assert lazy.vae is not None and lazy.text_encoder is not None
    assert (missed["vae_misses"][0], missed["text_misses"][0]) == (1, 1)
    fresh = _stage()(_batch(other, ["c" * 64], ["a green tram"]))
    for key in ("latents", "prompt_embeds"):
        np.testing.assert_array_equal(missed[key], fresh[key])


def test_a_stage_given_another_encoder_s_identity_refuses_to_encode_with_its_own(tmp_path):
    lazy = _lazy_stage(str(tmp_path), {"vae": "0" * 64, "text": "0" * 64})
    with pytest.raises(RuntimeError, match="files changed while the run went on"):
        lazy(_batch(_frames(9, 1), ["d" * 64], ["a yellow cab"]))
    assert not list(tmp_path.rglob("*.safetensors"))  # nothing stored under the wrong identity


def test_an_image_to_video_model_s_stage_encodes_each_clip_s_condition_and_caches_it_apart(tmp_path):
    """`model.i2v`: the stage hands each clip's own condition frames, encoded as the family's stock inpaint
    pipeline does (`family.condition` of the clip, from the same decoded frames: no extra decode), beside its latents;
    both are cached in one entry under an id of their own (a text-to-video run's entries never serve it), and a
    cache hit, or the decode operator's cached entry, gives the same bits."""
    from vidray.config import I2VConfig
    from vidray.data.encode import latents_identity, pack_cached_latents
    from vidray.models.vae import frames_to_video

    i2v = dataclasses.replace(MODEL, i2v=I2VConfig(condition="first_last"))
    frames = _frames(7)
    shas = ["c" * 64, "d" * 64]
    stage = _stage(str(tmp_path), model=i2v, what="vae")
    first = stage(_batch(frames, shas, ["x", "y"]))
    assert first["inpaint_latents"].shape == (1, 2, 17, 2, 4, 4) and first["inpaint_latents"].dtype == np.float32
    family = get_family("easyanimate")
    encoders = family.build_encoders(i2v, seed=0)
    with torch.no_grad():
        for b in range(2):
            video = frames_to_video(frames[b:b + 1])
            want = family.condition(i2v, encoders=encoders, clip=video).inpaint_latents[0]
            np.testing.assert_allclose(first["inpaint_latents"][0, b], want.numpy(), rtol=1e-5, atol=1e-6)
    t2v = _stage(str(tmp_path), what="vae")
    vae_id = module_identity(encoders.vae)
    assert stage.vae_id == latents_identity(vae_id, dataclasses.asdict(i2v)) != vae_id
    assert "inpaint_latents" not in t2v(_batch(frames, shas, ["x", "y"]))  # its own entries: a miss, no condition
    again = _stage(str(tmp_path), model=i2v, what="vae")(_batch(frames, shas, ["x", "y"]))
    assert (again["vae_hits"][0], again["vae_misses"][0]) == (2, 0)
    np.testing.assert_array_equal(again["inpaint_latents"], first["inpaint_latents"])
    entry = {"latents": first["latents"][0, 1], "inpaint_latents": first["inpaint_latents"][0, 1]}
    blank = frames.copy()
    blank[1] = 0
    out = _stage(model=i2v, what="vae")({**_batch(blank, ["", ""], ["x", "y"]), "cached_latents": np.array(
        [pack_cached_latents(stage.vae_id, {1: entry})], dtype=object)})
    np.testing.assert_array_equal(out["inpaint_latents"][0, 1], entry["inpaint_latents"])
    np.testing.assert_array_equal(out["inpaint_latents"][0, 0], first["inpaint_latents"][0, 0])
