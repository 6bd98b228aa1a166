"""Google Cloud's Vertex AI prediction protocol, as llama-server serves it when the container runs with
AIP_MODE=PREDICTION: the port from AIP_HTTP_PORT, GET AIP_HEALTH_ROUTE as /health, and POST AIP_PREDICT_ROUTE
(/predict) taking {"instances": [...]}: each instance is the body of one of the server's POST endpoints, named by its
"@requestFormat" (the endpoint's path in camelCase without /v1, e.g. "chatCompletions", "completion", "embeddings", or
the path itself), answered together (not streamed) as {"predictions": [...]}, an instance that fails as its error
object in its place."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from specee.server.request import ApiError, json_object

MAX_INSTANCES = 128  # instances in one predict request


@dataclass(frozen=True)
class GcpSettings:
    predict_route: str
    health_route: str | None
    port: int | None


def route_of(value: str | None) -> str | None:
    return None if not value else value if value.startswith("/") else "/" + value


def gcp_settings(env: Mapping[str, str] = os.environ) -> GcpSettings | None:
    """The protocol's settings from the environment; None unless AIP_MODE is PREDICTION. ValueError on a bad port."""
    if env.get("AIP_MODE") != "PREDICTION":
        return None
    port = env.get("AIP_HTTP_PORT")
    if port and not port.isdigit():
        raise ValueError(f"AIP_HTTP_PORT must be a port number, not {port!r}")
    return GcpSettings(route_of(env.get("AIP_PREDICT_ROUTE")) or "/predict", route_of(env.get("AIP_HEALTH_ROUTE")),
                       int(port) if port else None)


def format_of(path: str) -> str:
    """An endpoint's @requestFormat: its path without /v1, in camelCase ("/v1/chat/completions" -> "chatCompletions",
    "/apply-template" -> "applyTemplate")."""
    path = path[3:] if path.startswith("/v1/") else path
    words = [w for w in path.strip("/").replace("-", "/").replace("_", "/").split("/") if w]
    return "".join(w if i == 0 else w[:1].upper() + w[1:] for i, w in enumerate(words))


def predict_endpoint(routes: list[Route]) -> Callable:
    """The predict endpoint over these routes (their POST endpoints, without path parameters; the first of a name)."""
    endpoints: dict[str, tuple[str, Callable]] = {}
    for r in routes:
        if "POST" in (r.methods or ()) and "{" not in r.path:
            endpoints.setdefault(format_of(r.path), (r.path, r.endpoint))
            endpoints.setdefault(r.path, (r.path, r.endpoint))

    async def one(request: Request, instance: Any) -> Any:
        if not isinstance(instance, dict) or not isinstance(instance.get("@requestFormat"), str):
            return ApiError(400, "each instance must be an object with a string '@requestFormat'").body()
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        payload["stream"] = False  # answered together
        found = endpoints.get(instance["@requestFormat"])
        if found is None:
            return ApiError(400, f"no endpoint for @requestFormat {instance['@requestFormat']!r}").body()
        path, endpoint = found
        body = json.dumps(payload).encode()
        scope = {**request.scope, "path": path, "raw_path": path.encode(), "query_string": b"", "state": {},
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        given = False

        async def receive() -> Message:  # the instance's body, then the client's own connection (gone: cancelled)
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await request.receive()

        try:
            response = await endpoint(Request(scope, receive))
        except ApiError as e:
            return e.body()
        if isinstance(response, StreamingResponse) or not response.body:
            return None
        return json.loads(response.body)

    async def predict(request: Request) -> Response:
        body = await json_object(request)
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise ApiError(400, "the request body must have a list 'instances'", param="instances")
        if len(instances) > MAX_INSTANCES:
            raise ApiError(400, f"at most {MAX_INSTANCES} instances per request, not {len(instances)}",
                           param="instances")
        return JSONResponse({"predictions": await asyncio.gather(*(one(request, i) for i in instances))})

    return predict


def gcp_routes(settings: GcpSettings, routes: list[Route], health: Callable) -> list[Route]:
    """The protocol's routes beside the server's (ValueError where the predict route is one of them)."""
    if any(r.path == settings.predict_route for r in routes):
        raise ValueError(f"AIP_PREDICT_ROUTE {settings.predict_route} is one of the server's own routes")
    out = [Route(settings.predict_route, predict_endpoint(routes), methods=["POST"])]
    if settings.health_route:
        out.append(Route(settings.health_route, health))
    return out
