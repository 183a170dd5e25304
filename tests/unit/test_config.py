"""Job config: unknown keys, wrong types and bad choices fail at load, naming the dotted key."""

from pathlib import Path

import pytest

from vidray.config import ConfigError, JobConfig, job_config_from_dict, load_job_config
from vidray.buckets import Bucket

CONFIGS = sorted(__import__("pathlib").Path(__file__).resolve().parents[2].joinpath("jobs", "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_job_configs_load(path):
    job = load_job_config(path)
    assert isinstance(job, JobConfig)
    assert all(isinstance(b, Bucket) for b in job.data.buckets)


def test_unknown_key_names_dotted_key_and_valid_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  learnig_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as err:
        load_job_config(path)
    message = str(err.value)
    assert "unknown key 'optim.learnig_rate'" in message
    assert "lr" in message and "warmup_steps" in message


def test_unknown_section_is_refused():
    with pytest.raises(ConfigError, match=r"unknown key 'trainer'; valid: name, model, data"):
        job_config_from_dict({"trainer": {"max_steps": 3}})


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"wrong value for 'train.max_steps': 'many'"):
        load_job_config(None, ["train.max_steps=many"])


def test_bad_choice_lists_valid_choices():
    with pytest.raises(ConfigError) as err:
        load_job_config(None, ["flow.sigma_sampling=cosine"])
    assert "'flow.sigma_sampling'" in str(err.value)
    assert "'uniform' or 'logit_normal'" in str(err.value)


def test_bad_bucket_says_the_rule():
    with pytest.raises(ConfigError, match=r"num_frames must be 1 or k\*4\+1"):
        load_job_config(None, ["data.buckets=[[8, 64, 64]]"])
    with pytest.raises(ConfigError, match="multiples of 16"):
        load_job_config(None, ["data.buckets=[[9, 60, 64]]"])


@pytest.mark.parametrize("bucket, rule", [("[8, 64, 64]", r"num_frames must be 1 or k\*4\+1"),
                                          ("[9, 64, 40]", "multiples of 16")])
def test_a_wan_bucket_breaking_the_wan_rule_fails_at_load(bucket, rule):
    load_job_config(None, ["model.family=wan", "data.buckets=[[9, 64, 48], [1, 32, 32]]"])  # 4k+1, 16-multiples
    with pytest.raises(ConfigError, match=rule) as err:
        load_job_config(None, ["model.family=wan", f"data.buckets=[{bucket}]"])
    assert "the rule of model.family=wan" in str(err.value)


@pytest.mark.parametrize("bucket, rule", [("[5, 64, 64]", r"num_frames must be 1 or k\*8\+1"),
                                          ("[9, 64, 40]", "multiples of 16")])
def test_a_cogvideox_bucket_breaking_the_cogvideox_rule_fails_at_load(bucket, rule):
    """CogVideoX takes 8k+1 frames, not EasyAnimate's and Wan's 4k+1: its VAE decodes odd latent counts only."""
    load_job_config(None, ["model.family=cogvideox", "data.buckets=[[17, 64, 48], [1, 32, 32]]"])
    with pytest.raises(ConfigError, match=rule) as err:
        load_job_config(None, ["model.family=cogvideox", f"data.buckets=[{bucket}]"])
    assert "the rule of model.family=cogvideox" in str(err.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="train.max_steps must be >= 1"):
        load_job_config(None, ["train.max_steps=0"])
    with pytest.raises(ConfigError, match="pretrained_path"):
        load_job_config(None, ["model.init=pretrained"])


def test_overrides_parse_yaml_values_and_round_trip():
    job = load_job_config(None, ["optim.lr=3e-4", "scaling.use_gpu=true", "data.buckets=[[17, 32, 48]]"])
    assert job.optim.lr == pytest.approx(3e-4)
    assert job.scaling.use_gpu is True
    assert job.data.buckets == [Bucket(17, 32, 48)]
    assert job_config_from_dict(job.to_dict()) == job


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_job_config(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="wrong value for 'name'"):
        load_job_config(None, ["name.x=1"])
    with pytest.raises(FileNotFoundError, match="jobs/configs"):
        load_job_config(tmp_path / "nope.yaml")


def test_run_name_num_to_keep_bucket_arity_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="plain folder name"):
        load_job_config(None, ["name=../../etc"])
    with pytest.raises(ConfigError, match=r"num_to_keep must be >= 1 or null"):
        load_job_config(None, ["checkpoint.num_to_keep=0"])
    with pytest.raises(ConfigError, match=r"a bucket is \[num_frames, height, width\]"):
        load_job_config(None, ["data.buckets=[[9, 64]]"])
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_job_config(empty)


@pytest.mark.parametrize("override, message", [
    ("train.grad_clip_norm=-1", r"train.grad_clip_norm must be > 0 or null \(no clipping\), got -1: a negative"),
    ("train.grad_clip_norm=0", r"train.grad_clip_norm must be > 0 or null"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay must be >= 0, got -0.1"),
    ("optim.eps=0", r"optim.eps must be > 0, got 0 \(default 1e-8\)"),
    ("optim.betas=[0.9, 1.0]", r"optim.betas must each be in \[0, 1\), got \[0.9, 1.0\]"),
    ("optim.betas=[-0.1, 0.9]", r"optim.betas must each be in \[0, 1\)"),
    ("optim.warmup_steps=-1", r"optim.warmup_steps must be >= 0"),
    ("flow.logit_std=0", r"flow.logit_std must be > 0, got 0 \(default 1.0\)"),
    ("flow.num_train_timesteps=0", r"flow.num_train_timesteps must be >= 1, got 0"),
    ("train.max_failures=-2", r"train.max_failures must be >= 0, or -1 to retry forever, got -2"),
    ("train.seed=-1", r"train.seed must be >= 0, got -1"),
    ("data.block_batches=0", r"data.block_batches must be >= 1 micro-batches per Ray Data block .* got 0"),
    ("data.fps=.nan", r"'data.fps': nan is not a finite number"),
    ("optim.lr=.inf", r"'optim.lr': inf is not a finite number"),
    # bounds written in the settings' types (vidray.config.bounds), each message from the type alone
    ("placement.vae.num_cpus=0", r"placement.vae.num_cpus must be > 0 logical CPUs \(default 0.1\), got 0: Ray Data"),
    ("train.metrics_port=0", r"train.metrics_port must be in \[1, 65471\] or null \(rank N serves on"),
    ("model.experts={boundary_ratio: 1.0}", r"model.experts.boundary_ratio must be in \(0, 1\) \(the high-noise"),
    ("vae_training.batch_size_per_worker=0", r"vae_training.batch_size_per_worker must be >= 1 or null, got 0"),
    ("train.ema={decay: 1.0}", r"train.ema.decay must be in \(0, 1\), got 1.0 \(e.g. 0.9999\)"),
])
def test_out_of_range_values_are_refused_naming_key_and_range(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, [override])


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=true", r"'train.max_steps': true is a boolean, not a number; give a number, e.g. 100"),
    ("optim.lr=false", r"'optim.lr': false is a boolean, not a number"),
    ("train.grad_clip_norm=true", r"'train.grad_clip_norm': true is a boolean, not a number"),
    ("optim.betas=[true, 0.9]", r"'optim.betas': \[True, 0.9\] holds a boolean"),
    ("scaling.use_gpu=1", r"'scaling.use_gpu': 1 is not a boolean; give true or false"),
    ("data.split_scenes='yes'", r"'data.split_scenes': 'yes' is not a boolean; give true or false"),
])
def test_booleans_and_numbers_are_not_interchangeable(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, [override])


def test_valid_edge_values_are_accepted():
    job = load_job_config(None, ["train.grad_clip_norm=null", "optim.weight_decay=0", "optim.betas=[0, 0.99]",
                                 "train.max_failures=-1", "scaling.use_gpu=false", "optim.lr=1"])
    assert (job.train.grad_clip_norm, job.optim.betas, job.train.max_failures, job.optim.lr) == (None, (0.0, 0.99), -1, 1.0)


def test_max_sequence_length_above_the_text_encoder_limit_is_refused_on_the_driver(tmp_path):
    import json

    from vidray.models.text_encoder import check_max_sequence_length, text_encoder_max_tokens

    job = load_job_config(None, ["model.max_sequence_length=1000"])  # the config alone cannot know the limit
    assert text_encoder_max_tokens(job.model) == 512  # MiniLM's max_position_embeddings
    with pytest.raises(ConfigError, match=r"model.max_sequence_length 1000 is above the text encoder's limit of 512 "
                                          r"tokens \(minilm\); set model.max_sequence_length <= 512"):
        check_max_sequence_length(job.model)
    check_max_sequence_length(load_job_config(None, ["model.max_sequence_length=512"]).model)
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    pretrained = load_job_config(None, ["model.init=pretrained", f"model.pretrained_path={tmp_path}",
                                        "model.max_sequence_length=100"]).model
    with pytest.raises(ConfigError, match="limit of 64 tokens"):
        check_max_sequence_length(pretrained)


@pytest.mark.parametrize("given, expected", [("off", "off"), ("no", "off"), ("false", "off"), ("null", "off"),
                                             ("on", "auto"), ("true", "auto"), ("auto", "auto"),
                                             ("s3://b/latents", "s3://b/latents")])
def test_latent_cache_words_yaml_reads_as_booleans_keep_their_meaning(given, expected):
    assert load_job_config(None, [f"data.latent_cache={given}"]).data.latent_cache == expected


@pytest.mark.parametrize(("override", "message"), [
    # A new user's trial: "wrong value for 'optim.betas.1': [0.9] (Field required)", a key no one can set
    ("optim.betas=[0.9]", "'optim.betas' must be a list of 2 values, got [0.9]"),
    ("optim.betas=[0.9, 0.99, 0.5]", "'optim.betas' must be a list of 2 values, got [0.9, 0.99, 0.5]"),
    ("optim.betas=[0.9, x]", "wrong value 'x' for 'optim.betas' (value 2 of 2): Input should be a valid number"),
    # ... and "wrong value for 'train.max_steps': None" where the user typed nothing
    ("train.max_steps=", "'train.max_steps' is empty (an empty YAML value or `train.max_steps=` override reads as "
                         "null): give it a value"),
    ("name=", "'name' is empty"),
])
def test_list_settings_of_a_fixed_length_and_empty_values_are_named_as_the_user_wrote_them(override, message):
    with pytest.raises(ConfigError) as err:
        load_job_config(None, [override])
    assert message in str(err.value)
    assert "betas.1" not in str(err.value) and "None" not in str(err.value)


def test_a_cogvideox_job_with_another_number_of_train_timesteps_fails_at_load():
    """CogVideoX's DDIM schedule has 1000 steps: a job saying otherwise is refused before anything is built."""
    with pytest.raises(ConfigError, match="flow.num_train_timesteps is 500, but model.family: cogvideox .* set "
                                          "flow.num_train_timesteps: 1000"):
        load_job_config(Path(__file__).resolve().parents[2] / "jobs/configs/cogvideox_t2v_tiny.yaml",
                        ["flow.num_train_timesteps=500"])


def test_validation_prompts_without_every_steps_fail_at_load_naming_both_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  validation:\n    prompts: [\"a red kite over a beach\"]\n")
    with pytest.raises(ConfigError) as err:
        load_job_config(path)
    message = str(err.value)
    assert "train.validation.prompts" in message and "train.validation.every_steps" in message
    assert "\n" not in message.strip()
    # With the cadence set the same prompts load; without prompts no cadence is needed.
    job = load_job_config(path, ["train.validation.every_steps=50", "checkpoint.every_steps=50"])
    assert job.train.validation.prompts == ["a red kite over a beach"]
    assert load_job_config(None).train.validation.prompts == []
