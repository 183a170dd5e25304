"""`vidray doctor`: real checks of this machine, a job config (real prepared shards and a real checkpoint) and the
local cluster `vidray train` would start, printed as findings with a fix; exit 1 on any FAIL. The joined-cluster
path (RAY_ADDRESS, node labels) is in tests/integration/test_job_submit.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vidray.cli import main
from vidray.config import load_job_config
from vidray.data.ingest import prepare_data
from vidray.data.index import dataset_hash
from vidray.train.checkpoint import TrainState, save_checkpoint

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "jobs/configs/tiny_t2v.yaml")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doctor")
    job = load_job_config(CONFIG, [f"data.shards_dir={root / 'shards'}"])
    assert prepare_data(job.data, progress=None).num_kept == 6
    return root / "shards"


def doctor(capsys, *argv: str) -> tuple[int, dict[str, list[str]]]:
    """Run `vidray doctor ARGV`; (exit status, {topic: ["level message", ...]})."""
    code = main(["doctor", *argv])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("vidray doctor: ")
    findings: dict[str, list[str]] = {}
    for line in out[:-1]:
        level, rest = line.split(None, 1)
        topic, message = rest.split(": ", 1)
        assert level in ("ok", "warn", "FAIL"), line
        findings.setdefault(topic, []).append(f"{level} {message}")
    return code, findings


def test_machine_alone_reports_libraries_devices_and_the_local_cluster(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, found = doctor(capsys)
    assert code == 0
    assert found["torch"][0].startswith(f"ok {torch.__version__}")
    assert found["av"] == [found["av"][0]] and "libx264" in found["av"][0]
    assert found["ray"][0].startswith("ok 2.60")
    assert "local Ray cluster" in found["cluster"][0] and "127.0.0.1" in found["cluster"][0]
    assert set(found) == {"python", "torch", "ray", "diffusers", "av", "cluster"}


def test_unprepared_job_warns_to_run_prepare_and_checks_its_outputs(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, found = doctor(capsys, CONFIG, f"data.shards_dir={tmp_path / 'none'}", f"storage.path={tmp_path / 'runs'}")
    assert code == 0
    assert found["data.shards_dir"] == [f"warn {tmp_path / 'none'} holds no prepared shards (no index.json): run "
                                        "`vidray prepare CONFIG` (or `vidray train --prepare`)"]
    assert found["data.source"][0].startswith("ok ") and "6 file(s) listed" in found["data.source"][0]
    assert found["storage.path"] == [f"ok {tmp_path / 'runs'}: writable"]
    assert found["resources"][0].startswith("ok ")


def test_prepared_job_says_where_train_starts_and_fails_on_what_train_would_refuse(capsys, monkeypatch, shards,
                                                                                   tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = [CONFIG, f"data.shards_dir={shards}", f"storage.path={tmp_path}", "name=doc", "train.max_steps=10"]
    code, found = doctor(capsys, *base)
    assert code == 0
    assert found["data.shards_dir"] == [f"ok {shards}: 6 sample(s) in 2 shard(s), buckets [[9, 64, 64], [1, 64, 64]]"]
    assert found["train"] == ["ok `vidray train` starts at step 1"]

    # A checkpoint at step 4 of this job: train resumes from it (and says which settings changed).
    job = load_job_config(CONFIG, base[1:])
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path / "doc" / "checkpoint_000004", model=model, optimizer=optimizer,
                    lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                    job_config=job.to_dict(),
                    train_state=TrainState(4, 0, 2, 2, "sha256:x", None, dataset_hash(str(shards)), 6))
    code, found = doctor(capsys, *base, "optim.lr=0.0005")
    assert code == 0
    [train] = found["train"]
    # `vidray train`'s own lines: the checkpoint it resumes from and the setting that changed
    assert train.startswith(f"ok resuming from {tmp_path / 'doc' / 'checkpoint_000004'} (the run's latest "
                            "checkpoint) at step 4")
    assert "optim.lr: 0.001 -> 0.0005" in train

    # What train would refuse is a FAIL with train's own message; so are resources the local cluster lacks.
    code, found = doctor(capsys, *base, "train.max_steps=4", "scaling.use_gpu=true")
    assert code == 1
    assert found["train"][0].startswith("FAIL `vidray train` would refuse: ") and "max_steps" in found["train"][0]
    assert found["resources"][0].startswith("FAIL scaling.use_gpu=true with 2 workers needs 2 GPUs")


def test_a_config_that_does_not_load_is_a_fail_and_the_other_checks_still_run(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, found = doctor(capsys, CONFIG, "train.max_stepz=3")
    assert code == 1
    assert found["config"][0].startswith("FAIL ") and "max_stepz" in found["config"][0]
    assert found["torch"][0].startswith("ok ") and found["cluster"][0].startswith("ok ")
    assert main(["doctor", "train.max_steps=3"]) == 1  # an override alone is read as the config: not found
    assert "FAIL" in capsys.readouterr().out


def test_a_run_another_driver_is_training_is_a_fail(capsys, monkeypatch, shards, tmp_path):
    from vidray.train.trainer import run_folder_lock

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = [CONFIG, f"data.shards_dir={shards}", f"storage.path={tmp_path}", "name=busy"]
    with run_folder_lock(load_job_config(CONFIG, argv[1:])):  # as a training driver holds it
        code, found = doctor(capsys, *argv)
    assert code == 1
    assert found["train"] == [f"FAIL `vidray train` would refuse: another `vidray train` is training the run "
                              f"{tmp_path / 'busy'} (it holds .vidray-train.lock): its checkpoints would be "
                              "overwritten. Wait for it to finish, or give this run another name (name=busy-2)"]
    code, found = doctor(capsys, *argv)  # released: train starts
    assert code == 0 and found["train"] == ["ok `vidray train` starts at step 1"]


def test_prepared_job_still_checks_its_outputs_missing_source_files_and_the_source_it_was_prepared_from(
        capsys, monkeypatch, shards, tmp_path):
    # A new user's trial: with the shards prepared, storage.path had no line of its own (an unwritable one showed
    # only inside the `train` line), a source listing a missing file read "ok", and so did a data.source other
    # than the one the shards were prepared from.
    import json

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = [CONFIG, f"data.shards_dir={shards}", "name=doc2"]
    code, found = doctor(capsys, *base, f"storage.path={tmp_path / 'runs'}")
    assert code == 0
    assert found["storage.path"] == [f"ok {tmp_path / 'runs'}: writable"]
    source = load_job_config(CONFIG).data.source  # as the config writes it
    assert found["data.source"] == [f"ok {source}: 6 file(s) listed"]

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, found = doctor(capsys, *base, f"storage.path={blocker / 'runs'}")
    assert code == 1
    assert found["storage.path"] == [f"FAIL storage.path {blocker / 'runs'} cannot be created: {blocker} is a file, "
                                     "not a folder; choose another storage.path"]
    assert "train" not in found  # the same refusal once, on its own line

    entries = json.loads((REPO / "samples/metadata.json").read_text())
    for entry in entries:
        entry["file_path"] = str(REPO / "samples" / entry["file_path"])
    entries.append({"file_path": str(tmp_path / "gone.mp4"), "text": "gone", "type": "video"})
    other = tmp_path / "other.json"
    other.write_text(json.dumps(entries))
    code, found = doctor(capsys, *base, f"storage.path={tmp_path / 'runs'}", f"data.source={other}")
    assert code == 0
    assert found["data.source"] == [
        f"warn {other}: 7 file(s) listed, 1 missing (e.g. {tmp_path / 'gone.mp4'}): `vidray prepare` skips and "
        "reports them; fix the paths to keep them",
        f"warn the shards in {shards} were prepared from {os.path.abspath(source)}, not {other}: `vidray "
        "train` trains on the shards as they are; run `vidray prepare` to train on data.source's files"]


def test_an_object_store_that_does_not_answer_is_a_fail_per_location_not_a_traceback(capsys, monkeypatch):
    # A new user's trial: with AWS_ENDPOINT_URL mistyped, the doctor died in an OSError traceback (its docstring
    # says it never raises), and a storage.path in a missing bucket read "ok".
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("vidray.storage.S3_MAX_ATTEMPTS", 1)
    code, found = doctor(capsys, CONFIG, "data.shards_dir=s3://b/shards", "storage.path=s3://b/runs")
    assert code == 1
    for key, uri in (("data.shards_dir", "s3://b/shards"), ("storage.path", "s3://b/runs"),
                     ("data.latent_cache", "s3://b/shards/latents")):
        assert len(found[key]) == 1 and found[key][0].startswith(f"FAIL {key} {uri}: cannot reach the object store ")
        assert found[key][0].endswith("check the endpoint (http://127.0.0.1:1, from AWS_ENDPOINT_URL), the network "
                                      "and the credentials")
    assert found["data.source"][0].startswith("ok ") and "cluster" in found  # the other checks still ran


def test_an_s3_storage_path_in_a_missing_bucket_is_a_fail(capsys, monkeypatch, s3_env, shards):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, found = doctor(capsys, CONFIG, f"data.shards_dir={shards}", "storage.path=s3://nobucket-x/runs",
                         "name=doc3")
    assert code == 1
    assert found["storage.path"] == [f"FAIL storage.path s3://nobucket-x/runs: bucket 'nobucket-x' does not exist (or "
                                     f"these credentials cannot see it) at {s3_env}, from AWS_ENDPOINT_URL; create "
                                     "the bucket or fix the URI"]
    code, found = doctor(capsys, CONFIG, f"data.shards_dir={shards}", "storage.path=s3://vidray-test/doc3-runs",
                         "name=doc3")
    assert found["storage.path"] == ["ok s3://vidray-test/doc3-runs: the store answers, the bucket exists, a probe "
                                     "object was written and deleted"]



def test_a_ray_address_where_nothing_listens_is_a_fail_within_seconds_not_a_hang(capsys, monkeypatch):
    # A new user's trial: RAY_ADDRESS at a port where no head listens made the doctor retry for ever (one round every
    # ~41 s), deaf to Ctrl-C and SIGTERM.
    import time

    port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    start = time.monotonic()
    code, found = doctor(capsys)
    assert code == 1 and time.monotonic() - start < 30
    assert found["cluster"] == [f"FAIL RAY_ADDRESS=127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} "
                                "(Connection refused); check the address (`ray status` on the head prints it) and "
                                "that the head is running, or unset RAY_ADDRESS to start a local cluster"]
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # the form `ray job submit` takes
    code, found = doctor(capsys)
    assert code == 1 and found["cluster"][0].startswith("FAIL RAY_ADDRESS=http://127.0.0.1:8265 is the dashboard's "
                                                        "job API")
    assert "ray://127.0.0.1:10001" in found["cluster"][0]


def test_check_ray_address_lets_a_listening_port_and_addresses_it_cannot_parse_through():
    import socket

    from vidray.errors import UserError
    from vidray.runtime import check_ray_address

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        check_ray_address(f"127.0.0.1:{port}")
        check_ray_address(f"ray://127.0.0.1:{port}")
    check_ray_address("auto")  # Ray finds the local head itself
    with pytest.raises(UserError, match=r"^RAY_ADDRESS=ray://127.0.0.1:\d+: nothing answers"):
        check_ray_address(f"ray://127.0.0.1:{port}")


def test_the_ray_token_line_follows_rays_token_sources(capsys, monkeypatch, tmp_path):
    # A new user's trial: the doctor said to copy "the cluster's token" when the head had been started without auth.
    from vidray.doctor import _check_ray_token

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    assert _check_ray_token() == []  # no token auth asked for: nothing to say
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    [finding] = _check_ray_token()
    assert finding.level == "warn" and str(finding) == (
        f"warn  ray auth: RAY_AUTH_MODE=token but there is no token ({tmp_path}/.ray/auth_token does not exist, "
        "RAY_AUTH_TOKEN is unset): copy the token of the cluster's head there; a head started without "
        "RAY_AUTH_MODE=token has none, and then this client must unset RAY_AUTH_MODE")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 32)
    assert [f.level for f in _check_ray_token()] == ["ok"]
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    assert _check_ray_token()[0].level == "warn" and str(tmp_path / "missing") in _check_ray_token()[0].message
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    assert str(_check_ray_token()[0]) == "ok    ray auth: RAY_AUTH_MODE=token, token from RAY_AUTH_TOKEN"


def test_the_same_source_list_at_another_path_is_no_warning_and_an_edited_one_is(capsys, monkeypatch, tmp_path):
    # A new user's trial: after the README's `ray job submit --prepare`, whose job read samples/metadata.json in
    # Ray's temporary working dir, every doctor warned that the shards came from another source.
    import json
    import shutil

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    copy = tmp_path / "working_dir" / "samples"
    shutil.copytree(REPO / "samples", copy)
    job = load_job_config(CONFIG, [f"data.source={copy / 'metadata.json'}", f"data.shards_dir={tmp_path / 'shards'}"])
    assert prepare_data(job.data, progress=None).num_kept == 6
    shutil.rmtree(tmp_path / "working_dir")  # as Ray deletes a job's working dir
    base = [CONFIG, f"data.shards_dir={tmp_path / 'shards'}", f"storage.path={tmp_path / 'runs'}", "name=doc4"]
    code, found = doctor(capsys, *base)  # data.source: the repository's samples/metadata.json, the same bytes
    assert code == 0 and [line.split()[0] for line in found["data.source"]] == ["ok"], found["data.source"]

    shutil.copytree(REPO / "samples", tmp_path / "s2")
    edited = tmp_path / "s2" / "metadata.json"
    job = load_job_config(CONFIG, [f"data.source={edited}", f"data.shards_dir={tmp_path / 'shards2'}"])
    assert prepare_data(job.data, progress=None).num_kept == 6
    entries = json.loads(edited.read_text())
    edited.write_text(json.dumps(entries[:5]))  # one clip fewer since the prepare
    code, found = doctor(capsys, CONFIG, f"data.shards_dir={tmp_path / 'shards2'}", f"data.source={edited}",
                         f"storage.path={tmp_path / 'runs'}", "name=doc4")
    assert found["data.source"][-1] == (
        f"warn {edited} changed since the shards in {tmp_path / 'shards2'} were prepared from it: `vidray train` "
        "trains on the shards as they are; run `vidray prepare` to train on its files now")


def test_an_error_with_a_remote_traceback_is_one_line_with_its_first_and_last_lines():
    # A new user's trial: a ray:// join that the head's client server failed put Ray's whole traceback in a FAIL line.
    from vidray.doctor import _one_line

    text = ("Initialization failure from server:\nTraceback (most recent call last):\n  File \"proxier.py\", line 772, "
            "in Datapath\n    raise RuntimeError(\nRuntimeError: Starting Ray client server failed. See "
            "ray_client_server_23000.err for detailed logs.\n.")
    assert _one_line(text) == ("Initialization failure from server: ... RuntimeError: Starting Ray client server "
                               "failed. See ray_client_server_23000.err for detailed logs.")
    assert _one_line("Failed to connect.") == "Failed to connect."


def test_without_shards_the_validation_prompts_are_still_checked(capsys, monkeypatch, tmp_path):
    # No shards folder at all: the checks that need no shard (the text encoder's limit, the validation prompts'
    # token counts) still run, as `vidray train` would run them first.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = [CONFIG, f"data.shards_dir={tmp_path / 'no_such_folder'}", f"storage.path={tmp_path / 'runs'}",
            "model.text_encoder=tiny_random", "model.max_sequence_length=16", "train.validation.every_steps=50",
            "checkpoint.every_steps=50"]
    assert not (tmp_path / "no_such_folder").exists()
    code, found = doctor(capsys, *base, "train.validation.prompts=[\"a kite\", \"" + "very " * 40 + "long\"]")
    assert code == 1
    [train] = found["train"]
    assert train.startswith("FAIL `vidray train` would refuse: train.validation.prompts[1] ")
    assert "longer than model.max_sequence_length=16" in train
    assert found["data.shards_dir"][0].startswith("warn ") and "no prepared shards" in found["data.shards_dir"][0]

    code, found = doctor(capsys, *base, "train.validation.prompts=[\"a kite\"]")
    assert code == 0
    assert found["train"][0].startswith("ok ") and "validation prompts" in found["train"][0]
    assert not (tmp_path / "no_such_folder").exists()
