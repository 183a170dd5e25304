"""Family cards (issue 46, part 1): one light record per family that every table of vidray reads, a family added
from the tests folder without an edit under `vidray/`, and a one-line error for each bad card.

The toy family (`tests/families/toy_family.py`) also runs the whole family conformance suite
(`tests/unit/test_families.py`: build, encode, a training loss, a sampler step, export, `vidray generate`, the serve
stages) with its card registered there.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vidray.config import DEFAULT_LORA_TARGET_MODULES, ConfigError, job_config_from_dict
from vidray.cards import (BUILTIN_CARDS, FAMILY_CARDS_ENV, BucketRules, FamilyCard, FamilyCardError, PlannerFacts,
                          all_cards, card_for_pipeline, get_card, register_card, unregister_card)
from vidray.shape_presets import ShapePreset

REPO = Path(__file__).resolve().parents[2]
FAMILIES_DIR = REPO / "tests" / "families"
sys.path.insert(0, str(FAMILIES_DIR))

from toy_family import TOY_CARD  # noqa: E402


@pytest.fixture
def toy():
    """The toy card registered for one test, then removed (with the family built from it, if any)."""
    from vidray.models.registry import forget_family

    register_card(TOY_CARD)
    yield TOY_CARD
    unregister_card("toy")
    forget_family("toy")


def _card(**fields) -> FamilyCard:
    return FamilyCard(**{**dataclasses.asdict(TOY_CARD), "bucket_rules": TOY_CARD.bucket_rules, **fields})


def test_the_builtin_cards_load_without_torch_and_answer_what_the_tables_did():
    code = ("import sys, vidray.config, vidray.cards, vidray.buckets, vidray.models.presets; "
            "print('torch' in sys.modules, 'diffusers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["False", "False"]
    assert [card.name for card in BUILTIN_CARDS] == ["easyanimate", "wan", "cogvideox", "animatediff"]
    assert {c.name for c in BUILTIN_CARDS if c.image_to_video} == {"easyanimate", "wan", "cogvideox"}
    assert {c.name for c in BUILTIN_CARDS if c.experts} == {"wan"}
    assert {c.name: c.blocks for c in BUILTIN_CARDS} == {"easyanimate": "transformer_blocks", "wan": "blocks",
                                                         "cogvideox": "transformer_blocks", "animatediff": None}
    assert {c.name for c in BUILTIN_CARDS if c.meta_build} == {"easyanimate", "wan"}
    assert {c.name for c in BUILTIN_CARDS if c.planner is None} == {"animatediff"}
    assert card_for_pipeline("WanImageToVideoPipeline").name == "wan"
    assert card_for_pipeline("WanImageToVideoPipeline").pipelines["WanImageToVideoPipeline"] is True
    assert card_for_pipeline("StableDiffusionPipeline") is None
    assert get_card("wan").planner.lora_targets == DEFAULT_LORA_TARGET_MODULES  # the attention projections


def test_a_family_from_the_tests_folder_is_accepted_by_the_config_with_its_own_bucket_rules(toy):
    job = job_config_from_dict({"name": "toy", "model": {"family": "toy"}, "data": {"buckets": [[5, 32, 64]]}})
    assert job.model.family == "toy"
    with pytest.raises(ConfigError, match="bucket 5x48x48: height and width must be multiples of 32"):
        job_config_from_dict({"name": "toy", "model": {"family": "toy"}, "data": {"buckets": [[5, 48, 48]]}})
    with pytest.raises(ConfigError, match="model.experts is set but model.family toy has no two-expert model; use wan"):
        job_config_from_dict({"name": "toy", "model": {"family": "toy", "experts": {}},
                              "data": {"buckets": [[5, 32, 32]]}})
    with pytest.raises(ConfigError, match="model.i2v is set but model.family toy has no image-to-video model"):
        job_config_from_dict({"name": "toy", "model": {"family": "toy", "i2v": {}},
                              "data": {"buckets": [[5, 32, 32]]}})


def test_an_unregistered_family_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"model.family'?: unknown model family 'toy'; valid: animatediff, "
                                          r"cogvideox, easyanimate, wan"):
        job_config_from_dict({"name": "toy", "model": {"family": "toy"}})


def test_every_registered_family_plans_its_tiny_config(toy):
    """`vidray plan` and the check a GPU run passes before its workers start (`check_cluster_fits`, what the
    trainer calls on a cluster with GPUs) plan every registered family; a family without planner facts
    (AnimateDiff, the toy) by measuring a step."""
    from vidray.models.registry import get_family
    from vidray.train.plan import check_cluster_fits, plan_job

    planned = {}
    for card in all_cards():
        job = job_config_from_dict({"name": "plan", "model": {"family": card.name}, "scaling": {"use_gpu": True},
                                    "data": {"buckets": [list(get_family(card.name).example_bucket)]}})
        report = plan_job(job, gpu_memory_bytes=24 << 30, num_gpus=1)
        assert report.chosen is not None and report.chosen.fits, card.name
        planned[card.name] = report.chosen.peak_bytes
        line = check_cluster_fits(job, {"GPU": 1.0, "CPU": 8.0}, gpu_memory_bytes=24 << 30)
        assert line is not None and "predicted" in line and "per GPU of 24.0 GiB" in line, (card.name, line)
    assert set(planned) == {"easyanimate", "wan", "cogvideox", "animatediff", "toy"}
    assert all(peak > 0 for peak in planned.values())


TOY_1B = dict(patch_size=(1, 2, 2), num_attention_heads=16, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=8192, num_layers=20, cross_attn_norm=True)
"""A toy 1 B shape of Wan's transformer class (2048 wide, 20 blocks), listed by the planned toy card only."""


def _planner(**fields) -> PlannerFacts:
    presets = (ShapePreset("toy-tiny", "toy", {"text_dim": 64}, config_from="vidray.models.wan:TINY_TRANSFORMER"),
               ShapePreset("toy-1b", "toy", TOY_1B, text_seq_len=512))
    return PlannerFacts(**{"transformer_class": "WanTransformer3DModel", "text_width_key": "text_dim",
                           "token_flow": "cross_attention", "ffn_dim_key": "ffn_dim", "presets": presets,
                           "tiny_preset": "toy-tiny", "lora_targets": DEFAULT_LORA_TARGET_MODULES, **fields})


def test_a_card_brings_its_own_shape_presets_to_vidray_plan_without_an_edit_under_vidray():
    """Presets live on the cards: a toy card with planner facts lists a 1 B shape, and `get_preset`, `vidray plan
    --preset` and a job's `model.preset: tiny` find them; the built-in names stay the built-in families'."""
    from vidray.models.presets import all_presets, get_preset, meta_model, model_preset
    from vidray.models.registry import forget_family
    from vidray.train.plan import plan_job

    assert {"tiny", "wan2.2-a14b", "cogvideox-tiny"} <= set(all_presets()) and "toy-1b" not in all_presets()
    register_card(_card(planner=_planner()))
    try:
        preset = get_preset("toy-1b")
        assert preset.family == "toy"
        params = sum(p.numel() for p in meta_model(preset).parameters())
        assert 0.9e9 < params < 1.5e9, params
        assert model_preset("toy", "tiny", "tiny_random").config["num_layers"] == 2  # Wan's tiny, text width 64
        job = job_config_from_dict({"name": "plan", "model": {"family": "toy"}, "scaling": {"use_gpu": True},
                                    "data": {"buckets": [[33, 256, 256]]}})
        report = plan_job(job, gpu_memory_bytes=24 << 30, num_gpus=1, preset=preset)
        assert report.chosen is not None and report.chosen.fits
        assert report.counts.total == params
    finally:
        unregister_card("toy")
        forget_family("toy")
    with pytest.raises(Exception, match="unknown preset 'toy-1b'"):
        get_preset("toy-1b")


@pytest.mark.parametrize("planner_fields, message", [
    ({"tiny_preset": "toy-2b"}, "family card 'toy': planner.tiny_preset 'toy-2b' is not one of planner.presets "
                                r"\(toy-tiny, toy-1b\)"),
    ({"presets": (ShapePreset("toy-1b", "wan", TOY_1B),), "tiny_preset": None},
     "family card 'toy': planner.presets must be ShapePresets of family 'toy'"),
    ({"presets": (ShapePreset("toy-1b", "toy", TOY_1B),) * 2, "tiny_preset": None},
     "family card 'toy': planner.presets name one preset twice"),
])
def test_a_card_with_bad_presets_is_refused_naming_the_field(planner_fields, message):
    with pytest.raises(FamilyCardError, match=message):
        _card(planner=_planner(**planner_fields))


def test_a_preset_name_another_card_uses_is_refused_at_registration():
    taken = _planner(presets=(ShapePreset("wan2.1-14b", "toy", TOY_1B),), tiny_preset=None)
    with pytest.raises(FamilyCardError, match="family card 'toy': preset 'wan2.1-14b' is registered already "
                                              "\\(by family wan\\)"):
        register_card(_card(planner=taken))
    assert "toy" not in {card.name for card in all_cards()}


@pytest.mark.parametrize("fields, message", [
    ({"bucket_rules": None}, "family card 'toy': field bucket_rules is missing"),
    ({"objective": "score_matching"}, "family card 'toy': objective must be flow_matching or ddim"),
    ({"family_class": "toy_family"}, "family card 'toy': family_class must be 'module:Class'"),
    ({"pipelines": {}}, "family card 'toy': pipelines must map at least one stock pipeline class"),
    ({"name": "toy family"}, "family card 'toy family': name must be an identifier"),
])
def test_a_malformed_card_is_refused_naming_the_card_and_the_field(fields, message):
    from vidray import cards

    if fields.get("bucket_rules", 1) is None:  # left out, as a user's card that forgets it
        fields = {"bucket_rules": cards._MISSING}
    with pytest.raises(FamilyCardError, match=message):
        _card(**fields)


def test_a_second_card_of_one_name_and_a_missing_module_are_refused_at_registration():
    with pytest.raises(FamilyCardError, match="family card 'wan': name is registered already"):
        register_card(_card(name="wan"))
    with pytest.raises(FamilyCardError, match="family card 'ghost': family_class module 'no_such_family' cannot "
                                              "be found"):
        register_card(_card(name="ghost", family_class="no_such_family:Ghost"))
    assert "ghost" not in {card.name for card in all_cards()}


@pytest.mark.parametrize("source, card_fields, message", [
    ("raise ImportError('needs diffusers 9')\n", {},
     "family card 'broken': family_class module 'broken_family' does not import: needs diffusers 9"),
    ("from vidray.models.animatediff import AnimateDiffFamily\nclass Broken(AnimateDiffFamily):\n"
     "    name = 'broken'\n",  # AnimateDiff has no image condition (does not override ModelFamily.condition)
     {"pipelines": {"BrokenPipeline": False, "BrokenI2VPipeline": True}},
     "family card 'broken': pipelines name image-to-video BrokenI2VPipeline but broken_family:Broken has no "
     "condition"),
    ("from vidray.models.animatediff import AnimateDiffFamily\nclass Broken(AnimateDiffFamily):\n"
     "    name = 'broken'\n"  # the condition methods of old (encode_clip_condition, ...) are no condition
     "    def encode_clip_condition(self, vae, video, condition):\n        return video\n",
     {"pipelines": {"BrokenPipeline": False, "BrokenI2VPipeline": True}},
     r"family card 'broken': pipelines name image-to-video BrokenI2VPipeline but broken_family:Broken has no "
     r"condition \(ModelFamily.condition\); mark them False"),
    ("from vidray.models.base import ModelFamily\nfrom vidray.models.wan import WanFamily\n"
     "class Broken(ModelFamily):\n    name = 'broken'\n"  # written against the old protocol: no role loaders
     "    build_transformer = WanFamily.load_diffusion_models\n"
     "    load_condition_models = WanFamily.load_condition_models\n"
     + "".join(f"    {n} = WanFamily.{n}\n" for n in ("encode_video", "decode_latents", "encode_prompt", "predict",
                                                       "latent_shape", "no_grad_parameter_names", "save_pipeline")),
     {}, "family card 'broken': broken_family:Broken does not implement load_diffusion_models, load_latent_models: "
         "define them"),
    ("from toy_family import ToyFamily\nclass Broken(ToyFamily):\n    pass\n", {},
     "family card 'broken': family_class 'broken_family:Broken' has name 'toy'; make them equal"),
])
def test_a_family_module_that_fails_is_named_at_first_use(tmp_path, monkeypatch, source, card_fields, message):
    from vidray.models.registry import forget_family, get_family

    (tmp_path / "broken_family.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    register_card(_card(name="broken", family_class="broken_family:Broken", **card_fields))
    try:
        with pytest.raises(FamilyCardError, match=message):
            get_family("broken")
    finally:
        unregister_card("broken")
        forget_family("broken")
        sys.modules.pop("broken_family", None)


def test_the_environment_registers_a_card_in_every_process_and_a_bad_entry_is_one_line(tmp_path):
    """`VIDRAY_FAMILY_CARDS` is how a family reaches Ray workers, encode actors and serve replicas: a fresh process
    with it set loads and plans a toy job, and `vidray plan` takes its config."""
    env = {**os.environ, FAMILY_CARDS_ENV: "toy_family:TOY_CARD",
           "PYTHONPATH": os.pathsep.join([str(FAMILIES_DIR), str(REPO)])}
    config = tmp_path / "toy.yaml"
    config.write_text(textwrap.dedent("""\
        name: toy
        model: {family: toy, text_encoder: tiny_random}
        data: {buckets: [[5, 32, 32]]}
        """))
    out = subprocess.run([sys.executable, "-m", "vidray.cli", "plan", str(config), "--gpus", "1",
                          "--gpu-memory", "24GiB"], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "fits" in out.stdout.lower()
    env[FAMILY_CARDS_ENV] = "toy_family:NO_SUCH_CARD"
    out = subprocess.run([sys.executable, "-m", "vidray.cli", "plan", str(config), "--gpus", "1"],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode != 0
    assert f"{FAMILY_CARDS_ENV} entry 'toy_family:NO_SUCH_CARD' does not import" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_bucket_rules_of_a_card_are_what_the_family_class_reads():
    from vidray.models.registry import FAMILIES

    for name in ("easyanimate", "wan", "cogvideox", "animatediff"):
        family, rules = FAMILIES[name], get_card(name).bucket_rules
        assert isinstance(rules, BucketRules)
        assert family.spatial_multiple == rules.spatial_multiple, name
        assert family.temporal_compression_ratio == rules.temporal_compression, name
        assert family.card is get_card(name)


@pytest.mark.slow
def test_the_toy_family_prepares_trains_exports_and_generates_through_the_real_loop(toy, tmp_path):
    """The toy family (registered from the tests folder, no edit under `vidray/`) through what a user runs:
    `prepare` with its bucket rules (a side off its 32 px multiple refused), the training loop in this process
    (`train_in_process`: the Worker, its decode and encode operators, a checkpoint, the export) and
    `vidray generate` from the export."""
    from vidray.config import load_job_config
    from vidray.data.ingest import prepare
    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file
    from vidray.train.local import train_in_process

    metadata = REPO / "samples" / "metadata.json"
    with pytest.raises(ValueError, match="multiples of 32"):
        prepare(metadata, tmp_path / "refused", buckets=[(9, 48, 48)], fps=8.0, samples_per_shard=4, family="toy",
                progress=None)
    shards = tmp_path / "shards"
    assert prepare(metadata, shards, buckets=[(9, 64, 64)], fps=8.0, samples_per_shard=4, family="toy",
                   progress=None).num_kept >= 4
    job = load_job_config(REPO / "jobs" / "configs" / "wan_t2v_tiny.yaml", [
        "model.family=toy", "name=toy", f"data.shards_dir={shards}", f"storage.path={tmp_path / 'runs'}",
        "data.buckets=[[9, 64, 64]]", "train.max_steps=2", "train.log_every_steps=1", "checkpoint.every_steps=2",
        "optim.warmup_steps=0"])
    result = train_in_process(job)
    assert (result.first_step, result.last_step) == (1, 2) and len(result.losses) == 2
    assert [step for step, _ in result.losses] == [1, 2] and all(0 < loss < 10 for _, loss in result.losses)
    assert (Path(result.run_dir) / "checkpoint_000002").is_dir()
    video = generate_to_file(result.diffusers_dir, "a red fox", tmp_path / "toy.mp4", num_inference_steps=2, seed=1,
                             fps=8.0)
    assert decode_mp4(video.read_bytes()).shape == (9, 64, 64, 3)
