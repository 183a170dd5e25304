"""A user-space TCP proxy that limits the bytes/s an upstream server sends back (benchmarks only).

This kernel has no `netem` and shaping `lo` with `tbf` stalls bulk transfers (../shared/NOTES.md), so the
benchmarks throttle the cold store in user space: clients connect to the proxy on 127.0.0.1, the proxy connects
to the upstream (moto's S3 server), forwards requests as they come and releases the responses through one token
bucket shared by every connection (the store's link: all downloads together get `rate_bytes_per_s`).

```python
proxy = ThrottledProxy("127.0.0.1", moto_port, rate_bytes_per_s=1_000_000)
port = proxy.start()          # listens on 127.0.0.1:port (an event loop in a daemon thread)
proxy.rate_bytes_per_s = None   # unlimited from now on (None or 0)
proxy.stop()
```
"""

from __future__ import annotations

import asyncio
import threading
import time

CHUNK_BYTES = 64 * 1024
"""Largest piece forwarded at once (and the token bucket's burst)."""


class _TokenBucket:
    """Tokens are bytes; refilled at the proxy's current rate, at most `burst` banked. One event loop: no lock."""

    def __init__(self, proxy: "ThrottledProxy", burst: int, rate_attr: str = "rate_bytes_per_s"):
        self.proxy = proxy
        self.rate_attr = rate_attr
        self.burst = burst
        self.tokens = float(burst)
        self.t = time.monotonic()

    async def take(self, n: int) -> None:
        while True:
            rate = getattr(self.proxy, self.rate_attr)
            now = time.monotonic()
            if not rate:
                self.t, self.tokens = now, float(self.burst)
                return
            self.tokens = min(float(self.burst), self.tokens + (now - self.t) * rate)
            self.t = now
            if self.tokens >= n:
                self.tokens -= n
                return
            await asyncio.sleep((n - self.tokens) / rate)


class ThrottledProxy:
    """TCP proxy 127.0.0.1:<port> -> upstream_host:upstream_port; responses limited to `rate_bytes_per_s` in total
    (None or 0: unlimited; may be changed while it runs). `bytes_down` counts the response bytes forwarded.
    `upload_rate_bytes_per_s` limits the requests (uploads) the same way, through a bucket of their own (default
    None: requests pass as they come); `bytes_up` counts them."""

    def __init__(self, upstream_host: str, upstream_port: int, *, rate_bytes_per_s: float | None,
                 upload_rate_bytes_per_s: float | None = None):
        self.upstream = (upstream_host, int(upstream_port))
        self.rate_bytes_per_s = rate_bytes_per_s
        self.upload_rate_bytes_per_s = upload_rate_bytes_per_s
        self.bytes_down = 0
        self.bytes_up = 0
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> int:
        """Start listening on 127.0.0.1 (a free port); returns the port. Raises RuntimeError if it does not start."""
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="vidray-throttle-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError(f"the throttling proxy did not start within {timeout_s} s")
        self._bucket = _TokenBucket(self, CHUNK_BYTES)
        self._upload_bucket = _TokenBucket(self, CHUNK_BYTES, "upload_rate_bytes_per_s")
        return int(self.port)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, up_writer, upload=True),
                             self._pipe(up_reader, client_writer, upload=False), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upload: bool) -> None:
        try:
            while data := await reader.read(CHUNK_BYTES):
                if upload:
                    await self._upload_bucket.take(len(data))
                    self.bytes_up += len(data)
                else:
                    await self._bucket.take(len(data))
                    self.bytes_down += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()  # either side gone: close the other (HTTP clients reconnect)

    def stop(self) -> None:
        """Stop listening and end the event loop's thread (open connections are dropped)."""
        if self._loop is None:
            return
        loop = self._loop

        def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            loop.stop()

        loop.call_soon_threadsafe(shutdown)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._loop = None
