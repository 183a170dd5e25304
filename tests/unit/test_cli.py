"""The `vidray` command line: real subprocesses of the installed console script where the exit status and stderr
are the behaviour (version, prepare on samples/, a user error vs a bug), and `main()` in-process otherwise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import vidray
from vidray.cli import main
from vidray.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
VIDRAY = Path(sys.executable).parent / "vidray"


def _run(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def config(tmp_path) -> Path:
    """A job config that prepares samples/ into tmp_path (absolute paths: runs from any working directory)."""
    raw = yaml.safe_load((REPO / "jobs" / "configs" / "tiny_t2v.yaml").read_text())
    raw["data"]["source"] = str(REPO / "samples" / "metadata.json")
    raw["data"]["shards_dir"] = str(tmp_path / "shards")
    raw["storage"]["path"] = str(tmp_path / "runs")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_version_prints_the_package_version():
    result = _run(str(VIDRAY), "--version", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"vidray {vidray.__version__}"


def test_prepare_on_samples_writes_an_index_and_prints_the_summary(config, tmp_path):
    result = _run(str(VIDRAY), "prepare", str(config), "data.buckets=[[9,64,64],[1,64,64]]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    listed = json.loads((REPO / "samples" / "metadata.json").read_text())
    assert index["num_samples"] == len(listed) == 6  # every sample clip and still is kept
    assert "Prepared 6 of 6 files" in result.stdout
    assert "Traceback" not in result.stderr
    assert "[1/6] kept" in result.stdout and "prepare:" not in result.stderr  # no terminal: plain lines, no bar


def _run_in_pty(*args: str, cwd: Path, timeout: float = 120) -> tuple[int, str]:
    """Run a command with a pseudo-terminal as its stdin, stdout and stderr (as a user's shell does); returns
    (exit status, everything it wrote, decoded)."""
    import pty
    import select
    import time

    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 40 rows, 160 columns
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("VIDRAY_PROGRESS", None)
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the command ended and closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_prepare_on_a_terminal_draws_a_progress_bar_above_which_the_file_lines_stay(config, tmp_path):
    status, out = _run_in_pty(str(VIDRAY), "prepare", str(config), cwd=tmp_path)
    assert status == 0, out[-3000:]
    assert "prepare: 100%" in out and "6/6" in out and "kept=6" in out, out[-3000:]
    assert "[1/6] kept" in out and "Prepared 6 of 6 files" in out


def test_config_error_prints_one_line_and_exits_2(config, tmp_path):
    result = _run(str(VIDRAY), "prepare", str(config), "data.shard_dir=x", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("vidray prepare: error: ") and "data.shard_dir" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "shards").exists()


def test_a_valueerror_from_a_bug_shows_its_traceback_and_exits_1(config, tmp_path):
    script = (
        "import sys, vidray.data.ingest as ingest, vidray.cli as cli\n"
        "def buggy(*args, **kwargs):\n"
        "    raise ValueError('internal invariant broken')\n"
        "ingest.prepare_data = buggy\n"
        f"sys.exit(cli.main(['prepare', {str(config)!r}]))\n"
    )
    result = _run(sys.executable, "-c", script, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ValueError: internal invariant broken" in result.stderr and "in buggy" in result.stderr
    assert "vidray prepare: error:" not in result.stderr


def test_main_lets_bugs_propagate_and_turns_user_errors_into_exit_2(config, monkeypatch, capsys):
    import vidray.data.ingest as ingest

    def bug(*args, **kwargs):
        raise ValueError("bug")

    monkeypatch.setattr(ingest, "prepare_data", bug)
    with pytest.raises(ValueError, match="bug"):
        main(["prepare", str(config)])
    for err in (KeyError("k"), TypeError("t"), FileNotFoundError("/internal/file")):
        monkeypatch.setattr(ingest, "prepare_data", lambda *a, _err=err, **k: (_ for _ in ()).throw(_err))
        with pytest.raises(type(err)):
            main(["prepare", str(config)])

    def user_error(*args, **kwargs):
        raise ConfigError("data.fps must be > 0 frames/s, got 0")

    monkeypatch.setattr(ingest, "prepare_data", user_error)
    assert main(["prepare", str(config)]) == 2
    assert capsys.readouterr().err == "vidray prepare: error: data.fps must be > 0 frames/s, got 0\n"


def test_missing_source_file_is_a_user_error(config, capsys):
    assert main(["prepare", str(config), "data.source=/nonexistent/metadata.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidray prepare: error: source /nonexistent/metadata.json does not exist")
    assert err.count("\n") == 1


@pytest.mark.parametrize("override, problem", [
    ("data.buckets=[[17,64,64]", "expected ',' or ']'"),  # a new user's trial: a YAML traceback and exit 1
    ("name=a: b: c", "mapping values are not allowed here"),
])
def test_an_override_whose_value_is_not_yaml_is_one_line_naming_it_and_exits_2(config, capsys, override, problem):
    assert main(["train", str(config), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vidray train: error: override {override!r}: the value is not valid YAML ({problem}")
    assert err.count("\n") == 1


def test_missing_config_file_is_a_user_error(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidray train: error: ") and "nope.yaml" in err


def test_a_folder_given_as_the_config_is_named_a_folder_not_missing(capsys):
    # The reported case (a new user's trial): `vidray prepare jobs/configs` said the folder does not exist.
    assert main(["prepare", str(REPO / "jobs" / "configs")]) == 2
    err = capsys.readouterr().err
    assert "is a folder, not a YAML file" in err and "animatediff_t2v_tiny.yaml" in err and err.count("\n") == 1


def test_generate_argument_errors_exit_2_naming_each_argument(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", " ", "--output", str(tmp_path / "o.gif"),
                 "--num-inference-steps", "0", "--guidance-scale", "0.5", "--seed", "-1", "--bucket", "9x60x64"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vidray generate: error: ") and err.count("\n") == 1
    for name in ("--prompt", "--output", "--num-inference-steps", "--guidance-scale", "--seed", "--bucket", "--model"):
        assert name in err, name


def test_generate_argument_errors_answer_before_torch_is_imported(tmp_path):
    script = (
        "import sys\n"
        "from vidray.cli import main\n"
        f"code = main(['generate', '--model', {str(tmp_path)!r}, '--prompt', 'a', '--output', 'o.mp4', '--fps', '0'])\n"
        "heavy = sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)\n"
        "print('heavy modules:', heavy)\n"
        "sys.exit(code)\n"
    )
    result = _run(sys.executable, "-c", script, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "heavy modules: []" in result.stdout
    assert "--fps must be a finite frame rate" in result.stderr and "is neither a diffusers folder" in result.stderr


@pytest.mark.parametrize("command", [["prepare", "--encode"], ["encode"]])
@pytest.mark.parametrize("overrides, words", [
    (["data.latent_cache=off"], ["data.latent_cache is 'off'"]),
    # a new user's trial: a file as the cache folder failed inside Ray with a traceback
    (["data.latent_cache=/etc/hostname"], ["data.latent_cache /etc/hostname cannot be created", "is a file"]),
    # a new user's trial: `prepare --encode` prepared, started Ray, then waited forever for 16 CPUs on 4
    (["placement.vae.num_cpus=8", "placement.text.num_cpus=8"],
     ["needs 16.5 CPUs", "placement.vae.num_cpus", "the local Ray cluster vidray starts here has"]),
])
def test_encode_checks_cache_and_resources_before_preparing_or_starting_ray(config, tmp_path, capsys, command,
                                                                           overrides, words):
    assert main([command[0], str(config), *overrides, *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vidray {command[0]}: error: ") and all(w in err for w in words), err
    assert not (tmp_path / "shards").exists()  # nothing prepared


def test_encode_without_prepared_shards_says_run_prepare_before_starting_ray(config, tmp_path, capsys):
    assert main(["encode", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"no prepared shards in {tmp_path / 'shards'}" in err and "vidray prepare" in err, err


def test_help_describes_every_command_in_a_whole_sentence(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("shard video clips (and encode them into the latent cache), train a video diffusion model on Ray, sample "
            "from it, check a machine, job and cluster before a run.") in text


def test_overrides_may_follow_a_flag_and_keep_their_order_and_other_extras_are_refused(capsys):
    # A new user's trial: `vidray train CONFIG a=1 --prepare b=2` called b=2 an unrecognized argument.
    from vidray.cli import parse_args

    args = parse_args(["train", "c.yaml", "train.max_steps=1", "--prepare", "train.max_steps=2", "name=x"])
    assert args.prepare and args.config == "c.yaml"
    assert args.overrides == ["train.max_steps=1", "train.max_steps=2", "name=x"]  # the last one wins, as typed
    args = parse_args(["prepare", "c.yaml", "--encode", "data.fps=4"])
    assert args.encode and args.overrides == ["data.fps=4"]
    for argv, extra in ((["train", "c.yaml", "--prepare", "--bogus"], "--bogus"),
                        (["generate", "--model", "m", "--prompt", "p", "--output", "o.mp4", "a=1"], "a=1"),
                        (["train", "c.yaml", "--prepare", "stray"], "stray")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"vidray: error: unrecognized arguments: {extra}"


def test_the_ray_job_submit_entry_point_takes_overrides_on_both_sides_of_prepare(tmp_path):
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "jobs/train.py"), "--config", str(tmp_path / "none.yaml"),
                           "a=1", "--prepare", "b=2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2  # the config is missing: argparse accepted the arguments
    assert done.stderr.strip().splitlines()[-1] == (f"vidray train: error: job config {tmp_path / 'none.yaml'} does "
                                                    "not exist; the examples live in jobs/configs/")
