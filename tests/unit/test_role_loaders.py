"""The three role loaders every family implements (issue 46, part 2C): `load_condition_models`,
`load_latent_models`, `load_diffusion_models`, each able to build on the meta device. A meta build has the real
build's shapes and no storage, for the random preset and for a pretrained folder (from its configs alone, naming the
folder of its weights)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from vidray.config import ExpertsConfig, FlowConfig, I2VConfig, ModelConfig
from vidray.models.registry import FAMILIES

CONFIGS = {
    "easyanimate": ModelConfig(family="easyanimate", text_encoder="tiny_random"),
    "easyanimate-i2v": ModelConfig(family="easyanimate", text_encoder="tiny_random", i2v=I2VConfig()),
    "wan": ModelConfig(family="wan", text_encoder="tiny_random"),
    "wan21-i2v": ModelConfig(family="wan", text_encoder="tiny_random", i2v=I2VConfig(image_encoder=True),
                             max_sequence_length=512),
    "wan-experts": ModelConfig(family="wan", text_encoder="tiny_random", experts=ExpertsConfig(boundary_ratio=0.875)),
    "cogvideox": ModelConfig(family="cogvideox", text_encoder="tiny_random"),
    "animatediff": ModelConfig(family="animatediff", text_encoder="tiny_random"),
}


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def _assert_meta_like(meta: torch.nn.Module, real: torch.nn.Module) -> None:
    """Same names and shapes as `real`, every parameter and buffer on the meta device (no storage)."""
    assert _shapes(meta) == _shapes(real)
    tensors = [*meta.parameters(), *meta.buffers()]
    assert tensors and all(t.is_meta for t in tensors)


def _role_builds(family, cfg, *, seed: int) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(role, meta build, real build) of every module the three loaders give for `cfg`."""
    pairs = []
    real_cond = family.load_condition_models(cfg, seed=seed)
    meta_cond = family.load_condition_models(cfg, seed=seed, meta=True)
    pairs.append(("text_encoder", meta_cond.text_encoder, real_cond.text_encoder))
    assert (meta_cond.image_encoder is None) == (real_cond.image_encoder is None)
    if real_cond.image_encoder is not None:
        pairs.append(("image_encoder", meta_cond.image_encoder, real_cond.image_encoder))
    pairs.append(("vae", family.load_latent_models(cfg, seed=seed, meta=True).vae,
                  family.load_latent_models(cfg, seed=seed).vae))
    pairs.append(("transformer", family.load_diffusion_models(cfg, seed=seed, meta=True).transformer,
                  family.load_diffusion_models(cfg, seed=seed).transformer))
    return pairs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_role_builds_on_the_meta_device_with_the_real_builds_shapes(name):
    cfg = CONFIGS[name]
    family = FAMILIES[cfg.family]
    for role, meta, real in _role_builds(family, cfg, seed=0):
        assert not any(t.is_meta for t in real.parameters()), role
        _assert_meta_like(meta, real)
    built = family.build(cfg, seed=0)  # the composition is the three loaders'
    alone = family.load_diffusion_models(cfg, seed=0).transformer.state_dict()
    assert all(torch.equal(alone[k], v) for k, v in built.transformer.state_dict().items())


@pytest.mark.parametrize("name", ["easyanimate", "wan", "wan-experts", "cogvideox", "animatediff"])
def test_a_pretrained_folders_roles_build_on_the_meta_device_from_its_configs(name, tmp_path):
    cfg = CONFIGS[name]
    family = FAMILIES[cfg.family]
    family.save_pipeline(family.build(cfg, seed=1), tmp_path, FlowConfig())
    folder_cfg = dataclasses.replace(cfg, init="pretrained", pretrained_path=str(tmp_path))
    _assert_meta_like(family.load_condition_models(folder_cfg, seed=0, meta=True).text_encoder,
                      family.load_condition_models(folder_cfg, seed=0).text_encoder)
    _assert_meta_like(family.load_latent_models(folder_cfg, seed=0, meta=True).vae,
                      family.load_latent_models(folder_cfg, seed=0).vae)
    latent = family.load_latent_models(folder_cfg, seed=0, meta=True)
    assert Path(latent.weights_folder) == tmp_path / "vae"
    assert list(Path(latent.weights_folder).glob("*.safetensors"))
    for expert in ["high", "low"] if cfg.experts else [None]:  # two experts shard one by one: each alone
        meta = family.load_diffusion_models(folder_cfg, seed=0, expert=expert, meta=True)
        real = family.load_diffusion_models(folder_cfg, seed=0, expert=expert).transformer
        _assert_meta_like(meta.transformer, real)
        assert meta.weights_folder is not None and list(Path(meta.weights_folder).glob("*.safetensors")), expert
        if expert == "low":
            assert Path(meta.weights_folder).name == "transformer_2"


def test_the_trainable_vae_is_the_frozen_one_in_train_mode_and_only_easyanimates_trains():
    cfg = CONFIGS["easyanimate"]
    family = FAMILIES["easyanimate"]
    trainable = family.load_latent_models(cfg, seed=3, trainable=True).vae
    frozen = family.load_latent_models(cfg, seed=3).vae
    assert trainable.training and all(p.requires_grad for p in trainable.parameters())
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert all(torch.equal(v, frozen.state_dict()[k]) for k, v in trainable.state_dict().items())
    _assert_meta_like(family.load_latent_models(cfg, seed=3, trainable=True, meta=True).vae, trainable)
    for name in ("wan", "cogvideox", "animatediff"):
        with pytest.raises(NotImplementedError, match=f"the {name} family's VAE cannot be trained by vidray "
                                                      "train-vae yet"):
            FAMILIES[name].load_latent_models(CONFIGS[name], seed=0, trainable=True)


def test_an_expert_of_a_model_without_experts_is_refused_in_one_line():
    for name in ("easyanimate", "wan", "cogvideox", "animatediff"):
        with pytest.raises(ValueError, match="the low-noise expert was asked for, but this model has one "
                                             "transformer") as err:
            FAMILIES[CONFIGS[name].family].load_diffusion_models(CONFIGS[name], seed=0, expert="low")
        assert "\n" not in str(err.value)


def _folder_with(cfg: ModelConfig, tmp_path: Path, component: str, **changes) -> ModelConfig:
    """A tiny pipeline folder of `cfg` whose `component/config.json` has `changes`, as a pretrained config."""
    family = FAMILIES[cfg.family]
    family.save_pipeline(family.build(cfg, seed=1), tmp_path, FlowConfig())
    config_path = tmp_path / component / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    return dataclasses.replace(cfg, init="pretrained", pretrained_path=str(tmp_path))


def test_a_folder_whose_transformer_and_vae_disagree_is_refused_by_the_diffusion_loader(tmp_path):
    """The cross-module check a whole-folder load made (the transformer's layout against the folder's VAE) holds
    when the transformer loads alone: the VAE's config is read, not its weights."""
    cfg = _folder_with(CONFIGS["easyanimate"], tmp_path, "vae", latent_channels=8)
    with pytest.raises(ValueError, match=r"vae latent_channels.* = \(8, .*but the easyanimate family expects \(16"):
        FAMILIES["easyanimate"].load_diffusion_models(cfg, seed=0)


def test_a_clip_image_encoder_the_transformer_cannot_take_is_refused_by_the_condition_loader(tmp_path):
    """Wan 2.1 I2V: the CLIP tower's width is checked against the folder's transformer config (`image_dim`) when
    the image encoder loads, without the transformer's weights."""
    cfg = _folder_with(CONFIGS["wan21-i2v"], tmp_path, "transformer", image_dim=48)
    with pytest.raises(ValueError, match=r"image_encoder gives 257 tokens of width 32 per image, but the transformer "
                                         r"takes 257 of width 48"):
        FAMILIES["wan"].load_condition_models(cfg, seed=0)
