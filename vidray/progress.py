"""Progress bars (tqdm, the one bar library of the project) for `prepare`, `encode`, `train` and `generate`.

On a terminal (the bar's stream, stderr, is a TTY) a command shows one bar; elsewhere (a log file, `ray job
submit`, a pipe) the bar is off and the command prints its plain lines as before. `VIDRAY_PROGRESS=0` turns the
bars off on a terminal too, `VIDRAY_PROGRESS=1` forces them on (e.g. under a pseudo-terminal the detection
cannot see).
"""

from __future__ import annotations

import os
import sys
from typing import Any

PROGRESS_ENV = "VIDRAY_PROGRESS"


def bars_enabled(stream: Any = None) -> bool:
    """Whether progress bars are drawn on `stream` (default stderr): `VIDRAY_PROGRESS` when set ("0" off, else
    on), else whether the stream is a terminal."""
    setting = os.environ.get(PROGRESS_ENV, "").strip()
    if setting:
        return setting != "0"
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


def progress_bar(total: int | None, desc: str, unit: str, *, initial: int = 0) -> Any:
    """A `tqdm` bar on stderr of `total` `unit`s (None: unknown), disabled unless `bars_enabled()`. Use it as a
    context manager; `bar.update(n)`, `bar.set_postfix(...)`; `bar.write(line)` prints a line above it."""
    from tqdm import tqdm  # heavy: tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr, dynamic_ncols=True,
                disable=not bars_enabled(), leave=True, smoothing=0.1)

