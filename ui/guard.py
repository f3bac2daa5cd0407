"""The web layer's security, in front of Gradio: the hosts and origins a server answers, its access token
when it has no users, the routes it answers (`ui.routes`, an allow-list) and for whom, sessions, events and
files tied to their user (`ui.ownership`), bodies and uploads bounded, and a login page that does not
describe the API. Also the users themselves (`read_auth`) and the host names a server answers as
(`allowed_hosts`)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.cookies
import json
import os
import re
import secrets
import socket
import urllib.parse
from pathlib import Path
from collections.abc import Callable
from typing import Any

from starlette._utils import get_route_path

from pydantic import TypeAdapter, ValidationError

from migration.config import forms
from migration.service.accounts import USER_NAME, AccountsError, Authenticator, hash_password, read_users
from migration.service.job import Limits
from ui.bodies import NAME_HEADER, Names, check_format, has_body, json_names, last_wins, read_form, request_headers
from ui.lanes import Gateway, Lane, LaneLimits, lane_limits, lane_of
from ui.ownership import Ownership, OwnershipLimits, Refused
from ui.routes import NONE, SMALL, Access, Resolved, RouteMatcher


def holding_response(send: Any, finish: Callable[[bytes], bytes]) -> Any:
    """A `send` that holds a response until its body is complete, passes the body through `finish`, then
    sends it with its new length."""
    start: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def hold(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            return
        if message["type"] != "http.response.body":
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = finish(b"".join(chunks))
        chunks.clear()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    return hold


class LoginPageWithoutApi:
    """ASGI middleware for servers with auth: Gradio's login page embeds the description of every
    endpoint (names, parameters, choices) for anyone; this serves it without that description."""

    CONFIG = re.compile(rb"window\.gradio_config = (.*?);</script>", re.S)
    API_INFO = re.compile(rb"window\.gradio_api_info = .*?;</script>", re.S)

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].endswith("/"):
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, holding_response(send, self.strip))

    def strip(self, body: bytes) -> bytes:
        found = self.CONFIG.search(body)
        if not found:
            return body
        try:
            config = json.loads(found.group(1))
        except ValueError:
            return body
        if config.get("auth_required") and not config.get("components"):  # the login page
            return self.API_INFO.sub(b"window.gradio_api_info = null;</script>", body)
        return body


TOKEN_COOKIE = "migration-token"
TOKEN_HEADER = b"x-migration-token"
TOKEN_FREE_PATHS = ("/gradio_api/startup-events",)  # Gradio calls it on itself while it launches
QUEUED_CALLS = frozenset({"/gradio_api/queue/join", "/gradio_api/call/{api_name}", "/gradio_api/call/{api_name}/",
                          "/gradio_api/call/v2/{api_name}", "/gradio_api/call/v2/{api_name}/"})  # make an event
UNQUEUED_CALLS = frozenset({"/gradio_api/run/{api_name}", "/gradio_api/run/{api_name}/", "/gradio_api/api/{api_name}",
                            "/gradio_api/api/{api_name}/"})  # run in the request itself
BY_NAME_ONLY = frozenset(t for t in QUEUED_CALLS if "/call/" in t)  # the function is the path's, never the body's
FN_INDEX = TypeAdapter(int | None)  # the body model's field, validated as FastAPI validates it


@dataclasses.dataclass
class WebPolicy:
    """What the web layer lets in: the hosts this server answers as (a DNS-rebinding page names
    another), the origins allowed to call it (same origin, or the public URL behind a proxy), the
    access token of a server without auth, and where exports live (served to their owner only)."""

    hosts: frozenset[str]
    public_origins: frozenset[str] = frozenset()
    token: str = ""  # without auth: the secret in the printed URL
    export_dir: Path | None = None
    auth: bool = False
    limits: OwnershipLimits = OwnershipLimits()
    lanes: dict[Lane, LaneLimits] = dataclasses.field(default_factory=lambda: lane_limits(Limits()))


class WebGuard:
    """ASGI middleware in front of Gradio. In order: the Host (DNS rebinding) and Origin (another site's
    page) checks, the server's token when it has no users, then the route's rule in `ui.routes.ROUTES`
    (a route outside the table is refused): the body's size and form (the form its handler reads, read
    the way it reads it: `ui.bodies`), who may call it, and that every session, event and file the
    request names anywhere (path, query, headers, body) is the caller's. A call is then admitted in its
    lane (`ui.lanes`), per user, before it takes anything shared. Session cookies are made SameSite=Lax."""

    def __init__(self, app: Any, policy: WebPolicy):
        self.app = app
        self.policy = policy
        self.ownership = Ownership(policy.limits, forget_session=self._forget_session,
                                   busy_sessions=self._busy_sessions)
        self.gateway = Gateway(policy.lanes, event_live=self._event_live)
        self._matcher: RouteMatcher | None = None
        self._gradio_app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # no route of this app is a websocket
            await send({"type": "websocket.close", "code": 1008})
            return
        self._gradio_app = scope.get("app", self._gradio_app)
        try:
            headers = request_headers(scope)
        except Refused as exc:
            await _reply(send, exc.status, exc.text)
            return
        refusal = self._refusal(scope, headers)
        if refusal is None and self.policy.token and not scope.get("path", "").endswith(TOKEN_FREE_PATHS):
            refusal, send = self._token_check(scope, headers, send)
        if refusal is None:
            try:
                await self._route(scope, headers, receive, send)
            except Refused as exc:
                api = get_route_path(scope).startswith("/gradio_api/")
                await _reply(send, exc.status, exc.text, exc.retry_after_s, as_json=api)
            return
        await _reply(send, *refusal)

    async def _route(self, scope: dict[str, Any], headers: dict[bytes, bytes], receive: Any, send: Any) -> None:
        """The route's rule, applied; then the app, with what the rule needs around it."""
        if self._matcher is None:
            self._matcher = RouteMatcher(scope["app"])
        if get_route_path(scope) == "/logout":
            scope = self._sign_out(scope, headers)
        resolved, other_method = self._matcher.resolve(scope)
        if resolved is None:
            raise Refused(405 if other_method else 404, "method not allowed here" if other_method else "no such page")
        rule = resolved.rule
        limit = rule.body_bytes or SMALL
        declared = headers.get(b"content-length", b"0").decode("latin-1")
        if not declared.isdigit() or int(declared) > limit:
            raise Refused(413, f"request body over {limit:,} bytes (or without a valid length); this route takes "
                               f"at most {limit:,}")
        access = rule.access
        if access is Access.REFUSED:
            raise Refused(404, f"not served by this app ({rule.why})")
        if access is Access.PUBLIC:
            await self.app(scope, _CappedBody(receive, limit).receive, self._lax_cookies(send))
            return
        if access is Access.SIGN_IN:
            await self._sign_in(scope, headers, receive, send, limit)
            return
        user = self._user(scope, headers)
        if user is None:
            raise Refused(401, "sign in first")
        if access is Access.UPLOAD:
            if NAME_HEADER in headers:  # Gradio reads it for its upload traces: a name like any other
                self.ownership.check_session(headers[NAME_HEADER].decode("latin-1"), user)
            await self._upload(scope, receive, send, user, limit)
            return
        body = b""
        if has_body(scope, headers):
            body, receive = await _read_body(receive, limit)
        parsed = check_format(body, headers, rule.body if access in (Access.SESSION, Access.EVENT) else NONE,
                              resolved.template)
        if access is Access.FILE:
            self._file_check(resolved.params.get("path_or_url", resolved.params.get("path", "")), user)
        elif access in (Access.SESSION, Access.EVENT):
            await self._named(scope, headers, receive, send, user, resolved, parsed)
            return
        await self.app(scope, receive, self._lax_cookies(send))

    async def _named(self, scope: dict[str, Any], headers: dict[bytes, bytes], receive: Any, send: Any, user: str,
                     resolved: Resolved, parsed: Any) -> None:
        """A route that names sessions, events or files: each must be the caller's (a session is bound to
        them at its first use; a call that names none gets room for the session Gradio will make of its
        event). A call is then admitted in its lane; the events it creates become the caller's."""
        names = Names()
        if "session_hash" in resolved.params:
            names.sessions.append(resolved.params["session_hash"])
        if "event_id" in resolved.params:
            names.events.append(resolved.params["event_id"])
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        names.sessions += query.get("session_hash", [])
        names.events += query.get("event_id", [])
        if NAME_HEADER in headers:
            names.sessions.append(headers[NAME_HEADER].decode("latin-1"))
        json_names(parsed, names)
        for event_id in names.events:
            self.ownership.check_event(event_id, user)
            if self.ownership.session_owner(event_id) == user:  # a call's own session: held while it streams
                names.sessions.append(event_id)
        for path in names.files:
            self._file_check(path, user, refusal=(403, "that file is not yours"))
        sessions = list(dict.fromkeys(names.sessions))
        for session in sessions:
            self.ownership.check_session(session, user)
        template = resolved.template
        ticket = None
        if template in QUEUED_CALLS or template in UNQUEUED_CALLS:  # admitted before it binds or takes anything
            ticket = await self.gateway.admit(user, lane_of(self._api_name(scope, resolved, parsed)))
        opened: list[str] = []
        try:
            if template in QUEUED_CALLS and not sessions:
                self.ownership.make_room(user)  # Gradio will make a session of the event's id
            for session in sessions:
                self.ownership.open_session(session, user)
                opened.append(session)
            if template in QUEUED_CALLS:
                send = self._binding_events(send, user, ticket)
            await self.app(scope, receive, self._lax_cookies(send))
        finally:
            if ticket is not None and ticket.event_id is None:  # unqueued, or no event made: the slot is free
                self.gateway.release(ticket)
            for session in opened:
                self.ownership.close_session(session)

    def _api_name(self, scope: dict[str, Any], resolved: Resolved, parsed: Any) -> str | None:
        """The api name of the function a call runs, found as Gradio finds it (`route_utils.get_fn`): the
        body's fn_index when it has a valid one, else the path's api name (a /call's is always the path's)."""
        blocks = scope["app"].get_blocks()
        body = last_wins(parsed)
        fn_index = None
        if resolved.template not in BY_NAME_ONLY and isinstance(body, dict):
            with contextlib.suppress(ValidationError):
                fn_index = FN_INDEX.validate_python(body.get("fn_index"))
        if fn_index is not None:
            fn = blocks.fns.get(fn_index)
            if fn is None:
                raise Refused(404, f"no function {fn_index} in this app")
            return fn.api_name
        return resolved.params.get("api_name")

    def _binding_events(self, send: Any, user: str, ticket: Any) -> Any:
        """`send` for a route that creates an event: its response (a small JSON object) is held until the
        event id in it is bound to `user`, so that the caller's next request finds it theirs, and the
        call's slot in its lane is held by the event (or given back when it made none)."""
        def bind(body: bytes) -> bytes:
            event_id = None
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                event_id = json.loads(body).get("event_id")
            if isinstance(event_id, str) and event_id:
                self.ownership.bind_event(event_id, user)
                if ticket is not None:
                    self.gateway.bind(ticket, event_id)
            return body
        return holding_response(send, bind)

    async def _upload(self, scope: dict[str, Any], receive: Any, send: Any, user: str, limit: int) -> None:
        """An upload: within the user's room on disk; the files it made become theirs; past the files a
        request may carry, or the room, the files it made are removed and the request refused (413)."""
        room = self.ownership.upload_room(user)
        if room <= 0:
            raise Refused(413, f"upload quota reached ({self.policy.limits.upload_bytes_per_user >> 20} MiB of uploads "
                               "kept per user); wait for older uploads to expire")
        # A declared length, checked before Gradio writes a byte: a body cut off half-way would leave its
        # partial file behind in the upload folder.
        declared = dict(scope.get("headers", [])).get(b"content-length", b"").decode("latin-1")
        if not declared.isdigit():
            raise Refused(411, "an upload needs a Content-Length")
        if int(declared) > min(limit, room):
            raise Refused(413, f"upload of {int(declared):,} bytes refused: at most {limit:,} a request, and "
                               f"{room:,} left of your {self.policy.limits.upload_bytes_per_user >> 20} MiB of uploads")
        capped = _CappedBody(receive, min(limit, room))
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def hold(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
        try:
            await self.app(scope, capped.receive, hold)
        except Exception:  # noqa: BLE001 - the app's error for a body cut off by the cap; refused below
            if not capped.over:
                raise
        if capped.over:
            raise Refused(413, f"upload over {min(limit, room):,} bytes (the request's limit or your room left)")
        body = b"".join(chunks)
        paths: list[str] = []
        if start.get("status") == 200:
            with contextlib.suppress(ValueError):
                found = json.loads(body)
                paths = [p for p in found if isinstance(p, str)] if isinstance(found, list) else []
        if paths:
            self.ownership.bind_uploads(paths, user)
            most = self.policy.limits.upload_files_per_request
            if len(paths) > most:
                self.ownership.drop_uploads(paths, user)
                raise Refused(413, f"upload of {len(paths)} files refused: at most {most} files a request, within "
                                   f"{self.policy.limits.upload_bytes_per_user >> 20} MiB per user")
        await send({**start, "headers": [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                    + [(b"content-length", str(len(body)).encode())]} if start else
                   {"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def _sign_in(self, scope: dict[str, Any], headers: dict[bytes, bytes], receive: Any, send: Any,
                       limit: int) -> None:
        """A sign-in: refused (429) past the attempts allowed from its address or for its user name, before
        any password is checked; a successful one gives its attempt back. The user name is read from the
        form as the sign-in handler reads it (the page posts multipart, scripts URL-encoded)."""
        body, receive = await _read_body(receive, limit)
        form = await read_form(scope, headers, body)
        given = form.get("username")
        user_name = given.strip() if isinstance(given, str) else ""
        address = (scope.get("client") or ("?", 0))[0]
        self.ownership.take_sign_in(address, user_name)
        status: list[int] = []

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        await self.app(scope, receive, self._lax_cookies(watch))
        if status and status[0] == 200:
            self.ownership.refund_sign_in(address, user_name)

    def _sign_out(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> dict[str, Any]:
        """Sign-out only by a POST from this server's own page (its Origin), then Gradio's GET handler."""
        if scope.get("method") != "POST":
            raise Refused(405, "sign out with POST from this server's page")
        origin = headers.get(b"origin")
        if origin is None or self._foreign(origin, headers):
            raise Refused(403, "sign-out refused: only this server's own page may sign you out")
        return {**scope, "method": "GET"}

    def _refusal(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        host = headers.get(b"host", b"").decode("latin-1")
        name = urllib.parse.urlsplit(f"//{host}").hostname or ""
        if name.lower() not in self.policy.hosts:
            return 403, (f"this server does not answer as {name or 'an empty host'!r}; open it by the address it "
                         "printed (or add the name with --allowed-hosts)")
        origin = headers.get(b"origin")
        if origin is not None and self._foreign(origin, headers):
            return 403, "cross-origin request refused: only this server's own pages (or --public-url) may call it"
        return None

    def _foreign(self, origin: bytes, headers: dict[bytes, bytes]) -> bool:
        text = origin.decode("latin-1")
        host = headers.get(b"host", b"").decode("latin-1")
        return urllib.parse.urlsplit(text).netloc.lower() != host.lower() and text not in self.policy.public_origins

    def _user(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> str | None:
        """The signed-in user of a request (Gradio's session cookie); "" without auth; None: nobody."""
        if not self.policy.auth:
            return ""
        app = scope.get("app")
        cookies = http.cookies.SimpleCookie()
        try:
            cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
        except http.cookies.CookieError:
            return None
        tokens = getattr(app, "tokens", {})
        cookie_id = getattr(app, "cookie_id", "")
        for key in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
            if key in cookies and cookies[key].value in tokens:
                return tokens[cookies[key].value]
        return None

    def _token_check(self, scope: dict[str, Any], headers: dict[bytes, bytes], send: Any) -> tuple[Any, Any]:
        """Without auth: the request must carry the server's token (in the URL once, then a cookie; or a
        header for API clients). A URL with the right token sets the cookie."""
        token = self.policy.token
        cookies = http.cookies.SimpleCookie()
        try:
            cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
        except http.cookies.CookieError:
            pass
        given = [headers.get(TOKEN_HEADER, b"").decode("latin-1"),
                 cookies[TOKEN_COOKIE].value if TOKEN_COOKIE in cookies else ""]
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [])
        if any(secrets.compare_digest(g, token) for g in given if g):
            return None, send
        if any(secrets.compare_digest(q, token) for q in query if q):
            async def with_cookie(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()
                    message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
                await send(message)
            return None, with_cookie
        return (401, "this server needs its access token: open the URL it printed at start-up "
                     "(http://HOST:PORT/?token=...), or send the token in the X-Migration-Token header"), send

    def _file_check(self, wanted: str, user: str, refusal: tuple[int, str] = (404, "no such file of yours")) -> None:
        """A file is served (or taken as an input) only when its one resolved path lies in the user's own
        exports folder or is an upload of theirs. The path is the router's (decoded once), resolved once;
        a path that still holds %-escapes must be theirs read both ways, whatever the handler does with it."""
        for path in dict.fromkeys((wanted, urllib.parse.unquote(wanted))):
            if not self._owns_file(path, user):
                raise Refused(*refusal)

    def _owns_file(self, path: str, user: str) -> bool:
        real = os.path.realpath(path) if path and "\0" not in path else ""
        export_dir = self.policy.export_dir
        if real and export_dir is not None:
            own = os.path.realpath(export_dir / forms.user_folder(user))
            if real.startswith(own + os.sep):
                return True
        return bool(real) and self.ownership.owns_upload(real, user)

    def _forget_session(self, session: str) -> None:
        """A session whose binding went (expired, or its user's oldest past their cap): Gradio's state for
        it goes too (its plan, its code check), and its queue's unread messages."""
        holder = getattr(self._gradio_app, "state_holder", None)
        lock = getattr(holder, "lock", None)
        if holder is not None and lock is not None:
            with lock:
                holder.session_data.pop(session, None)
                holder.time_last_used.pop(session, None)
        queue = self._queue()
        if queue is not None:
            queue.pending_messages_per_session.pop(session, None)
            queue.pending_event_ids_session.pop(session, None)

    def _queue(self) -> Any:
        get_blocks = getattr(self._gradio_app, "get_blocks", None)
        return getattr(get_blocks(), "_queue", None) if callable(get_blocks) else None

    def _event_live(self, event_id: str) -> bool:
        """Whether Gradio's queue still holds the event (waiting or running)."""
        queue = self._queue()
        return queue is not None and event_id in queue.event_ids_to_events

    def _busy_sessions(self) -> set[str]:
        """The sessions Gradio's queue has events of (never dropped to make room)."""
        queue = self._queue()
        return set() if queue is None else {e.session_hash for e in list(queue.event_ids_to_events.values())}

    @staticmethod
    def _lax_cookies(send: Any) -> Any:
        async def rewrite(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    (k, re.sub(rb"(?i)samesite=none", b"SameSite=Lax", v) if k.lower() == b"set-cookie" else v)
                    for k, v in message.get("headers", [])]}
            await send(message)
        return rewrite


async def _reply(send: Any, status: int, text: str, retry_after_s: float | None = None, as_json: bool = False) -> None:
    """A refusal: one line of text, or for the API's routes a JSON object that says it as Gradio's clients
    read an error (`error`, which the page shows, and FastAPI's `detail`)."""
    if as_json:
        body = json.dumps({"error": text, "detail": text}, ensure_ascii=False).encode()
        kind = b"application/json"
    else:
        body, kind = text.encode(), b"text/plain; charset=utf-8"
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after_s))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _CappedBody:
    """A `receive` that passes at most `limit` body bytes: past them the app sees the client leave
    (`over` is set), so a body without a declared length cannot grow without bound either."""

    def __init__(self, receive: Any, limit: int):
        self._receive, self.limit, self.seen, self.over = receive, limit, 0, False

    async def receive(self) -> dict[str, Any]:
        if self.over:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                self.over = True
                return {"type": "http.disconnect"}
        return message


async def _read_body(receive: Any, limit: int) -> tuple[bytes, Any]:
    """The whole request body (Refused 413 past `limit`), and a `receive` that replays it to the app."""
    chunks, more, size = [], True, 0
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise Refused(413, f"request body over {limit:,} bytes; this route takes at most {limit:,}")
        more = message.get("more_body", False)
    body = b"".join(chunks)
    sent = [False]

    async def replay() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return body, replay


def read_auth(path: str | None, env_value: str | None) -> Authenticator | None:
    """The users: a private file of hashed passwords (`python -m migration add-user FILE NAME`), and/or
    `user:password` pairs in MIGRATION_AUTH (hashed here, in memory). None: no auth."""
    users: dict[str, str] = {}
    try:
        if path:
            users.update(read_users(path))
        for pair in (p.strip() for p in (env_value or "").split(",") if p.strip()):
            user, sep, password = pair.partition(":")
            if not sep or not USER_NAME.fullmatch(user) or not password:
                raise AccountsError(f"MIGRATION_AUTH: expected user:password pairs, got an entry for "
                                    f"{user[:64] or '(empty user)'!r}")
            users[user] = hash_password(password)
    except AccountsError as exc:
        raise SystemExit(f"auth: {exc}")
    return Authenticator(users) if users else None


def allowed_hosts(host: str, public: urllib.parse.SplitResult | None, extra: str) -> frozenset[str]:
    """The host names this server answers as: loopback names, the listening address, this machine's
    names (when it listens beyond loopback), --public-url's host and --allowed-hosts."""
    names = {"127.0.0.1", "localhost", "::1", "[::1]", host.lower()}
    if host not in ("127.0.0.1", "localhost", "::1"):
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        with contextlib.suppress(OSError):
            names |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    if public is not None and public.hostname:
        names.add(public.hostname.lower())
    names |= {h.strip().lower() for h in extra.split(",") if h.strip()}
    return frozenset(names)

