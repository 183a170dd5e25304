"""Job config: unknown keys, wrong types and bad choices fail at load, naming the dotted key."""

import pytest

from vidray.config import ConfigError, JobConfig, job_config_from_dict, load_job_config
from vidray.data.buckets import Bucket

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
