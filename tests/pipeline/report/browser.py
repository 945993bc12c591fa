"""Headless Chromium driven over the DevTools protocol on a pipe (standard library only), to
take several screenshots of one page as it plays.

``chromium --headless --screenshot`` takes one shot per process, and an animated GIF's clock
does not follow ``--virtual-time-budget`` (two such shots mostly show the same frame), so a
test that watches an animation keeps one browser open and shoots twice in real time.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

# --remote-debugging-pipe: Chromium reads commands on fd 3 and writes replies on fd 4, each a
# JSON message ended by a NUL byte.
_COMMANDS_FD, _REPLIES_FD = 3, 4


class Browser:
    """One headless Chromium with one page open."""

    def __init__(self, chromium: str, profile: Path, page: Path, size: str = "800,700") -> None:
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def wire() -> None:  # in the child, before exec
            os.dup2(commands_read, _COMMANDS_FD)
            os.dup2(replies_write, _REPLIES_FD)

        self.process = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                "about:blank",
            ],
            preexec_fn=wire,  # only dup2 runs between fork and exec
            pass_fds=(_COMMANDS_FD, _REPLIES_FD, commands_read, replies_write),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._last_id = 0
        target = self.call("Target.createTarget", url=page.absolute().as_uri())["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one command and wait (at most 60 s) for its reply."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._last_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    result: dict[str, Any] = reply["result"]
                    return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {method}")
            if select.select([self._replies], [], [], left)[0]:
                chunk = os.read(self._replies, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited during {method}")
                self._buffer += chunk

    def screenshot(self) -> bytes:
        """The page as it is now, as PNG bytes."""
        data = self.call("Page.captureScreenshot", session=self._session, format="png")["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)
