"""A request's headers and body read the way the handler behind its route reads them, for the web guard
(`ui.guard`): the names (sessions, events, files) a request carries are found by the same parsing the
handler will do, so there is no form the guard passes unread and the handler reads.

- Headers: the first of a repeated header is the one Starlette hands the handler; a request that repeats
  Content-Type, Content-Length or Transfer-Encoding is refused outright (two readers could pick two).
- A JSON body (FastAPI's body models: every Gradio route that takes a body and names a session): FastAPI
  parses it as JSON when there is no Content-Type or when it is application/json or application/*+json,
  in any capitalisation and with any parameters (`email.message`, as FastAPI does), and otherwise does not
  read it at all. The guard takes the same decision and refuses the rest (415) instead of passing on a
  body it did not read.
- A form (the sign-in): Starlette's own `Request.form()`, URL-encoded or multipart (the page's sign-in form
  posts multipart).
- A route whose handler reads no body takes none.
"""

from __future__ import annotations

import dataclasses
import email.message
import json
from typing import Any

from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData
from starlette.requests import Request

from ui.ownership import Refused
from ui.routes import JSON, NONE
SINGLE_HEADERS = (b"content-type", b"content-length", b"transfer-encoding")
NAME_HEADER = b"session_hash"  # Gradio reads a session's name from this header too (an upload's trace)


@dataclasses.dataclass
class Names:
    """What a request names: sessions, events and files (in its path, query, headers and body)."""

    sessions: list[str] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)


def request_headers(scope: dict[str, Any]) -> dict[bytes, bytes]:
    """The request's headers by lower-case name, the first of each (as Starlette's `Headers.get`); Refused
    (400) when one that says how to read the body is repeated."""
    headers: dict[bytes, bytes] = {}
    for key, value in scope.get("headers", []):
        key = key.lower()
        if key in headers:
            if key in SINGLE_HEADERS:
                raise Refused(400, f"the {key.decode('latin-1').title()} header appears twice; send it once")
            continue
        headers[key] = value
    return headers


def has_body(scope: dict[str, Any], headers: dict[bytes, bytes]) -> bool:
    """Whether the request may carry a body (a GET can, by a length or chunks)."""
    declared = headers.get(b"content-length", b"0").strip()
    return (scope.get("method") not in ("GET", "HEAD") or b"transfer-encoding" in headers
            or declared not in (b"", b"0"))


def is_json(content_type: bytes | None) -> bool:
    """FastAPI's rule for a body model: JSON when there is no Content-Type, or application/json or
    application/*+json (any case, any parameters)."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def check_format(body: bytes, headers: dict[bytes, bytes], expected: str, route: str) -> Any:
    """The body parsed as the route's handler will parse it (JSON: the value; none: None); Refused when it
    is in a form the handler does not read (415) or not the form it says it is (400)."""
    if not body:
        return None
    if expected == NONE:
        raise Refused(415, f"{route} takes no request body")
    if expected == JSON:
        if not is_json(headers.get(b"content-type")):
            raise Refused(415, f"{route} takes a JSON body (Content-Type: application/json); got "
                               f"{headers.get(b'content-type', b'').decode('latin-1')[:80]!r}")
        try:
            return json.loads(body, object_pairs_hook=_Pairs)
        except (ValueError, RecursionError):
            raise Refused(400, f"{route}: the body is not valid JSON") from None
    raise ValueError(f"no reader for a {expected!r} body")  # the route table names its readers


FORM_TYPES = (b"multipart/form-data", b"application/x-www-form-urlencoded")


async def read_form(scope: dict[str, Any], headers: dict[bytes, bytes], body: bytes) -> FormData:
    """The form as the handler's `Request.form()` reads it (URL-encoded or multipart, told apart by
    Starlette's own parsing of the Content-Type); any other content type is refused (415)."""
    kind, _ = parse_options_header(headers.get(b"content-type", b""))
    if kind not in FORM_TYPES:
        raise Refused(415, "the sign-in takes a form (application/x-www-form-urlencoded or multipart/form-data)")
    sent = [False]

    async def replay() -> dict[str, Any]:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}
    try:
        return await Request({**scope, "type": "http"}, replay).form(max_files=0, max_fields=20)
    except Exception as exc:  # noqa: BLE001 - any parser's complaint: the handler would refuse the same body
        raise Refused(400, f"the form could not be read: {str(exc)[:120]}") from None


def json_names(found: Any, names: Names) -> None:
    """The sessions, events and files a parsed JSON body names: every value of a repeated key, at any depth."""
    stack = [found]
    while stack:
        node = stack.pop()
        if isinstance(node, _Pairs):
            for key, value in node:
                if key == "session_hash" and isinstance(value, str):
                    names.sessions.append(value)
                elif key == "event_id" and isinstance(value, str):
                    names.events.append(value)
                elif key == "path" and isinstance(value, str):
                    names.files.append(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def last_wins(found: Any) -> Any:
    """A parsed body as the handler sees it (a JSON object keeps the last of a repeated key), top level."""
    return dict(found) if isinstance(found, _Pairs) else found


class _Pairs(list):
    """A JSON object as its (key, value) pairs, repeated keys kept."""
