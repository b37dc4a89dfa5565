"""`numbactr serve` as a real process for the server tests: on a free 127.0.0.1 port, waited for until it is
ready, stopped at the end (terminate, then kill)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(repo: str, log: str, *args: str, port: int | None = None, ready_s: float = 180, stop_s: float = 15):
    """(process, port, tritonclient.http client) of `numbactr serve --model-repository repo` with `args`, once
    it answers ready; its output goes to `log`, whose tail an assertion shows when it exits or is not ready."""
    import tritonclient.http as httpclient

    port = port or free_port()
    env = dict(os.environ, NUMBACTR_DEVICE="cpu", PYTHONPATH=ROOT, NUMBACTR_PROGRESS="0")
    cmd = [sys.executable, "-c", "import sys; from numbactr.cli import main; sys.exit(main())", "serve"]
    cmd += ["--model-repository", repo, "--http-port", str(port), "--http-address", "127.0.0.1", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}): {open(log).read()[-3000:]}"
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001 (not listening yet)
                pass
            assert time.monotonic() < deadline, (
                f"the server was not ready in {ready_s:.0f} s: {open(log).read()[-3000:]}"
            )
            time.sleep(0.2)
        yield proc, port, client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
