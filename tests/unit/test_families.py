"""Every registered model family through the same checks (issue 29, part 0): the family is the only way in.

A new family is one file with its `ModelFamily` subclass and its card (`vidray.cards`); these tests then run
every registered family, and the toy family the tests folder adds without an edit under `vidray/`
(`tests/families/toy_family.py`), through what the trainer, the sampler, the exporter and the serve stages ask of it: build the tiny preset, encode a
clip and prompts, predict, take a training loss, take one sampler step, export a stock diffusers folder, load it
back, decode. No module outside `vidray/models/` may import a family module: they reach a family through the
registry only.
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest
import torch

from vidray.cards import register_card, unregister_card
from vidray.config import FlowConfig, ModelConfig, job_config_from_dict
from vidray.buckets import Bucket
from vidray.inference.request import GenerationRequest
from vidray.diffusion.flow_matching import inference_sigmas
from vidray.inference.sampler import denoise_step, generate_video
from vidray.models.export import load_model, write_job_file
from vidray.models.registry import FAMILIES, forget_family
from vidray.train.step import flow_matching_step_loss

REPO = Path(__file__).resolve().parents[2]
FAMILY_MODULES = {type(family).__module__ for family in FAMILIES.values()}
sys.path.insert(0, str(REPO / "tests" / "families"))


@pytest.fixture(scope="module", params=[*sorted(FAMILIES), "toy"])
def built(request):
    """(family, model config, tiny components) of each built-in family and of the toy one, whose card is
    registered for its tests only (`register_card`) and removed after them."""
    if request.param == "toy":
        from toy_family import TOY_CARD

        register_card(TOY_CARD)
        request.addfinalizer(lambda: (unregister_card("toy"), forget_family("toy")))
    family = FAMILIES[request.param]
    cfg = ModelConfig(family=family.name, text_encoder="tiny_random", max_sequence_length=16)
    return family, cfg, family.build(cfg, seed=0)


def test_nothing_outside_models_imports_a_family_module():
    offenders = []
    for path in sorted((REPO / "vidray").rglob("*.py")):
        if path.parent.name == "models" and path.parent.parent.name == "vidray":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n in FAMILY_MODULES]
    assert offenders == [], offenders


def test_the_family_encodes_predicts_and_trains(built):
    family, cfg, components = built
    bucket = Bucket(*family.example_bucket)
    shape = family.latent_shape(bucket, 2)
    assert shape[1] == family.latent_channels
    video = torch.rand(2, 3, bucket.num_frames, bucket.height, bucket.width) * 2 - 1
    with torch.no_grad():
        latents = family.encode_video(components.vae, video)
        embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["a cat", "a dog"],
                                            max_sequence_length=cfg.max_sequence_length)
    assert tuple(latents.shape) == shape and latents.dtype == torch.float32
    assert embeds.shape[:2] == (2, cfg.max_sequence_length) and mask.shape == (2, cfg.max_sequence_length)
    assert mask.dtype == torch.bool
    timesteps = torch.tensor([100.0, 900.0])
    pred = family.predict(components.transformer, latents, timesteps, embeds, mask)
    assert pred.shape == latents.shape and torch.isfinite(pred).all()
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    loss = flow_matching_step_loss(family, components.transformer, latents, embeds, mask, FlowConfig(), generators)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in components.transformer.parameters())
    components.transformer.zero_grad(set_to_none=True)


def test_one_sampler_step_then_decode_gives_a_video_of_the_bucket(built):
    family, cfg, components = built
    bucket = Bucket(*family.example_bucket)
    latents = torch.randn(family.latent_shape(bucket, 1), generator=torch.Generator().manual_seed(0))
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["a cat"],
                                        max_sequence_length=cfg.max_sequence_length)
    sigmas = inference_sigmas(2, shift=FlowConfig().shift)
    stepped = denoise_step(family, components.transformer, latents, sigmas[:1], sigmas[1:2], embeds, mask,
                           num_train_timesteps=FlowConfig().num_train_timesteps)
    assert stepped.shape == latents.shape and not torch.equal(stepped, latents)
    with torch.no_grad():
        video = family.decode_latents(components.vae, stepped)
    assert tuple(video.shape) == (1, 3, bucket.num_frames, bucket.height, bucket.width)
    assert video.min() >= -1 and video.max() <= 1


def test_the_export_loads_back_and_samples_the_same_video(built, tmp_path):
    family, cfg, components = built
    bucket = Bucket(*family.example_bucket)
    flow = FlowConfig(shift=3.0)
    out_dir = family.save_pipeline(components, tmp_path / "diffusers", flow)
    write_job_file(out_dir, job_config_from_dict({
        "name": "conformance", "model": {"family": family.name, "text_encoder": "tiny_random",
                                         "max_sequence_length": cfg.max_sequence_length},
        "data": {"buckets": [list(family.example_bucket)]}, "flow": {"shift": 3.0}}))
    loaded = load_model(out_dir)
    assert loaded.family is family
    kwargs = dict(flow=flow, num_inference_steps=2, guidance_scale=1.0,
                  max_sequence_length=cfg.max_sequence_length, seed=3)
    ours = generate_video(family, components, ["a cat"], bucket, **kwargs)
    theirs = generate_video(loaded.family, loaded.components, ["a cat"], bucket, **kwargs)
    assert ours.shape == (1, bucket.num_frames, bucket.height, bucket.width, 3)
    assert (ours.astype(int) - theirs.astype(int)).__abs__().max() <= 1


def test_vidray_generate_writes_the_families_video_from_its_export(built, tmp_path):
    """`vidray generate`'s whole path (`generate_to_file`: argument checks, the prompt-length warning, sampling,
    the mp4) on every family's export; a long prompt is counted as the family's tokenizer counts it (a new user
    found Wan and AnimateDiff exports crashing here, on EasyAnimate's chat template)."""
    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file

    family, cfg, components = built
    bucket = Bucket(*family.example_bucket)
    out_dir = family.save_pipeline(components, tmp_path / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out_dir, job_config_from_dict({
        "name": "generate", "model": {"family": family.name, "text_encoder": "tiny_random",
                                      "max_sequence_length": cfg.max_sequence_length},
        "data": {"buckets": [list(family.example_bucket)]}, "flow": {"shift": 3.0}}))
    video = generate_to_file(out_dir, "a red fox " * 20, tmp_path / "out.mp4", num_inference_steps=2, seed=1, fps=8.0)
    assert decode_mp4(video.read_bytes()).shape == (bucket.num_frames, bucket.height, bucket.width, 3)


@pytest.mark.parametrize("kind", ["export", "checkpoint"])
def test_each_serve_stage_loads_only_its_component_equal_to_the_whole_load(built, kind, tmp_path):
    """`load_model(components=...)` (what each serve stage calls) gives the same modules as the whole load, and
    None for the rest: from an export (the folder as `init: pretrained`) and from a checkpoint (its config's init
    and seed, then its transformer weights)."""
    from vidray.train.checkpoint import TrainState, save_checkpoint

    family, cfg, components = built
    job = job_config_from_dict({
        "name": "stages", "model": {"family": family.name, "text_encoder": "tiny_random",
                                    "max_sequence_length": cfg.max_sequence_length},
        "data": {"buckets": [list(family.example_bucket)]}, "flow": {"shift": 3.0}, "train": {"seed": 0}})
    if kind == "export":
        folder = family.save_pipeline(components, tmp_path / "diffusers", FlowConfig(shift=3.0))
        write_job_file(folder, job)
    else:
        trained = copy.deepcopy(components.transformer)  # the module fixture's stays as built
        with torch.no_grad():  # trained weights differ from the seed's: the checkpoint's must be the ones loaded
            next(trained.parameters()).add_(0.5)
        optimizer = torch.optim.AdamW(trained.parameters())
        folder = save_checkpoint(tmp_path / "checkpoint_000001", model=trained, optimizer=optimizer,
                                 lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                                 train_state=TrainState(1, 0, 1, 1, ""), job_config=job.to_dict())
    whole = load_model(folder).components

    def same(a: torch.nn.Module, b: torch.nn.Module) -> None:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)

    for names in (("transformer",), ("vae",), ("text_encoder",)):
        part = load_model(folder, components=names).components
        loaded = {name: getattr(part, name) for name in ("transformer", "vae", "text_encoder")}
        assert [n for n, m in loaded.items() if m is not None] == list(names)
        same(loaded[names[0]], getattr(whole, names[0]))
        assert not loaded[names[0]].training
    assert load_model(folder, components=("text_encoder",)).components.tokenizer is not None
    with pytest.raises(ValueError, match="components \\['unet'\\]: give one or more of transformer, vae"):
        load_model(folder, components=("unet",))


def test_the_serve_stages_make_the_video_vidray_generate_makes(built, tmp_path):
    """Serving every family: its export through the three stage classes (used directly, no Ray; the text stage's
    encode as its batched method runs it), each loading only its component, in the ingress's order (encode the prompt and the negative one, denoise with guidance, decode),
    gives the frames `vidray generate`'s sampler gives for the same prompt, seed and steps."""
    import asyncio

    from vidray.serve.stages import Denoiser, TextEncoder, VaeDecoder

    family, cfg, components = built
    bucket = Bucket(*family.example_bucket)
    out_dir = family.save_pipeline(components, tmp_path / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out_dir, job_config_from_dict({
        "name": "serve", "model": {"family": family.name, "text_encoder": "tiny_random",
                                   "max_sequence_length": cfg.max_sequence_length},
        "data": {"buckets": [list(family.example_bucket)]}, "flow": {"shift": 3.0}}))
    text = TextEncoder.func_or_class(str(out_dir))
    denoiser = Denoiser.func_or_class(str(out_dir), {"latency_target_s": 60.0, "max_batch_size": 2})
    vae = VaeDecoder.func_or_class(str(out_dir))

    def encode(prompt: str):  # TextEncoder.encode's body: its @serve.batch runs only inside a Serve replica
        return text.family.encode_prompt(text.text_encoder, text.tokenizer, [prompt],
                                         max_sequence_length=text.max_sequence_length, device="cpu")

    async def serve_one():
        (embeds, mask), (negative, negative_mask) = encode("a red fox"), encode("blurry")
        request = {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": negative,
                   "negative_prompt_attention_mask": negative_mask, "sent_at": 0.0,
                   "request": GenerationRequest(prompt="a red fox", negative_prompt="blurry",
                                                num_frames=bucket.num_frames, height=bucket.height,
                                                width=bucket.width, num_inference_steps=3, guidance_scale=3.0,
                                                seed=7, fps=8.0)}
        async for event in denoiser.denoise(request):
            if "latents" in event:
                return await vae.decode(event["latents"])
        raise AssertionError("the denoiser ended without latents")

    served = asyncio.run(serve_one())
    loaded = load_model(out_dir)
    generated = generate_video(loaded.family, loaded.components, ["a red fox"], bucket, flow=loaded.flow,
                               num_inference_steps=3, guidance_scale=3.0, negative_prompt="blurry",
                               max_sequence_length=cfg.max_sequence_length, seed=7)[0]
    assert served.shape == generated.shape == (bucket.num_frames, bucket.height, bucket.width, 3)
    assert (served.astype(int) - generated.astype(int)).__abs__().max() <= 1


def test_predict_takes_the_ddp_wrapped_transformer_as_the_training_loop_passes_it(built, tmp_path):
    """The loop calls `family.predict(model, ...)` with the DDP-wrapped transformer (`vidray.train.parallel`): a
    family reading the transformer's config or attributes must reach through the wrapper (CogVideoX's rotary
    positions failed there, in a 2-worker run). One process, a world-1 gloo group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    family, cfg, components = built
    bucket = Bucket(*family.example_bucket)
    latents = torch.randn(family.latent_shape(bucket, 1), generator=torch.Generator().manual_seed(0))
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["a cat"],
                                        max_sequence_length=cfg.max_sequence_length)
    timesteps = torch.tensor([500.0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(copy.deepcopy(components.transformer))
        with torch.no_grad():
            direct = family.predict(components.transformer, latents, timesteps, embeds, mask)
            through = family.predict(wrapped, latents, timesteps, embeds, mask)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(through, direct)
