"""The encoders' identities remembered in the latent cache (`vidray.data.identities`): one key per set of inputs
the built encoder depends on, read back only for the same inputs, and the identity task's answer remembered."""

from __future__ import annotations

import dataclasses
import os

from vidray.config import FlowConfig, ModelConfig
from vidray.data.encode import text_identity, vae_identity
from vidray.data.identities import identity_task, memo_key, model_files_signature, read_identity, write_identity
from vidray.models import get_family

MODEL = dataclasses.asdict(ModelConfig(text_encoder="tiny_random", max_sequence_length=16))


def test_the_key_changes_with_every_input_the_encoder_depends_on():
    key = memo_key("vae", MODEL, 0)
    assert key == memo_key("vae", dict(MODEL), 0) and key.startswith("vae-")
    others = [memo_key("text", MODEL, 0), memo_key("vae", MODEL, 1),
              memo_key("vae", {**MODEL, "max_sequence_length": 32}, 0),
              memo_key("vae", MODEL, 0, files='[["a.safetensors", 1, 2]]')]
    assert len({key, *others}) == 5


def test_a_rewritten_pretrained_file_is_another_key(tmp_path):
    family = get_family("easyanimate")
    folder = tmp_path / "model"
    family.save_pipeline(family.build(ModelConfig(**MODEL), seed=5), folder, FlowConfig())
    pretrained = {**MODEL, "init": "pretrained", "pretrained_path": str(folder)}
    before = memo_key("vae", pretrained, 0)
    weights = next((folder / "vae").glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # `vidray train-vae` wrote it again
    assert model_files_signature(pretrained) and memo_key("vae", pretrained, 0) != before


def test_a_remembered_identity_reads_back_and_a_damaged_one_is_a_miss(tmp_path):
    cache, key, identity = str(tmp_path), memo_key("vae", MODEL, 0), "ab" * 32
    assert read_identity(cache, key) is None
    write_identity(cache, key, identity)
    assert read_identity(cache, key) == identity
    assert read_identity(cache, memo_key("vae", MODEL, 1)) is None
    (tmp_path / "identities" / f"{key}.json").write_text('{"identity": "ab')  # half written
    assert read_identity(cache, key) is None
    (tmp_path / "identities" / f"{key}.json").write_text('{"identity": "not a sha256"}')
    assert read_identity(cache, key) is None


def test_the_identity_task_answers_the_encoders_identity_and_remembers_it(tmp_path):
    for stage, compute in (("vae", vae_identity), ("text", text_identity)):
        key = memo_key(stage, MODEL, 0)
        answer = identity_task(stage, MODEL, 0, str(tmp_path), key)
        assert answer == compute(MODEL, 0) and read_identity(str(tmp_path), key) == answer
    assert identity_task("vae", MODEL, 0, "", "unused") == vae_identity(MODEL, 0)  # no cache: nothing written
