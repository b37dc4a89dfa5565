"""The HTTP routes of the KServe v2 protocol (Triton's HTTP/REST endpoints) on Starlette.

    GET  /v2/health/live                          200 while the process serves
    GET  /v2/health/ready                         200: every model loaded before the server listened
    GET  /v2                                      server metadata (name, version, extensions)
    GET  /v2/models/{m}[/versions/{v}]            model metadata: versions, platform, inputs, outputs
    GET  /v2/models/{m}[/versions/{v}]/ready      200 or 400
    GET  /v2/models/{m}[/versions/{v}]/config     config.pbtxt as JSON (Triton's model configuration extension)
    POST /v2/models/{m}[/versions/{v}]/infer      inference (numbactr.serve.protocol, numbactr.serve.infer)
    POST /v2/repository/index                     the models and their state (Triton's repository extension)
    POST /v2/repository/models/{m}/load           load m's highest version now (numbactr.serve.reload)
    POST /v2/repository/models/{m}/refresh        new embedding rows from a snapshot or dump (refresh.py)
    GET  /metrics                                 Prometheus text, here or on --metrics-port (metrics.py)

What Triton answers a bad request with: HTTP 400 and ``{"error": "..."}``. numbactr does the same (404 for
an unknown model or version, 413 for a body over the limit, 503 while a database tier that holds the
rows is down), names what is wrong, counts the failure in
``nv_inference_request_failure`` and writes it into the access log line; the server keeps serving. A
client that disconnects before its body arrived is dropped alone; one that leaves while its request is
batched takes nothing from the others (its result is discarded).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from numbactr.inference import BackendError
from numbactr.serve import infer
from numbactr.serve.batcher import Batcher, compute_executor
from numbactr.serve.metrics import CONTENT_TYPE_LATEST, AccessLog, Metrics
from numbactr.serve.protocol import HEADER, RequestError, encode_response, parse_request
from numbactr.serve.repository import LoadedModel

__all__ = ["Server", "make_app", "metrics_app"]

#: the largest request body read (bytes): a request of max_batch_size samples is far smaller
MAX_BODY = 256 << 20


class ModelSlot:
    """A served model: its loaded version, batcher, and the reason its last load failed (or None) with the
    version folder's stamp then (numbactr.serve.reload)."""

    def __init__(self, model: LoadedModel, metrics: Metrics, executor):
        self.model = model
        self.batcher = Batcher(executor, metrics.observe_batch, metrics.observe_instance)
        self.reason: str | None = None
        self.failed = None


class Server:
    """The models a numbactr server answers for, and its metrics."""

    def __init__(self, models: list, version: str = "0", log_stream=None):
        self.metrics = Metrics()
        self.executor = compute_executor()  # every model's batches run on this one thread (batcher.py)
        self.slots = {m.name: ModelSlot(m, self.metrics, self.executor) for m in models}
        self.version = version
        self.log_stream = log_stream
        self.reloader = None  # numbactr.serve.reload.Reloader when the repository is watched
        self.poll_seconds = 0.0  # and how often (0: only on POST .../load)

    def add(self, model: LoadedModel) -> ModelSlot:
        self.slots[model.name] = ModelSlot(model, self.metrics, self.executor)
        return self.slots[model.name]

    def slot(self, name: str, version: str | None) -> ModelSlot:
        if name not in self.slots:
            raise RequestError(f"unknown model {name!r} (models: {sorted(self.slots)})", 404)
        slot = self.slots[name]
        if version is not None:
            if not version.isdigit():
                raise RequestError(f"model {name!r}: version {version!r} is not a number", 400)
            if int(version) != slot.model.version:
                raise RequestError(
                    f"model {name!r} has no version {version} loaded (serving version {slot.model.version})", 404
                )
        return slot

    async def close(self) -> None:
        for slot in self.slots.values():
            await slot.batcher.close()
        self.executor.shutdown(wait=True)
        for slot in self.slots.values():
            slot.model.close()


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": str(e)}, e.status)


def make_app(server: Server, with_metrics: bool = True) -> AccessLog:
    """The ASGI application (with the access log around it)."""

    async def live(request: Request):
        return Response(status_code=200)

    async def ready(request: Request):  # the server listens once every model has loaded (command.py)
        return Response(status_code=200)

    async def metadata(request: Request):
        return JSONResponse(
            {
                "name": "numbactr",
                "version": server.version,
                "extensions": ["binary_tensor_data", "model_configuration", "model_repository"],
            }
        )

    def _slot(request: Request) -> ModelSlot:
        p = request.path_params
        request.scope["state"]["access"]["model"] = p["model"]
        return server.slot(p["model"], p.get("version"))

    async def model_metadata(request: Request):
        try:
            slot = _slot(request)
        except RequestError as e:
            return _error(e)
        m = slot.model
        tensor = lambda t: {"name": t.name, "datatype": t.datatype, "shape": [-1] + t.dims}  # noqa: E731
        doc = {
            "name": m.name,
            "versions": [str(m.version)],
            "platform": "hugectr",
            "inputs": [tensor(t) for t in m.config.inputs.values()],
            "outputs": [tensor(t) for t in m.config.outputs.values()],
            "state": "READY",
        }
        if slot.reason:
            doc["last_load_error"] = slot.reason
        return JSONResponse(doc)

    async def model_ready(request: Request):
        try:
            _slot(request)
        except RequestError as e:
            return _error(e)
        return Response(status_code=200)

    async def model_config(request: Request):
        try:
            return JSONResponse(_slot(request).model.config.as_json())
        except RequestError as e:
            return _error(e)

    async def repository_index(request: Request):
        return JSONResponse(
            [
                {
                    "name": n,
                    "version": str(s.model.version),
                    "state": "READY",
                    **({"reason": s.reason} if s.reason else {}),
                }
                for n, s in sorted(server.slots.items())
            ]
        )

    async def load(request: Request):
        name = request.path_params["model"]
        request.scope["state"]["access"]["model"] = name
        if server.reloader is None:
            return _error(RequestError("model control is off (numbactr serve --model-control-mode none)"))
        reason = await server.reloader.check(name, force=True)
        if reason is not None:
            request.scope["state"]["access"]["error"] = reason
            return _error(RequestError(f"model {name!r} was not loaded: {reason}"))
        return Response(status_code=200)

    async def infer_route(request: Request):
        access = request.scope["state"]["access"]
        start, name, version = time.perf_counter(), request.path_params["model"], request.path_params.get("version", "")
        try:
            slot = _slot(request)
            size = int(request.headers.get("content-length") or 0)
            if size > MAX_BODY:
                raise RequestError(f"the body has {size} bytes; the limit is {MAX_BODY}", 413)
            body = await request.body()
            req = parse_request(body, request.headers.get(HEADER), request.headers.get("content-encoding"))
            job = infer.check(slot.model, req)
            model, preds = await slot.batcher.submit(job)
        except RequestError as e:
            access["error"] = str(e)
            server.metrics.observe_request(name, version, 0.0, "not_found" if e.status == 404 else "bad_request")
            return _error(e)
        except BackendError as e:  # a database tier down and no other to answer (numbactr.serve.tiers)
            access["error"] = str(e)
            server.metrics.observe_request(name, version, 0.0, "unavailable")
            return JSONResponse({"error": f"unavailable: {e}"}, 503)
        except ClientDisconnect:
            access["error"] = "client disconnected"
            server.metrics.observe_request(name, version, 0.0, "disconnected")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 (a failure of the model answers 500 and the server goes on)
            access["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            server.metrics.observe_request(name, version, 0.0, "internal")
            return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, 500)
        outputs = {"OUTPUT0": ("FP32", [1, preds.size], preds)}
        binary = {"OUTPUT0": req.outputs.get("OUTPUT0", req.binary_output)}
        body, headers = encode_response(model.name, str(model.version), req.id, outputs, binary)
        server.metrics.observe_request(model.name, str(model.version), time.perf_counter() - start, None)
        kind = "application/octet-stream" if headers else "application/json"
        return Response(body, headers=headers, media_type=kind)

    async def refresh_route(request: Request):
        name = request.path_params["model"]
        access = request.scope["state"]["access"]
        access["model"] = name
        try:
            if server.reloader is None:
                raise RequestError("model control is off (numbactr serve --model-control-mode none)")
            slot = server.slot(name, None)
            doc = await server.reloader.refresh(slot, await request.body())
        except RequestError as e:
            access["error"] = str(e)
            return _error(e)
        return JSONResponse(doc)

    routes = [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", metadata),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
        Route("/v2/repository/models/{model}/refresh", refresh_route, methods=["POST"]),
    ]
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            Route(base, model_metadata),
            Route(base + "/ready", model_ready),
            Route(base + "/config", model_config),
            Route(base + "/infer", infer_route, methods=["POST"]),
        ]
    if with_metrics:
        routes.append(_metrics_route(server))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        poll = None
        if server.reloader is not None and server.poll_seconds:
            poll = asyncio.get_running_loop().create_task(server.reloader.poll(server.poll_seconds))
        yield
        if poll is not None:
            poll.cancel()
        await server.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return AccessLog(app, server.log_stream)


def _metrics_route(server: Server) -> Route:
    async def metrics(request: Request):
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", metrics)


def metrics_app(server: Server) -> Starlette:
    """``--metrics-port``'s application: /metrics alone."""
    return Starlette(routes=[_metrics_route(server)])
