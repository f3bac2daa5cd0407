"""The web layer's security, in front of Gradio: the hosts and origins a server answers, its access token
when it has no users, sessions tied to the user who opened them, exports served to their owner only, and a
login page that does not describe the API. Also the users themselves (`read_auth`) and the host names a
server answers as (`allowed_hosts`)."""

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
from typing import Any

from migration.config import forms
from migration.service.accounts import USER_NAME, AccountsError, Authenticator, hash_password, read_users


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
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = self.strip(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, capture)

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
GUARDED_WITHOUT_LOGIN = ("cancel", "heartbeat", "stream", "reset")  # Gradio routes that check no login
# Gradio routes that name a session (in the path, the query or a JSON body): its user's alone.
SESSION_ROUTES = (*GUARDED_WITHOUT_LOGIN, "queue", "run", "api", "deep_link", "component_server")


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


class WebGuard:
    """ASGI middleware in front of Gradio: refuses requests for another Host (DNS rebinding) and
    cross-origin requests (a page elsewhere calling the API with the user's cookies), makes the session
    cookies SameSite=Lax, asks for the server's token when there is no auth, ties Gradio's cancel,
    heartbeat and stream routes to the signed-in user who opened the session, and serves a file of the
    exports folder only to the user whose folder holds it."""

    def __init__(self, app: Any, policy: WebPolicy):
        self.app = app
        self.policy = policy
        self.session_owner: dict[str, str] = {}  # Gradio session hash -> the user who joined with it

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is None and self.policy.token and not scope.get("path", "").endswith(TOKEN_FREE_PATHS):
            refusal, send = self._token_check(scope, headers, send)
        if refusal is None:
            refusal, receive = await self._session_check(scope, headers, receive)
        if refusal is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            status, text = refusal
            body = text.encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, self._lax_cookies(send))

    def _refusal(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        host = headers.get(b"host", b"").decode("latin-1")
        name = urllib.parse.urlsplit(f"//{host}").hostname or ""
        if name.lower() not in self.policy.hosts:
            return 403, (f"this server does not answer as {name or 'an empty host'!r}; open it by the address it "
                         "printed (or add the name with --allowed-hosts)")
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if urllib.parse.urlsplit(text).netloc.lower() != host.lower() and text not in self.policy.public_origins:
                return 403, "cross-origin request refused: only this server's own pages (or --public-url) may call it"
        return None

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

    async def _session_check(self, scope: dict[str, Any], headers: dict[bytes, bytes],
                             receive: Any) -> tuple[tuple[int, str] | None, Any]:
        path = scope.get("path", "")
        route = path.split("/gradio_api/", 1)[1] if "/gradio_api/" in path else ""
        head = route.split("/", 1)[0]
        if route.startswith("file=") and self.policy.export_dir is not None:
            return self._file_check(scope, headers, urllib.parse.unquote(route[len("file="):])), receive
        if head not in SESSION_ROUTES:
            return None, receive
        user = self._user(scope, headers)
        if user is None:
            return (401, "sign in first"), receive
        session = route.split("/")[1] if head in ("heartbeat", "stream") and "/" in route else None
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        session = query.get("session_hash", [session])[0]
        if scope.get("method") == "POST" and b"json" in headers.get(b"content-type", b"json"):
            body, receive = await _read_body(receive)
            try:
                session = json.loads(body or b"{}").get("session_hash", session)
            except (ValueError, AttributeError):
                pass
        if isinstance(session, str) and session:
            owner = self.session_owner.setdefault(session, user)
            if len(self.session_owner) > 100_000:  # bounded: the oldest sessions are forgotten first
                for key in list(self.session_owner)[:50_000]:
                    del self.session_owner[key]
            if owner != user:
                return (403, "that session belongs to another user"), receive
        return None, receive

    def _file_check(self, scope: dict[str, Any], headers: dict[bytes, bytes], wanted: str) -> tuple[int, str] | None:
        try:
            relative = Path(os.path.realpath(wanted)).relative_to(os.path.realpath(self.policy.export_dir))
        except ValueError:
            return None  # not an export (Gradio's own cache of served files checks itself)
        user = self._user(scope, headers)
        if user is None:
            return 401, "sign in first"
        if not relative.parts or relative.parts[0] != forms.user_folder(user):
            return 404, "no such file of yours"
        return None

    @staticmethod
    def _lax_cookies(send: Any) -> Any:
        async def rewrite(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    (k, re.sub(rb"(?i)samesite=none", b"SameSite=Lax", v) if k.lower() == b"set-cookie" else v)
                    for k, v in message.get("headers", [])]}
            await send(message)
        return rewrite


async def _read_body(receive: Any) -> tuple[bytes, Any]:
    """The whole request body, and a `receive` that replays it to the app."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
        if sum(map(len, chunks)) > 16 << 20:  # past any legitimate call: the app then refuses the body
            break
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

