"""The server's metrics in Prometheus's text format, and its structured access log.

What Triton does: ``GET /metrics`` on ``--metrics-port`` (8002) gives counters per model and version:
``nv_inference_request_success``, ``nv_inference_request_failure``, ``nv_inference_count`` (samples),
``nv_inference_exec_count`` (batches run), and the cumulative microseconds ``nv_inference_request_duration_us``,
``nv_inference_queue_duration_us``, ``nv_inference_compute_infer_duration_us``.

What numbactr does: the same names through prometheus_client (a counter's sample is named ``..._total``
in the text, as the client writes counters), plus ``numbactr_batch_samples`` (a histogram of the samples
per batch the dynamic batcher formed) and ``numbactr_embedding_cache_hit_rate`` (per table: the share of
distinct keys asked since the model loaded that its embedding cache held, numbactr.inference.hps). The
access log is one JSON object per line on stderr: time, client, method, path, status, milliseconds,
bytes in and out, and the error of a failed request.
"""

from __future__ import annotations

import json
import sys
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "AccessLog", "CONTENT_TYPE_LATEST"]

LABELS = ("model", "version")


class Metrics:
    """The registry of one server; observe_* are called by the routes and the batchers."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.success = Counter("nv_inference_request_success", "Successful inference requests", LABELS, registry=r)
        self.failure = Counter(
            "nv_inference_request_failure", "Failed inference requests", LABELS + ("reason",), registry=r
        )
        self.count = Counter("nv_inference_count", "Samples inferred", LABELS, registry=r)
        self.exec_count = Counter("nv_inference_exec_count", "Batches executed", LABELS, registry=r)
        self.request_us = Counter(
            "nv_inference_request_duration_us", "Cumulative request time (us)", LABELS, registry=r
        )
        self.queue_us = Counter(
            "nv_inference_queue_duration_us",
            "Cumulative queue time of batches' oldest requests (us)",
            LABELS,
            registry=r,
        )
        self.compute_us = Counter(
            "nv_inference_compute_infer_duration_us", "Cumulative compute time of batches (us)", LABELS, registry=r
        )
        self.instance_count = Counter(
            "numbactr_instance_exec_count", "Batches executed per instance", LABELS + ("instance",), registry=r
        )
        self.batch = Histogram(
            "numbactr_batch_samples",
            "Samples per executed batch",
            ("model",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
            registry=r,
        )
        self.hit_rate = Gauge(
            "numbactr_embedding_cache_hit_rate", "Embedding cache hit rate since load", LABELS + ("table",), registry=r
        )

    def observe_batch(self, model, samples: int, queue_s: float, compute_s: float) -> None:
        v = (model.name, str(model.version))
        self.exec_count.labels(*v).inc()
        self.count.labels(*v).inc(samples)
        self.queue_us.labels(*v).inc(queue_s * 1e6)
        self.compute_us.labels(*v).inc(compute_s * 1e6)
        self.batch.labels(model.name).observe(samples)
        cache = model.session.cache
        names = [e.sparse_embedding_name for e in model.session.graph.embeddings]
        for name, rate in zip(names, cache.hit_rates):
            self.hit_rate.labels(*v, name).set(rate)

    def observe_instance(self, model, instance: int) -> None:
        self.instance_count.labels(model.name, str(model.version), str(instance)).inc()

    def observe_request(self, model: str, version: str, seconds: float, error: str | None) -> None:
        if error is None:
            self.success.labels(model, version).inc()
            self.request_us.labels(model, version).inc(seconds * 1e6)
        else:
            self.failure.labels(model, version, error).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class AccessLog:
    """ASGI middleware: one JSON line per HTTP request (module docstring)."""

    def __init__(self, app, stream=None):
        self.app, self.stream = app, stream or sys.stderr

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, info = time.perf_counter(), {"status": 500, "bytes_in": 0, "bytes_out": 0}
        scope.setdefault("state", {})["access"] = info  # the routes add "model" and "error"

        async def counting_receive():
            message = await receive()
            info["bytes_in"] += len(message.get("body", b""))
            return message

        async def watching_send(message):
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
            elif message["type"] == "http.response.body":
                info["bytes_out"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        finally:
            client = scope.get("client") or ("", 0)
            line = {
                "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
                "client": f"{client[0]}:{client[1]}",
                "method": scope["method"],
                "path": scope["path"],
                "status": info.pop("status"),
                "ms": round((time.perf_counter() - start) * 1e3, 3),
                **info,
            }
            print(json.dumps(line, separators=(",", ":")), file=self.stream, flush=True)
