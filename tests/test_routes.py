"""The web guard's allow-list (`ui.routes.ROUTES`) against the routes the app really answers: every route of
the running Starlette app, after Gradio mounts its own, must have a decided rule, and the table lists no
route the app does not have. A Gradio upgrade that adds a route fails here until someone decides about it."""

from __future__ import annotations

import pytest

from tests.server import free_port
from ui.routes import ROUTES, Access, RouteMatcher, app_routes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def running_app(tmp_path_factory, monkeypatch_module):
    tmp = tmp_path_factory.mktemp("routes")
    monkeypatch_module.setenv("MIGRATION_CACHE_DIR", str(tmp / "cache"))
    monkeypatch_module.setenv("GRADIO_TEMP_DIR", str(tmp / "gradio"))
    monkeypatch_module.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    from ui.demo import build_demo
    from ui.settings import Settings

    demo = build_demo(Settings(history_db=str(tmp / "history.sqlite"), export_dir=str(tmp / "exports")))
    demo.queue()
    app, _, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            auth=lambda u, p: False, enable_monitoring=False, ssr_mode=False)
    yield app
    demo.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_every_route_the_app_answers_has_a_decided_rule(running_app):
    answered = {template for template, _ in app_routes(running_app)}
    undecided = sorted(answered - set(ROUTES))
    assert not undecided, f"routes without a rule in ui/routes.py ROUTES (decide who may use each): {undecided}"
    assert len(answered) > 50  # the walk reached Gradio's included router, not only the app's own routes


def test_the_table_lists_no_route_the_app_does_not_have(running_app):
    answered = {template for template, _ in app_routes(running_app)}
    assert not sorted(set(ROUTES) - answered)


@pytest.mark.parametrize("path, method, template, params", [
    ("/gradio_api/call/history/abc", "GET", "/gradio_api/call/{api_name}/{event_id}", {"event_id": "abc"}),
    ("/gradio_api/call/history", "POST", "/gradio_api/call/{api_name}", {"api_name": "history"}),
    ("/gradio_api/file=/tmp/x/../y", "GET", "/gradio_api/file={path_or_url:path}", {"path_or_url": "/tmp/x/../y"}),
    ("/gradio_api/file//etc/passwd", "GET", "/gradio_api/file/{path:path}", {"path": "/etc/passwd"}),
    ("/gradio_api/heartbeat/s1", "GET", "/gradio_api/heartbeat/{session_hash}", {"session_hash": "s1"}),
    ("/migrate/gradio_api/queue/data", "GET", "/gradio_api/queue/data", {}),
])
def test_a_request_resolves_to_the_route_the_router_runs(running_app, path, method, template, params):
    root = "/migrate" if path.startswith("/migrate") else ""
    resolved, _ = RouteMatcher(running_app).resolve({"type": "http", "path": path, "method": method,
                                                     "root_path": root})
    assert resolved is not None and resolved.template == template
    assert {k: resolved.params[k] for k in params} == params


def test_an_unknown_path_or_method_resolves_to_nothing(running_app):
    matcher = RouteMatcher(running_app)
    assert matcher.resolve({"type": "http", "path": "/gradio_api/nothing", "method": "GET"}) == (None, False)
    assert matcher.resolve({"type": "http", "path": "/gradio_api/queue/join", "method": "GET"}) == (None, True)


def test_every_refused_route_says_why():
    refused = [t for t, rule in ROUTES.items() if rule.access is Access.REFUSED]
    assert "/monitoring" in refused and "/gradio_api/proxy={url_path:path}" in refused
    assert all(ROUTES[t].why for t in ROUTES)
