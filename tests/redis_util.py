"""A real redis-server for the tests (tests/test_hps.py, tests/test_inference_audit.py): 127.0.0.1, a free port,
its own folder and log, no persistence; stopped by ``stop``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

REDIS = shutil.which("redis-server")


def free_port(cluster: bool = False) -> int:
    """A free 127.0.0.1 port; for a cluster node one whose cluster bus port (port + 10000, Redis's rule) is a
    valid port and free too: an ephemeral port above 55535 has no bus port, and such a node cannot start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def start(folder, *extra, attempts: int = 3):
    """(process, port, client) of a redis-server started in ``folder`` with the options ``extra``. A server
    that exits at once (its port was taken between the check and the start) is started again on another
    port; one that does not answer within a minute, or keeps exiting, is an error quoting its log."""
    import redis

    for attempt in range(attempts):
        port = free_port(cluster="--cluster-enabled" in extra)
        log = folder / f"redis-{port}.log"
        proc = subprocess.Popen(
            [
                REDIS,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--dir",
                str(folder),
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(log),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                return proc, port, client
            except redis.ConnectionError:
                exited = proc.poll() is not None
                if exited or time.monotonic() > deadline:
                    proc.kill()
                    proc.wait(timeout=10)
                    client.close()
                    said = log.read_text()[-2000:] if log.exists() else ""
                    if exited and attempt + 1 < attempts:
                        break
                    raise RuntimeError(f"redis-server on port {port} did not start:\n{said}") from None
                time.sleep(0.05)
    raise AssertionError("unreachable")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
