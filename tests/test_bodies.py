"""The guard reads a body the way the handler behind it does (`ui.bodies`), proved against the handlers'
own parsers: a FastAPI app with a body model (how Gradio's call routes read JSON) and a form (how the
sign-in reads its user name), fed the same requests with content types hypothesis spells every way.
Wherever the handler would read a session's name (or a user name), the guard reads the same one."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Form
from fastapi.testclient import TestClient
from hypothesis import given, settings, strategies as st
from pydantic import BaseModel

from ui.bodies import Names, check_format, is_json, json_names, read_form, request_headers
from ui.ownership import Refused
from ui.routes import JSON, NONE


class _Body(BaseModel):
    session_hash: str | None = None


def _handlers() -> TestClient:
    app = FastAPI()

    @app.post("/json")
    async def as_json(body: _Body) -> dict:
        return {"seen": body.session_hash}

    @app.post("/form")
    async def as_form(username: str = Form("")) -> dict:
        return {"seen": username}
    return TestClient(app)


CLIENT = _handlers()
MIMES = ("application/json", "application/vnd.gradio+json", "application/json-patch+json", "text/json",
         "application/jsonp", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
         "application/octet-stream", "application/xml", "json", "application/", "")
PARAMS = ("", "; charset=utf-8", "; charset=UTF-16", " ; x=y", ";", "; boundary=b0undary", ",text/plain")


def _spelled(draw: st.DrawFn, text: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if f else c for c, f in zip(text, flips))


@st.composite
def content_types(draw: st.DrawFn) -> str | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    return (draw(st.sampled_from(("", " "))) + _spelled(draw, draw(st.sampled_from(MIMES)))
            + _spelled(draw, draw(st.sampled_from(PARAMS))))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(content_type=content_types())
def test_the_guard_reads_a_json_body_exactly_when_fastapi_does(content_type):
    body = json.dumps({"data": [], "session_hash": "alices"}).encode()
    headers = {"content-type": content_type} if content_type is not None else {}
    seen = CLIENT.post("/json", content=body, headers=headers)
    handler_read_it = seen.status_code == 200 and seen.json()["seen"] == "alices"
    guard_reads_it = is_json(content_type.encode() if content_type is not None else None)
    # the same decision, except that a body without a Content-Type is read by the guard whether or not the
    # route is strict about it (FastAPI's strict_content_type): reading more than the handler is safe
    assert guard_reads_it == (handler_read_it or not content_type), content_type
    names = Names()
    raw = {b"content-type": content_type.encode()} if content_type is not None else {}
    try:
        json_names(check_format(body, raw, JSON, "/call"), names)
    except Refused as exc:
        assert exc.status == 415 and not handler_read_it
    else:
        assert names.sessions == ["alices"] and guard_reads_it


def _multipart(name: str, value: str, boundary: str = "b0undary") -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            f"--{boundary}--\r\n").encode()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(content_type=content_types(), multipart=st.booleans())
def test_the_guard_reads_the_sign_ins_user_name_exactly_as_the_form_does(content_type, multipart):
    body = _multipart("username", "alice") if multipart else b"username=alice&password=x"
    headers = {"content-type": content_type} if content_type is not None else {}
    seen = CLIENT.post("/form", content=body, headers=headers)
    handler_name = seen.json()["seen"] if seen.status_code == 200 else None
    scope = {"type": "http", "method": "POST", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    try:
        form = asyncio.run(read_form(scope, request_headers(scope), body))
    except Refused as exc:
        assert exc.status in (400, 415) and handler_name in (None, ""), (content_type, handler_name)
    else:
        assert (form.get("username") or "") == handler_name, (content_type, handler_name)


def test_a_repeated_header_that_says_how_to_read_the_body_is_refused():
    scope = {"headers": [(b"Content-Type", b"text/plain"), (b"content-type", b"application/json")]}
    with pytest.raises(Refused) as refused:
        request_headers(scope)
    assert refused.value.status == 400 and "Content-Type header appears twice" in refused.value.text
    assert request_headers({"headers": [(b"Cookie", b"a"), (b"cookie", b"b")]}) == {b"cookie": b"a"}  # the first


def test_a_route_that_reads_no_body_takes_none_and_every_value_of_a_repeated_key_is_read():
    with pytest.raises(Refused) as refused:
        check_format(b"session_hash=x", {}, NONE, "/gradio_api/queue/data")
    assert refused.value.status == 415
    assert check_format(b"", {}, NONE, "/gradio_api/queue/data") is None
    names = Names()
    json_names(check_format(b'{"session_hash": "mine", "x": [{"session_hash": "hers", "event_id": "e"}],'
                            b' "session_hash": "theirs"}', {}, JSON, "/call"), names)
    assert sorted(names.sessions) == ["hers", "mine", "theirs"] and names.events == ["e"]
