"""Every route the server answers, and who may use it: the web guard's allow-list (`ui.guard.WebGuard`).

A route of the running app (Gradio's and the app's own, after Gradio mounts them) that is not in `ROUTES`
is refused, so a Gradio upgrade that adds one is closed until someone decides about it:
tests/test_routes.py walks the real route list and fails on any route missing here (or listed here and
gone). `RouteMatcher` resolves a request to its route the way the router does (the same path templates,
in the router's order, after the root path), so the rule checked is the rule of the handler that runs.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from starlette._utils import get_route_path
from starlette.routing import compile_path

KiB, MiB = 1 << 10, 1 << 20


class Access(enum.Enum):
    PUBLIC = "public"    # the page, its assets and the sign-in: anyone past the host, origin and token checks
    USER = "user"        # any signed-in user; names no session, event or file
    SESSION = "session"  # the signed-in owner of every session, event and uploaded file it names
    EVENT = "event"      # the signed-in user who created the event named in its path
    FILE = "file"        # a file in the requester's own exports folder, or one they uploaded
    UPLOAD = "upload"    # signed in; capped per file, per request and per user on disk
    SIGN_IN = "sign-in"  # anyone, limited per address and per user name
    SIGN_OUT = "sign-out"  # POST from this server's own page only (the guard turns it into Gradio's logout)
    REFUSED = "refused"  # not served by this app: features it does not use, or that would expose the server


JSON, FORM, UPLOAD, NONE = "json", "form", "upload", ""  # the body a route's handler reads (`ui.bodies`)


@dataclasses.dataclass(frozen=True)
class RouteRule:
    access: Access
    why: str
    body_bytes: int = 0  # the largest request body taken (a longer one is refused with 413 before it is read)
    body: str = NONE  # the body's form, as its handler reads it; any other form is refused (415)


JSON_CALL = 4 * MiB  # an event's inputs: a 1 MB paste, JSON-escaped, with the form's other fields
SMALL = 16 * KiB

_ASSET = RouteRule(Access.PUBLIC, "the page's static files")
_REFUSED_UNUSED = RouteRule(Access.REFUSED, "a Gradio feature this app does not use")

ROUTES: dict[str, RouteRule] = {
    # the page and its assets
    "/": RouteRule(Access.PUBLIC, "the page (Gradio shows the sign-in form to a visitor without a session)"),
    "/config": RouteRule(Access.PUBLIC, "the page's layout (without a sign-in Gradio sends only the login form's)"),
    "/config/": RouteRule(Access.PUBLIC, "the page's layout"),
    "/svelte/{path:path}": _ASSET,
    "/static/{path:path}": _ASSET,
    "/assets/{path:path}": _ASSET,
    "/favicon.ico": _ASSET,
    "/theme.css": _ASSET,
    "/gradio_api/theme.css": _ASSET,
    "/robots.txt": _ASSET,
    "/manifest.json": _ASSET,
    "/pwa_icon": _ASSET,
    "/pwa_icon/{size}": _ASSET,
    "/gradio_api/startup-events": RouteRule(Access.PUBLIC, "Gradio calls it on itself once as it starts"),
    "/gradio_api/app_id": RouteRule(Access.PUBLIC, "the page asks which server it talks to"),
    "/gradio_api/app_id/": RouteRule(Access.PUBLIC, "the page asks which server it talks to"),
    # signing in and out
    "/login": RouteRule(Access.SIGN_IN, "the sign-in form", SMALL, FORM),
    "/login/": RouteRule(Access.SIGN_IN, "the sign-in form", SMALL, FORM),
    "/logout": RouteRule(Access.SIGN_OUT, "signs the user out: POST from this server's page only", SMALL),
    "/gradio_api/login_check": RouteRule(Access.PUBLIC, "whether the visitor is signed in"),
    "/gradio_api/login_check/": RouteRule(Access.PUBLIC, "whether the visitor is signed in"),
    "/gradio_api/user": RouteRule(Access.USER, "the signed-in user's own name"),
    "/gradio_api/user/": RouteRule(Access.USER, "the signed-in user's own name"),
    # the API's description and the queue
    "/gradio_api/info": RouteRule(Access.USER, "the endpoints' description (the sign-in page does not carry it)"),
    "/gradio_api/info/": RouteRule(Access.USER, "the endpoints' description"),
    "/gradio_api/queue/status": RouteRule(Access.USER, "the queue's length, nobody's data"),
    "/gradio_api/upload_progress": RouteRule(Access.USER, "an upload's progress (bytes only)"),
    # events: each names a session (bound to its first user) and creates or names events (bound to their creator)
    "/gradio_api/queue/join": RouteRule(Access.SESSION, "starts an event in the caller's session", JSON_CALL, JSON),
    "/gradio_api/queue/data": RouteRule(Access.SESSION, "streams the caller's session's events"),
    "/gradio_api/heartbeat/{session_hash}": RouteRule(Access.SESSION, "keeps the caller's page's session alive"),
    "/gradio_api/run/{api_name}": RouteRule(Access.SESSION, "an unqueued event in the caller's session", JSON_CALL, JSON),
    "/gradio_api/run/{api_name}/": RouteRule(Access.SESSION, "an unqueued event", JSON_CALL, JSON),
    "/gradio_api/api/{api_name}": RouteRule(Access.SESSION, "an unqueued event (older clients)", JSON_CALL, JSON),
    "/gradio_api/api/{api_name}/": RouteRule(Access.SESSION, "an unqueued event (older clients)", JSON_CALL, JSON),
    "/gradio_api/call/{api_name}": RouteRule(Access.SESSION, "starts an event for a plain HTTP client", JSON_CALL, JSON),
    "/gradio_api/call/{api_name}/": RouteRule(Access.SESSION, "starts an event for a plain HTTP client", JSON_CALL, JSON),
    "/gradio_api/call/v2/{api_name}": RouteRule(Access.SESSION, "starts an event (v2 clients)", JSON_CALL, JSON),
    "/gradio_api/call/v2/{api_name}/": RouteRule(Access.SESSION, "starts an event (v2 clients)", JSON_CALL, JSON),
    "/gradio_api/call/{api_name}/{event_id}": RouteRule(Access.EVENT, "streams the result of the caller's event"),
    "/gradio_api/call/v2/{api_name}/{event_id}": RouteRule(Access.EVENT, "streams the caller's event (v2)"),
    "/gradio_api/cancel": RouteRule(Access.SESSION, "cancels the caller's event", SMALL, JSON),
    "/gradio_api/reset": RouteRule(Access.SESSION, "resets the caller's generator event", SMALL, JSON),
    "/gradio_api/reset/": RouteRule(Access.SESSION, "resets the caller's generator event", SMALL, JSON),
    "/gradio_api/deep_link": RouteRule(Access.SESSION, "a link to the caller's session's state"),
    "/gradio_api/stream/{event_id}": RouteRule(Access.EVENT, "feeds the caller's streaming event", JSON_CALL, JSON),
    "/gradio_api/stream/{event_id}/close": RouteRule(Access.EVENT, "closes the caller's streaming event"),
    "/gradio_api/stream/{session_hash}/{run}/{component_id}/playlist.m3u8":
        RouteRule(Access.SESSION, "the caller's session's media stream"),
    "/gradio_api/stream/{session_hash}/{run}/{component_id}/{segment_id}.{ext}":
        RouteRule(Access.SESSION, "the caller's session's media stream"),
    "/gradio_api/stream/{session_hash}/{run}/{component_id}/playlist-file":
        RouteRule(Access.SESSION, "the caller's session's media stream"),
    # files
    "/gradio_api/file={path_or_url:path}": RouteRule(Access.FILE, "the caller's own exports and uploads"),
    "/gradio_api/file/{path:path}": RouteRule(Access.FILE, "the older form of the same (one check for both)"),
    "/gradio_api/upload": RouteRule(Access.UPLOAD, "the caller's .py files and saved plans", 21 * MiB, UPLOAD),
    # refused: what this app does not use, or what would expose the server
    "/openapi.json": RouteRule(Access.REFUSED, "FastAPI's schema of Gradio's internals; /gradio_api/info describes the API"),
    "/gradio_api/openapi.json": RouteRule(Access.REFUSED, "the same schema; /gradio_api/info describes the API"),
    "/monitoring": RouteRule(Access.REFUSED, "Gradio's monitoring dashboard (off: enable_monitoring=False)"),
    "/monitoring/summary": RouteRule(Access.REFUSED, "Gradio's monitoring dashboard"),
    "/monitoring/{key}": RouteRule(Access.REFUSED, "Gradio's monitoring dashboard"),
    "/gradio_api/token": RouteRule(Access.REFUSED, "hands out a Hugging Face token; this app has none"),
    "/gradio_api/token/": RouteRule(Access.REFUSED, "hands out a Hugging Face token"),
    "/gradio_api/dev/reload": RouteRule(Access.REFUSED, "Gradio's development reload"),
    "/gradio_api/runs": RouteRule(Access.REFUSED, "Gradio's run history (off: the app keeps its own)"),
    "/gradio_api/runs/": RouteRule(Access.REFUSED, "Gradio's run history"),
    "/gradio_api/run-history/connect": RouteRule(Access.REFUSED, "Gradio's run history"),
    "/gradio_api/run-history/buckets": RouteRule(Access.REFUSED, "Gradio's run history"),
    "/gradio_api/run-history/records": RouteRule(Access.REFUSED, "Gradio's run history"),
    "/gradio_api/run-history/records/{endpoint}/{record_id}/assets/{asset_id}":
        RouteRule(Access.REFUSED, "Gradio's run history"),
    "/gradio_api/proxy={url_path:path}": RouteRule(Access.REFUSED, "fetches other servers' URLs (for gr.load)"),
    "/gradio_api/component_server": RouteRule(Access.REFUSED, "components' server functions: no component of "
                                              "this app has one (tests/test_routes.py checks)"),
    "/gradio_api/component_server/": RouteRule(Access.REFUSED, "components' server functions: none in this app"),
    "/gradio_api/custom_component/{id}/{environment}/{type}/{file_name}": _REFUSED_UNUSED,
    "/gradio_api/process_recording": _REFUSED_UNUSED,
    "/gradio_api/vibe-edit": RouteRule(Access.REFUSED, "Gradio's AI code editing of the running app"),
    "/gradio_api/vibe-edit/": RouteRule(Access.REFUSED, "Gradio's AI code editing"),
    "/gradio_api/undo-vibe-edit": RouteRule(Access.REFUSED, "Gradio's AI code editing"),
    "/gradio_api/undo-vibe-edit/": RouteRule(Access.REFUSED, "Gradio's AI code editing"),
    "/gradio_api/vibe-code": RouteRule(Access.REFUSED, "reads and rewrites the app's source"),
    "/gradio_api/vibe-code/": RouteRule(Access.REFUSED, "reads and rewrites the app's source"),
    "/gradio_api/vibe-starter-queries": RouteRule(Access.REFUSED, "Gradio's AI code editing"),
    "/gradio_api/vibe-starter-queries/": RouteRule(Access.REFUSED, "Gradio's AI code editing"),
}


def app_routes(app: Any) -> list[tuple[str, frozenset[str]]]:
    """(path template, methods) of every route `app` answers, in the order its router tries them
    (FastAPI's included routers flattened under their prefixes; mounts under theirs)."""
    found: list[tuple[str, frozenset[str]]] = []

    def walk(routes: Any, prefix: str) -> None:
        for route in routes:
            original = getattr(route, "original_router", None)
            if original is not None:  # FastAPI >= 0.16x: an included router kept as one entry
                walk(original.routes, prefix + getattr(route.include_context, "prefix", ""))
            elif getattr(route, "routes", None) is not None and not hasattr(route, "endpoint"):  # a Mount
                walk(route.routes, prefix + route.path)
            else:
                found.append((prefix + route.path, frozenset(getattr(route, "methods", None) or ("GET", "HEAD"))))

    walk(app.routes, "")
    return found


@dataclasses.dataclass(frozen=True)
class Resolved:
    template: str
    rule: RouteRule
    params: dict[str, str]


class RouteMatcher:
    """A request's route: its template, the table's rule for it and its path parameters (decoded once, as
    the router gives them to the handler). None for a path no route takes; a route outside the table gets
    a REFUSED rule."""

    def __init__(self, app: Any):
        self.routes: list[tuple[re.Pattern[str], dict[str, Any], str, frozenset[str]]] = []
        for template, methods in app_routes(app):
            regex, _, convertors = compile_path(template)
            self.routes.append((regex, convertors, template, methods))

    def resolve(self, scope: dict[str, Any]) -> tuple[Resolved | None, bool]:
        """(the route, or None) and whether the path exists under another method (then 405, not 404)."""
        path = get_route_path(scope)
        method = scope.get("method", "GET")
        other_method = False
        for regex, convertors, template, methods in self.routes:
            found = regex.match(path)
            if found is None:
                continue
            if scope["type"] == "http" and method not in methods and not (method == "HEAD" and "GET" in methods):
                other_method = True
                continue
            params = {k: convertors[k].convert(v) for k, v in found.groupdict().items()}
            rule = ROUTES.get(template, RouteRule(Access.REFUSED, "a route nobody has decided about"))
            return Resolved(template, rule, {k: str(v) for k, v in params.items()}), other_method
        return None, other_method
