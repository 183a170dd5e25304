"""Shape presets by name for the planner: found across the registered family cards
(`vidray.cards.PlannerFacts.presets`; the built-in families' data and its sources are in `vidray.shape_presets`),
a job's `init: random` shape (`model_preset`), a local folder's shape (`preset_from_pretrained`), and the meta-device
build that counts a preset's parameters (`meta_model`)."""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

from vidray.cards import all_cards, get_card
from vidray.errors import UserError, UserFileNotFound
from vidray.shape_presets import ShapePreset

__all__ = ["ShapePreset", "all_presets", "get_preset", "model_preset", "planner_facts", "preset_from_pretrained"]


def planner_facts(family: str):
    """The planner facts of `family`'s card (`vidray.cards.PlannerFacts`). Raises UserError when the family
    has none (it is planned by measuring: `vidray.train.plan.plan_measured`) or is unknown."""
    try:
        facts = get_card(family).planner
    except ValueError as err:
        raise UserError(str(err)) from None
    if facts is None:
        raise UserError(f"model family {family} has no planner facts in its card (its model is planned by "
                        "measuring a step)")
    return facts


def all_presets() -> dict[str, ShapePreset]:
    """{name: preset} of every registered card's planner presets, built-in families first (as listed, with
    `config_from` not yet filled in: `get_preset` does that)."""
    return {preset.name: preset for card in all_cards() if card.planner for preset in card.planner.presets}


def get_preset(name: str) -> ShapePreset:
    """The preset called `name`, its config complete: a `config_from` dict (a family's tiny transformer, imported
    here: the family module imports diffusers) with the preset's `config` laid over it. Raises UserError listing
    the presets for an unknown name, or naming a `config_from` that does not import."""
    presets = all_presets()
    try:
        preset = presets[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}; valid: {', '.join(presets)}") from None
    if preset.config_from is not None:
        module, _, attribute = preset.config_from.partition(":")
        try:
            base = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise UserError(f"preset {name!r}: config_from {preset.config_from!r} does not import: {err}") from None
        preset = ShapePreset(**{**preset.__dict__, "config": {**base, **preset.config}, "config_from": None})
    return preset


def model_preset(family: str, preset: str, text_encoder: str) -> ShapePreset:
    """The shape of a job's `init: random` model: `model.family` + `model.preset` (e.g. wan + tiny -> `wan-tiny`),
    its text width set for `model.text_encoder` (`tiny_random`: 64, `minilm`: the preset's 384). Raises UserError
    naming the valid (family, preset) pairs."""
    tiny = {card.name: card.planner.tiny_preset for card in all_cards() if card.planner and card.planner.tiny_preset}
    if preset != "tiny" or family not in tiny:
        valid = ", ".join(f"{f}/tiny" for f in tiny)
        raise UserError(f"no shape preset for model.family={family} model.preset={preset}; valid: {valid}")
    shape = get_preset(tiny[family])
    if text_encoder == "tiny_random":
        width_key = planner_facts(family).text_width_key
        shape = ShapePreset(**{**shape.__dict__, "config": {**shape.config, width_key: 64}})
    return shape


def preset_from_pretrained(path: str | Path) -> ShapePreset:
    """The shape of the transformer in a local diffusers folder: `<path>/transformer/config.json`.

    Its `_class_name` picks the family (EasyAnimateTransformer3DModel, WanTransformer3DModel or
    CogVideoXTransformer3DModel). Raises
    UserFileNotFound when the file is missing, UserError for another class or a file that is not JSON.
    Encoder sizes are left 0 (not planned) unless the class is known to go with them.
    """
    config_path = Path(path) / "transformer" / "config.json"
    if not config_path.is_file():
        raise UserFileNotFound(f"{config_path} does not exist: model.pretrained_path must be a local diffusers "
                               f"folder with transformer/config.json")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{config_path} is not a readable JSON config: {err}") from None
    families = {card.planner.transformer_class: card.name for card in all_cards() if card.planner}
    class_name = raw.get("_class_name")
    if class_name not in families:
        raise UserError(f"{config_path}: _class_name {class_name!r} is not one the planner knows; valid: "
                        f"{', '.join(families)}")
    config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if not k.startswith("_")}
    return ShapePreset(name=str(path), family=families[class_name], config=config,
                       note=f"from {config_path}")


@functools.lru_cache(maxsize=16)
def _meta_model(key: str):
    family, config_json = key.split(":", 1)
    import torch  # heavy: torch, numpy
    import diffusers  # heavy: torch, diffusers, safetensors

    config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in json.loads(config_json).items()}
    cls = getattr(diffusers, planner_facts(family).transformer_class)
    with torch.device("meta"):
        return cls(**config)


def meta_model(preset: ShapePreset):
    """The preset's transformer built on the meta device (shapes only, no memory), cached by shape.

    Raises UserError when diffusers refuses the config (the message names the preset)."""
    try:
        return _meta_model(preset.key)
    except TypeError as err:
        raise UserError(f"{preset.name}: the {planner_facts(preset.family).transformer_class} config is not one diffusers accepts: {err}") from None
