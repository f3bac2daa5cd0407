"""The web guard's allow-list (`ui.routes.ROUTES`) against the routes the app really answers: every route of
the running Starlette app, after Gradio mounts its own, must have a decided rule, and the table lists no
route the app does not have. A Gradio upgrade that adds a route fails here until someone decides about it."""

from __future__ import annotations

import pytest

from tests.server import free_port
from ui.routes import JSON, NONE, ROUTES, Access, RouteMatcher, app_routes

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


def test_no_component_has_a_server_function_so_component_server_stays_refused(running_app):
    """Gradio's component_server runs a component's server function in the session the body names; the
    guard refuses the route because no component of this app has one. A component that adds one fails
    here until the route gets a rule that reads its bodies (JSON and multipart) for their session."""
    blocks = running_app.get_blocks()
    with_server_fns = sorted({type(block).__name__ for block in blocks.blocks.values()
                              for name in dir(type(block))
                              if getattr(getattr(type(block), name, None), "_is_server_fn", False)})
    assert not with_server_fns, f"components with server functions: {with_server_fns}"
    assert ROUTES["/gradio_api/component_server"].access is Access.REFUSED


def test_every_route_that_names_a_session_says_which_body_its_handler_reads(running_app):
    methods = {template: m for template, m in app_routes(running_app)}
    for template, rule in ROUTES.items():
        if rule.access in (Access.SESSION, Access.EVENT):
            posts = "POST" in methods[template]
            assert rule.body == (JSON if posts and not template.endswith("/close") else NONE), template


def test_every_event_has_a_lane_and_stop_waits_in_no_queue(running_app):
    from ui.lanes import API_LANES, Lane, lane_of
    fns = list(running_app.get_blocks().fns.values())
    public = {fn.api_name for fn in fns if fn.api_name and fn.fn is not None and fn.api_visibility != "private"}
    assert public == set(API_LANES), "each public endpoint belongs to a decided lane (ui/lanes.py API_LANES)"
    for fn in fns:
        if lane_of(fn.api_name) is Lane.STOP:
            assert fn.concurrency_limit is None, fn.api_name  # never behind anyone's stops in Gradio's queue
            assert fn.queue is False or fn.api_name == "cancel_job", fn.api_name  # the page's Stop runs unqueued
        if fn.api_visibility == "private" and fn.fn is not None:
            assert fn.queue is False and lane_of(fn.api_name) is Lane.LIGHT, fn.api_name  # the page's small events
