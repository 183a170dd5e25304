"""Resume faults with real 2-worker Ray Train runs: a diverged run stops without retries or checkpoints, and Ctrl-C
stops `vidray train` within seconds leaving no process behind. Changed settings taking effect on resume and the
recovery from a damaged checkpoint are the loop's and the driver's behaviour: tests/unit/test_worker.py runs them in
process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import noise_in
from vidray.config import load_job_config
from vidray.train.step import NonFiniteTrainingError
from vidray.train.trainer import run_training

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def job(shards_dir, storage, *overrides: str):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", "name=resume", "model.text_encoder=tiny_random",
        "optim.warmup_steps=0", *overrides,
    ])


def pids_mentioning(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains `marker` (our unique Ray temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _terminal() -> tuple[int, int]:
    """(master, slave) of a new pseudo-terminal of 40 rows and 160 columns (a user's shell window)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    return master, slave


def _terminal_lines(master: int):
    """The lines written to a pseudo-terminal, read from its master side until the command closes it."""
    import io

    reader = io.TextIOWrapper(io.FileIO(master, "rb", closefd=True), errors="replace", newline="")
    try:
        yield from reader
    except OSError:  # EIO: every process holding the terminal has ended
        return


@pytest.mark.parametrize("command, resume_hint, interrupted, on_terminal", [
    # On a terminal (as a user types it): a progress bar of steps, fed by the workers' reports (vidray.train.progress).
    (["-m", "vidray.cli", "train"], "run the same command again to resume", "vidray train: interrupted", True),
    # A new user's trial: the demo printed a KeyboardInterrupt traceback and told to run the same command again,
    # which starts the demo afresh (removing the run); --resume keeps it. (--resume with these shards: no prepare.)
    # Piped (a log file, `ray job submit`): plain lines, no bar.
    ([str(REPO / "jobs/demo.py"), "--resume", "--config"], "resume with `.venv/bin/python jobs/demo.py --resume`",
     "jobs/demo.py: interrupted", False),
], ids=["vidray-train", "demo"])
def test_ctrl_c_stops_vidray_train_within_seconds_and_leaves_no_process(shards_dir, tmp_path, command, resume_hint,
                                                                        interrupted, on_terminal):
    ray_tmp = tempfile.mkdtemp(prefix="/tmp/vrc")  # short: Ray's socket paths are length-limited
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    env.pop("VIDRAY_PROGRESS", None)
    cmd = [sys.executable, *command, str(REPO / "jobs/configs/tiny_t2v.yaml"),
           f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", "name=ctrlc", "model.text_encoder=tiny_random",
           "train.max_steps=100000", "train.log_every_steps=1", "checkpoint.every_steps=100000"]
    if on_terminal:
        master, slave = _terminal()
        proc = subprocess.Popen(cmd, env=env, stdin=slave, stdout=slave, stderr=slave, cwd=tmp_path)
        os.close(slave)
        output = _terminal_lines(master)
    else:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=tmp_path)
        output = iter(proc.stdout)
    lines: list[str] = []
    spawned: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = next(output, "")
            if not line:
                break
            lines.append(line)
            if "[vidray] step 2/" in line:
                break
        assert any("[vidray] step 2/" in line for line in lines), "".join(lines[-40:])
        spawned = _descendants(proc.pid) | set(pids_mentioning(ray_tmp))
        assert spawned, "the run started no processes?"
        drain = threading.Thread(target=lambda: lines.extend(output), daemon=True)  # as a terminal would
        drain.start()
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=20)
        print(f"exited {time.monotonic() - sent:.1f} s after SIGINT with status {proc.returncode}")
        drain.join(timeout=5)
        assert proc.returncode == 130, "".join(lines[-20:])
        assert any("[vidray] interrupted (Ctrl-C): the run stopped" in line and resume_hint in line for line in lines)
        assert any(line.strip() == interrupted for line in lines), "".join(lines[-20:])
        assert not any("Traceback" in line for line in lines), "".join(lines)
        assert not noise_in("".join(lines)), noise_in("".join(lines))  # the demo's start-up and reports (vidray.logs)
        bars = re.findall(r"train:\s+\d+%\|[^\r\n]*\| (\d+)/100000 [^\r\n]*loss=", "".join(lines))
        if on_terminal:  # the bar moved with the reports (every step here) and shows the loss
            assert bars and max(int(n) for n in bars) >= 1, "".join(lines)[-3000:]
        else:  # no bar of any kind
            assert not bars and "%|" not in "".join(lines), "".join(lines)[-3000:]
        left: list[int] = []
        for _ in range(20):  # Ray's processes of the local cluster end once their driver has gone
            left = sorted(p for p in spawned | set(pids_mentioning(ray_tmp)) if _alive(p))
            if not left:
                break
            time.sleep(0.5)
        assert not left, "processes left after Ctrl-C: " + "; ".join(
            f"{p}: {_cmdline(p)[:150]}" for p in left) + "\n" + "".join(lines[-20:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in spawned | set(pids_mentioning(ray_tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_diverged_run_stops_at_once_without_retries_or_checkpoints(local_ray, shards_dir, tmp_path):
    """lr 1e30 blows the weights up after one step. With max_failures=2, a retried error would come back as
    Ray's WorkerGroupError after 3 attempts; vidray's error arrives unwrapped after the first."""
    started = time.monotonic()
    with pytest.raises(NonFiniteTrainingError, match=r"training diverged: .* at step \d+ \(lr 1e\+30\)") as err:
        run_training(job(shards_dir, tmp_path, "optim.lr=1e30", "train.max_steps=8", "train.log_every_steps=2",
                         "checkpoint.every_steps=2", "train.max_failures=2"))
    assert err.value.step <= 2
    assert not list((tmp_path / "resume").glob("checkpoint_*"))  # nothing written after (or at) the bad step
    print(f"diverged run failed after {time.monotonic() - started:.1f} s")
