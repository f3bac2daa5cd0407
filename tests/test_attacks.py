"""The shared box attacked as a signed-in user would attack another: two users (alice, bob) and an
anonymous client against the running app with auth, plus a server without auth. One test per
finding of the hosting review; each failed on the code before these defences (see
docs/hosting.md for the threat model).

The fuzz drives every API endpoint with payloads hypothesis makes (types, sizes, unicode, NaN,
nesting) and asserts no 500, no traceback, another user's /history answering within a second
afterwards and an undamaged history database.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sqlite3
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gradio_client import handle_file
from gradio_client.exceptions import AppError
from hypothesis import HealthCheck, given, settings, strategies as st

from bench.flood import ENCODINGS, PLACEHOLDERS, foreign_attempt, named_templates, refused_by_the_guard
from tests.server import ROOT, Server, value, wait_until
from ui.ownership import OwnershipLimits

pytestmark = pytest.mark.slow

USERS = {"alice": "pw-alice-1", "bob": "pw-bob-2", "carol": "pw-carol-3", "dave": "pw-dave-4"}
# carol floods and dave is guessed at, so that their limits touch no other test
HISTORY_WITHIN_S = 1.0
CONSTANT_BOMB = "batch_size = ((((((2**64)**64)**64)**64)**64)**64)\n"
HISTORY_ARGS = ("mine", "all", "all", "all")


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """The app with two users (MIGRATION_AUTH) and an admin-less history; a second one without auth."""
    auth = Server(tmp_path_factory.mktemp("box"), env={"MIGRATION_AUTH": ",".join(f"{u}:{p}" for u, p in USERS.items())},
                  wait=False)
    open_box = Server(tmp_path_factory.mktemp("open-box"), wait=False)
    auth.wait_ready()
    open_box.wait_ready()
    yield {"auth": auth, "open": open_box}
    auth.close()
    open_box.close()


@pytest.fixture(scope="module")
def alice(box):
    return box["auth"].connect(("alice", USERS["alice"]))


@pytest.fixture(scope="module")
def bob(box):
    return box["auth"].connect(("bob", USERS["bob"]))


GATEWAY_REFUSAL = "too many requests"  # a call past the user's lane (ui/lanes.py), answered 429


def refusal_text(exc: Exception) -> str:
    """What a refused call says: the app's error, or the gateway's answer (429) to a call past a lane."""
    if isinstance(exc, httpx.HTTPStatusError):
        assert exc.response.status_code == 429, exc.response.text
        return exc.response.text
    return str(exc)


def login_cookies(server: Server, user: str) -> httpx.Cookies:
    r = httpx.post(f"{server.url}login/", data={"username": user, "password": USERS[user]}, timeout=30)
    assert r.status_code == 200, r.text
    return r.cookies


def timed_history(client: Any) -> float:
    """One /history call's latency; calls are paced under the per-user rate limit (5 a second)."""
    time.sleep(0.25)
    t0 = time.monotonic()
    client.predict(*HISTORY_ARGS, api_name="/history")
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def alices_run(box, alice):
    """A short run of alice's, labelled, with its exports."""
    form = ["mlp", "tiny", "tpu-v5e-8", 8, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
            0, 0, "preset", "auto", 8]
    outputs = alice.predict(None, 3, 0.003, False, False, False, False, False, *form, "alice-secret-run", "", "",
                            api_name="/run")
    assert "Run finished" in outputs[0], outputs[0]
    return outputs


# -- 1. untrusted work never runs in the server --------------------------------------------------

@pytest.mark.parametrize("payload", [CONSTANT_BOMB, "x = 1  " + "#migration:ignore[" * 50_000 + "\n"],
                         ids=["constant-bomb", "ignore-comment-line"])
def test_one_users_worst_paste_never_holds_another_users_history(box, alice, bob, payload):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        check = pool.submit(alice.predict, payload, [], api_name="/code_check")
        times = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline or not times:
            times.append(timed_history(bob))
        summary = check.result(timeout=120)[0]
    assert max(times) < HISTORY_WITHIN_S, times
    assert "finding" in summary
    assert box["auth"].proc.poll() is None


def test_a_flood_of_sign_ins_never_holds_a_signed_in_users_history(box, bob):
    """Anyone may POST /login, and each check is tens of milliseconds of scrypt: 80 wrong guesses at
    once while bob reads his history. The guesses past the per-user-name limit are refused (429) before
    any scrypt, so the flood costs a few checks; bob's page and other users' sign-ins are not held."""
    server = box["auth"]

    def guess(i: int) -> httpx.Response:
        return httpx.post(f"{server.url}login/", data={"username": "mallory", "password": f"guess-{i}"}, timeout=120)

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(80) as pool:
        flood = [pool.submit(guess, i) for i in range(80)]
        times = []
        while not all(f.done() for f in flood) or len(times) < 3:  # a median of at least three reads
            times.append(timed_history(bob))
        answers = [f.result() for f in flood]
    lasted = time.monotonic() - started
    codes = [r.status_code for r in answers]
    # The user name's bucket, and what it refilled while the flood lasted (one attempt every few seconds).
    limits = OwnershipLimits()
    checked = limits.sign_in_per_user + int(lasted / limits.sign_in_refill_s)
    assert set(codes) == {400, 429} and codes.count(400) <= checked, (codes, lasted)
    limited = next(r for r in answers if r.status_code == 429)
    assert "too many sign-in attempts" in limited.text and int(limited.headers["retry-after"]) >= 1
    # The flood's 80 connections share the server's two cores with bob's page: a page may wait its turn behind
    # them (one took 1.07 s on the 2-core CI machine beside another test worker), but it is never held behind
    # the flood's password checks (80 scrypt checks in a row would take seconds): typically within the usual
    # bound, never twice it.
    assert statistics.median(times) < HISTORY_WITHIN_S and max(times) < 2 * HISTORY_WITHIN_S, times
    t0 = time.monotonic()
    assert httpx.post(f"{server.url}login/", data={"username": "alice", "password": USERS["alice"]},
                      timeout=30).status_code == 200
    assert time.monotonic() - t0 < 2.0


def test_a_guessing_loop_in_the_pages_multipart_form_meets_the_user_names_limit(box):
    """The page's sign-in posts multipart: the guard reads the user name from it as the handler does, so
    the name's limit holds against guesses in either form, from addresses that never signed the user in
    (told apart by X-Forwarded-For, which the server trusts from loopback only); the user's own address
    (she signed in from it) keeps its own attempts."""
    server = box["auth"]
    assert httpx.post(f"{server.url}login/", data={"username": "dave", "password": USERS["dave"]},
                      timeout=30).status_code == 200  # dave's own address is known from now on
    answers = []
    for i in range(14):
        guess = {"username": (None, "dave"), "password": (None, f"guess-{i}")}
        r = httpx.post(f"{server.url}login/", files=guess, headers={"x-forwarded-for": f"10.6.6.{i}"}, timeout=30)
        answers.append(r.status_code)
    assert answers[:10] == [400] * 10 and set(answers[10:]) == {429}, answers  # 10 checked, then refused
    urlencoded = httpx.post(f"{server.url}login/", data={"username": "dave", "password": "x"}, timeout=30,
                            headers={"x-forwarded-for": "10.6.7.1"})
    assert urlencoded.status_code == 429 and "user name" in urlencoded.text
    own = httpx.post(f"{server.url}login/", files={"username": (None, "dave"), "password": (None, USERS["dave"])},
                     timeout=30)
    assert own.status_code == 200


def test_code_checks_are_limited_per_user(box, alice):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(alice.predict, "import time\n" * 80_000, [], api_name="/code_check") for _ in range(4)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=120)[0])
            except (AppError, httpx.HTTPStatusError) as exc:
                outcomes.append(refusal_text(exc))
    assert any("limit 2 per user" in o for o in outcomes), outcomes  # the job service's own refusal
    assert all("finding" in o or "limit 2 per user" in o or GATEWAY_REFUSAL in o for o in outcomes), outcomes


def test_environment_probes_are_tasks_limited_per_user(box, alice, bob):
    """Each probe starts JAX in a worker: one user's burst of them is bounded, and another user's
    history keeps answering."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(alice.predict, api_name="/environment") for _ in range(4)]
        times = []
        while not all(f.done() for f in futures) or len(times) < 3:  # a median of at least three reads
            times.append(timed_history(bob))
        # As beside the sign-in flood: on 2 cores, with another test worker compiling, a page may wait its turn
        # (one read took 1.03 s in a fresh clone's run), but the probes' workers never hold it: typically
        # within the usual bound, never twice it.
        assert statistics.median(times) < HISTORY_WITHIN_S and max(times) < 2 * HISTORY_WITHIN_S, times
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=300))
            except (AppError, httpx.HTTPStatusError) as exc:
                outcomes.append(refusal_text(exc))
    refused = [o for o in outcomes if isinstance(o, str)]
    probed = [o for o in outcomes if not isinstance(o, str)]
    assert refused and all("limit 2 per user" in o or GATEWAY_REFUSAL in o for o in refused), outcomes
    assert probed and all("Backend" in text and info["device_count"] >= 1 for text, info in probed)


# -- 2. uploaded plans are data --------------------------------------------------------------------

def test_an_uploaded_plan_sets_no_flag_and_writes_no_script(box, alice, tmp_path):
    plan_json = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "migration", "plan", "--workload", "mlp", "--preset", "tiny",
                           "--target", "local", "--global-batch", "8", "--json", str(plan_json)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    dump = tmp_path / "dump"
    mark = tmp_path / "PWNED"
    data = json.loads(plan_json.read_text())
    data["environment"]["XLA_FLAGS"] = {"value": f"--xla_dump_to={dump} --xla_dump_hlo_as_text", "why": "x"}
    data["environment"]["LD_PRELOAD"] = {"value": "/tmp/nothing.so", "why": f"ok\ntouch {mark}\n"}
    data["target_name"] = f"local\n$(touch {mark})\n"
    for d in data["decisions"]:
        d["reason"] += f"\n`touch {mark}`"
    plan_json.write_text(json.dumps(data))
    form = ["mlp", "tiny", "tpu-v5e-8", 8, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
            0, 0, "preset", "auto", 8]
    outputs = alice.predict(handle_file(str(plan_json)), 3, 0.003, False, False, False, False, False, *form,
                            "hostile-plan", "", "", api_name="/run")
    assert "Run finished" in outputs[0], outputs[0]
    assert not dump.exists(), "a flag from the file reached the worker"
    script = Path(value(outputs[6]))
    text = script.read_text()
    assert "LD_PRELOAD" not in text and "xla_dump" not in text
    subprocess.run(["bash", str(script)], capture_output=True, timeout=60, check=False,
                   env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert not mark.exists(), "the snippet ran text from the file"


# -- 4. isolation by default -----------------------------------------------------------------------

def test_a_user_sees_compares_and_exports_only_their_own_runs(box, alice, bob, alices_run):
    with pytest.raises(AppError, match="scope: everyone's history is open only to the admins"):
        bob.predict("everyone", "all", "all", "all", api_name="/history")
    mine = alice.predict(*HISTORY_ARGS, api_name="/history")
    ids = [row[0] for row in mine["data"] if row[3] == "alice-secret-run"]
    assert ids
    theirs = bob.predict(*HISTORY_ARGS, api_name="/history")
    assert all(row[2] != "alice" and "alice" not in row[3] for row in theirs["data"])
    with pytest.raises(AppError, match="scope: everyone's history is open only"):
        bob.predict(f"{ids[0]},{ids[0]}", "everyone", api_name="/compare")
    with pytest.raises(AppError, match="the selection has 0 run"):
        bob.predict(f"{ids[0]},{ids[0]}", "mine", api_name="/compare")
    csv = Path(value(bob.predict(",".join(map(str, ids)), "mine", api_name="/export_csv"))).read_text()
    assert "alice" not in csv and "secret" not in csv


def test_the_pages_history_buttons_show_bob_only_a_refusal_for_alices_runs(box, alice, alices_run):
    """The History buttons' page twins (unqueued, answering in a message, never a 500) read through the
    same scope as the API: bob calling them as the page does, with alice's ids, gets his own nothing."""
    server = box["auth"]
    alices = [row[0] for row in alice.predict(*HISTORY_ARGS, api_name="/history")["data"]
              if row[3] == "alice-secret-run"]
    assert alices
    cookies = login_cookies(server, "bob")

    def page(api: str, data: list[Any]) -> tuple[int, Any]:
        r = httpx.post(f"{server.url}gradio_api/run/predict", cookies=cookies, timeout=60,
                       json={"data": data, "fn_index": _fn_index(server, cookies, api),
                             "session_hash": f"bob-{os.urandom(6).hex()}"})
        return r.status_code, r.json()

    ids = ",".join(map(str, alices))
    status, out = page("page_compare", [ids, "mine"])
    assert status == 200 and "the selection has 0 run" in out["data"][0] and "alice" not in json.dumps(out)
    status, out = page("page_history", ["everyone", "all", "all", "all"])
    assert status == 200 and "everyone's history is open only" in out["data"][1]
    status, out = page("page_export", [ids, "mine"])
    assert status == 200 and out["data"][1].startswith("Exported")
    exported = out["data"][0]
    path = Path((exported.get("value") or exported)["path"])
    assert "alice" not in path.read_text() and "secret" not in path.read_text()
    status, out = page("page_compare", ["3,x", "mine"])  # not ids: said, not a 500
    assert status == 200 and "must be run ids" in out["data"][0]


def test_exports_have_unguessable_names_and_are_served_to_their_owner_only(box, alice, alices_run):
    server = box["auth"]
    report = Path(value(alices_run[3]))
    assert re.fullmatch(r"report-mlp-tiny-\d{8}-\d{6}-[A-Za-z0-9_-]{16}", report.stem), report.stem  # a secrets token
    exported = [p for p in (server.cache / "exports").rglob("report-*.csv")]
    assert exported and all(p.parent.name.startswith("alice-") for p in exported)
    url = f"{server.url}gradio_api/file={exported[0]}"
    assert httpx.get(url, cookies=login_cookies(server, "alice"), timeout=30).status_code == 200
    for cookies in (login_cookies(server, "bob"), None):
        r = httpx.get(url, cookies=cookies, timeout=30)
        assert r.status_code in (401, 403, 404) and "per_device_batch" not in r.text, r.status_code


# -- 5. the web layer ------------------------------------------------------------------------------

def test_cross_origin_calls_are_refused_and_cookies_are_not_samesite_none(box):
    server = box["auth"]
    cookies = login_cookies(server, "alice")
    body = json.dumps({"data": list(HISTORY_ARGS)})
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{server.port}.evil.example"):
        r = httpx.post(f"{server.url}gradio_api/call/history", content=body, cookies=cookies, timeout=30,
                       headers={"content-type": "application/json", "origin": origin})
        assert r.status_code == 403 and "cross-origin" in r.text, (origin, r.status_code)
    same = httpx.post(f"{server.url}gradio_api/call/history", content=body, cookies=cookies, timeout=30,
                      headers={"content-type": "application/json", "origin": server.url.rstrip("/")})
    assert same.status_code == 200
    login = httpx.post(f"{server.url}login/", data={"username": "bob", "password": USERS["bob"]}, timeout=30)
    set_cookies = login.headers.get_list("set-cookie")
    assert set_cookies and not any("samesite=none" in c.lower() for c in set_cookies), set_cookies


def test_a_request_for_another_host_name_is_refused(box):
    for server in (box["auth"], box["open"]):
        r = httpx.get(server.url, headers={"host": "rebind.evil.example", **server.headers}, timeout=30)
        assert r.status_code == 403 and "does not answer as" in r.text


def test_gradio_session_routes_need_the_sessions_user(box):
    server = box["auth"]
    base = f"{server.url}gradio_api"
    cancel = {"session_hash": "alicesession1", "fn_index": 0, "event_id": "e1"}
    assert httpx.post(f"{base}/cancel", json=cancel, timeout=30).status_code == 401
    assert httpx.get(f"{base}/heartbeat/alicesession1", timeout=5).status_code == 401
    alice_cookies, bob_cookies = login_cookies(server, "alice"), login_cookies(server, "bob")
    joined = httpx.post(f"{base}/queue/join", json={"data": list(HISTORY_ARGS), "fn_index": 0,
                                                    "session_hash": "alicesession1"}, cookies=alice_cookies, timeout=30)
    assert joined.status_code == 200, joined.text
    r = httpx.post(f"{base}/cancel", json=cancel, cookies=bob_cookies, timeout=30)
    assert r.status_code == 404 and "no such event of yours" in r.text  # e1 is no event of bob's
    r = httpx.post(f"{base}/cancel", json={**cancel, "event_id": None}, cookies=bob_cookies, timeout=30)
    assert r.status_code == 403 and "another user" in r.text
    # The direct routes a page uses for its unqueued events, and the session's deep link, alike.
    direct = {"data": list(HISTORY_ARGS), "fn_index": 0, "session_hash": "alicesession1"}
    r = httpx.post(f"{base}/run/history", json=direct, cookies=bob_cookies, timeout=30)
    assert r.status_code == 403 and "another user" in r.text
    r = httpx.get(f"{base}/deep_link", params={"session_hash": "alicesession1"}, cookies=bob_cookies, timeout=30)
    assert r.status_code == 403 and "another user" in r.text
    r = httpx.post(f"{base}/api/history", json=direct, cookies=bob_cookies, timeout=30)
    assert r.status_code == 403 and "another user" in r.text
    component = {"session_hash": "alicesession1", "component_id": 1, "fn_name": "x", "data": None}
    r = httpx.post(f"{base}/component_server", json=component, cookies=bob_cookies, timeout=30)
    assert r.status_code == 404 and "not served by this app" in r.text  # no component has a server function
    assert httpx.post(f"{base}/run/history", json=direct, cookies=alice_cookies, timeout=30).status_code == 200


def test_without_auth_the_server_answers_only_with_its_printed_token(box):
    server = box["open"]
    line = server.first_line()
    assert f"?token={server.token}" in line
    assert httpx.get(server.url, timeout=30).status_code == 401
    assert httpx.post(f"{server.url}gradio_api/call/history", json={"data": list(HISTORY_ARGS)},
                      timeout=30).status_code == 401
    r = httpx.get(f"{server.url}?token={server.token}", timeout=30)
    assert r.status_code == 200 and "migration-token" in r.headers.get("set-cookie", "")
    assert httpx.get(server.url, cookies=r.cookies, timeout=30).status_code == 200
    assert httpx.get(f"{server.url}?token=wrong", timeout=30).status_code == 401


def test_a_worker_has_no_secret_in_its_environment(box, alice):
    server = box["auth"]
    form = ["mlp", "tiny", "tpu-v5e-8", 8, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
            0, 0, "preset", "auto", 8]
    job = alice.submit(None, 5000, 0.003, False, False, False, False, False, *form, "long", "", "", api_name="/run")
    try:
        pid = server.wait_for_worker()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0] for e in environ if e}
        assert b"MIGRATION_AUTH" not in names and b"MIGRATION_TOKEN" not in names
        assert not any(USERS["alice"].encode() in e for e in environ)
    finally:
        job.cancel()
        wait_until(lambda: server.workers() == [], 30)


def test_the_servers_files_are_private(box, alices_run):
    server = box["auth"]
    assert stat.S_IMODE(server.db.stat().st_mode) & 0o077 == 0, oct(server.db.stat().st_mode)
    for folder in (server.cache / "exports", *(server.cache / "exports").iterdir()):
        if folder.is_dir():
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


@pytest.mark.parametrize("setup, message", [
    (lambda p: (p.write_text("alice:pw1\n"), os.chmod(p, 0o600)), "plain-text password"),
    (lambda p: (p.write_text(""), os.chmod(p, 0o644)), "can be read by other users"),
])
def test_a_users_file_with_plain_passwords_or_open_to_others_is_refused(tmp_path, setup, message):
    users = tmp_path / "users.txt"
    setup(users)
    done = subprocess.run([sys.executable, "app.py", "--auth-file", str(users), "--port", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-500:]


def test_an_export_dir_holding_someone_elses_files_is_refused(tmp_path):
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    done = subprocess.run([sys.executable, "app.py", "--export-dir", str(folder), "--port", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not this app's exports folder" in done.stderr
    assert (folder / "thesis.tex").exists()


# -- 8. the fuzz -----------------------------------------------------------------------------------

ENDPOINTS = {"/plan": 24, "/run": 34, "/autotune": 4, "/stop": 0, "/cancel_job": 1, "/history": 4, "/compare": 2,
             "/export_csv": 2, "/export_history_csv": 1, "/code_check": 2, "/serve_plan": 22, "/serve_run": 23,
             "/serve_stop": 0}
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=200), st.text(alphabet=st.characters(codec="utf-8"), max_size=5000),
                   st.sampled_from(["mine", "everyone", "local", "transformer", "tiny", "1,2", "../../etc/passwd",
                                    "=cmd|' /C calc'!A0", "\u202e", "\0"]))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=12)


def _fuzz_call(server: Server, cookies: httpx.Cookies, api: str, data: list[Any]) -> tuple[int, str]:
    url = f"{server.url}gradio_api/call/{api.strip('/')}"
    r = httpx.post(url, content=json.dumps({"data": data}), cookies=cookies, timeout=60,
                   headers={"content-type": "application/json"})
    if r.status_code != 200:
        return r.status_code, r.text
    event_id = r.json()["event_id"]
    with httpx.stream("GET", f"{url}/{event_id}", cookies=cookies, timeout=120) as stream:
        text = "".join(stream.iter_text())
    return 200, text


# 40 fixed examples in the suite (about 2 s each: a real round trip plus bob's timed history read);
# MIGRATION_FUZZ_EXAMPLES=500 for a deeper run
@settings(max_examples=int(os.environ.get("MIGRATION_FUZZ_EXAMPLES", "40")), deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
@given(api=st.sampled_from(sorted(ENDPOINTS)), data=st.data())
def test_fuzz_every_endpoint(box, bob, api, data):
    server = box["auth"]
    cookies = _cookies(server)
    n = ENDPOINTS[api]
    args = data.draw(st.one_of(st.lists(VALUES, min_size=n, max_size=n), VALUES, st.lists(VALUES, max_size=n + 3)))
    status, text = _fuzz_call(server, cookies, api, args if isinstance(args, list) else [args])
    assert status != 500 and status < 500, (api, status, text[:300])
    assert "Traceback" not in text and 'File "' not in text, (api, text[:500])
    assert timed_history(bob) < HISTORY_WITHIN_S


_COOKIES: dict[str, httpx.Cookies] = {}


def _cookies(server: Server) -> httpx.Cookies:
    if "alice" not in _COOKIES:
        _COOKIES["alice"] = login_cookies(server, "alice")
    return _COOKIES["alice"]


def test_after_the_fuzz_the_history_is_whole_and_the_server_answers(box, bob):
    server = box["auth"]
    with sqlite3.connect(server.db) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert timed_history(bob) < HISTORY_WITHIN_S
    assert server.proc.poll() is None


# -- 9. the allow-list: every route for its owner only (generated from ui/routes.py) -----------------

ALICE_MARK = "alice-secret-run"
CONTENT_TYPES = ("application/json", "application/JSON", "text/plain", "application/x-www-form-urlencoded", None)  # the fuzz's


def _fn_index(server: Server, cookies: httpx.Cookies, api: str) -> int:
    config = httpx.get(f"{server.url}config", cookies=cookies, timeout=30).json()
    return next(d["id"] for d in config["dependencies"] if (d.get("api_name") or "").strip("/") == api)


@pytest.fixture(scope="module")
def alices_names(box, alice, alices_run):
    """Alice's session hash (bound by her queue/join), an event of hers (a /call she has not read yet), and
    her live run (a long one, in her gradio_client session) that bob's requests must not change."""
    server = box["auth"]
    cookies = login_cookies(server, "alice")
    session = f"alice-{os.urandom(6).hex()}"
    joined = httpx.post(f"{server.url}gradio_api/queue/join", cookies=cookies, timeout=30,
                        json={"data": list(HISTORY_ARGS), "fn_index": _fn_index(server, cookies, "history"),
                              "session_hash": session})
    assert joined.status_code == 200, joined.text
    called = httpx.post(f"{server.url}gradio_api/call/history", json={"data": list(HISTORY_ARGS)}, cookies=cookies,
                        timeout=30)
    assert called.status_code == 200, called.text
    # a global batch of 512: 100,000 steps outlast the module however slow the machine (8 ended within it once)
    form = ["mlp", "tiny", "tpu-v5e-8", 512, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
            0, 0, "preset", "auto", 8]
    job = alice.submit(None, 100_000, 0.003, False, False, False, False, False, *form, "alice-live", "", "",
                       api_name="/run")
    server.wait_for_worker()
    yield {"session": session, "event": called.json()["event_id"], "cookies": cookies, "job": job,
           "client_session": alice.session_hash}
    job.cancel()
    wait_until(lambda: server.workers() == [], 60)


def _bob_request(server: Server, cookies: httpx.Cookies | None, method: str, target: str, kind: str | None,
                 body: bytes) -> httpx.Response:
    headers = {"content-type": kind} if kind else {}
    with httpx.stream(method, f"{server.url}{target.lstrip('/')}", content=body or None, headers=headers,
                      cookies=cookies, timeout=10) as r:
        text = b""
        for chunk in r.iter_bytes():  # a stream that answered: read a little, then leave
            text += chunk
            if len(text) > 20_000:
                break
        r._content = text  # noqa: SLF001 - keep what was read for the assertions
        return r


@st.composite
def spellings(draw: st.DrawFn) -> Any:
    """How a request spells its media types, charset, boundary and chunking, as hypothesis draws them."""
    from bench.flood import Spelling
    return Spelling(case=tuple(draw(st.lists(st.booleans(), min_size=1, max_size=12))),
                    json_type=draw(st.sampled_from((None, "application/json", "application/vnd.gradio+json"))),
                    charset=draw(st.sampled_from(("", "; charset=utf-8", "; Charset=UTF-16", " ; charset=latin-1"))),
                    boundary=draw(st.sampled_from(("b0undary", "----WebKitFormBoundaryAbC", "x"))),
                    text_type=draw(st.sampled_from(("text/plain", "application/octet-stream", "text/json"))),
                    chunked=draw(st.booleans()))


@pytest.fixture(scope="module")
def bobs_client(box):
    with httpx.Client(cookies=_bob_cookies(box["auth"]), timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def bobs_event(box):
    cookies = _bob_cookies(box["auth"])
    called = httpx.post(f"{box['auth'].url}gradio_api/call/history", json={"data": list(HISTORY_ARGS)},
                        cookies=cookies, timeout=30)
    assert called.status_code == 200, called.text
    return called.json()["event_id"]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("template", named_templates())
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_bob_naming_alices_session_or_event_in_any_encoding_is_refused_on_every_route(box, alices_names, bobs_event,
                                                                                       bobs_client, template, encoding,
                                                                                       data):
    """The route table crossed with every way a body, a query or a header can carry a name: bob names
    alice's session or event (his own in the path, so the foreign name is the only one) and the guard
    refuses it before Gradio sees it, whatever the encoding, its spelling, its charset or chunking."""
    server = box["auth"]
    key = "session_hash" if encoding == "header" else data.draw(st.sampled_from(("session_hash", "event_id")))
    value = alices_names["session"] if key == "session_hash" else alices_names["event"]
    how = data.draw(spellings())
    status, text = foreign_attempt(server, bobs_client, template, encoding, key, value, how, bobs_event)
    assert refused_by_the_guard(status, text), (template, encoding, how, status, text[:300])
    assert ALICE_MARK not in text
    assert alices_names["job"].status().code.name not in ("FINISHED", "CANCELLED")


def test_a_flood_of_250_light_calls_holds_no_other_users_history_stop_or_cancel(box):
    """carol sends 250 light calls at once (history, Stop and cancel_job by every route a client can
    take), twice; bob's history and Stop (the page's unqueued calls) and cancel_job (a client's
    queued call) start as each flood lands and answer within max(3x their idle median, 0.5 s); carol's
    calls past her lanes are refused at once (429, saying when to retry), never queued."""
    from bench.flood import Page, flood
    server = box["auth"]
    result = flood(Page(server, "bob", USERS["bob"]), Page(server, "carol", USERS["carol"]), 250, bursts=2)
    assert all(row["within"] for row in result["rows"]), result["rows"]
    answers = result["answers"]
    assert answers.get("429", 0) >= 0.8 * 2 * 250 and answers.get("200", 0) > 0, answers  # most refused at once
    assert re.match(r"too many requests: .*retry in \d+ s", answers["sample"]) and answers["retry-after"], answers
    assert set(answers) <= {"200", "429", "sample", "retry-after"}, answers


def test_fresh_sessions_made_every_way_hold_the_servers_memory_to_the_cap(box):
    """1,000 requests of carol's, each naming a fresh session in one of the ways a session is made
    (heartbeat, queue join, unqueued call, a /call naming none, deep link, component_server): the
    server's memory grows by at most her cap of sessions times a session's state (bench/results/flood.json
    has the figure), and bob's page answers afterwards."""
    from bench.flood import Page, fresh_sessions
    from ui.ownership import OwnershipLimits
    server = box["auth"]
    carol, bob = Page(server, "carol", USERS["carol"]), Page(server, "bob", USERS["bob"])
    fresh = fresh_sessions(server, carol, 1000)
    # a session's state: 347 KB measured by bench/flood.py (bench/results/flood.json)
    assert fresh["rss_after_mb"] - fresh["rss_before_mb"] <= OwnershipLimits().sessions_per_user * 0.35, fresh
    assert set(fresh["answers"]["component_server"]) == {"404"}, fresh["answers"]
    assert bob.history() < HISTORY_WITHIN_S


def test_alices_page_still_works_after_every_attempt(box, alices_names):
    server = box["auth"]
    r = httpx.post(f"{server.url}gradio_api/run/history", cookies=alices_names["cookies"], timeout=30,
                   json={"data": list(HISTORY_ARGS), "fn_index": _fn_index(server, alices_names["cookies"], "history"),
                         "session_hash": alices_names["session"]})
    assert r.status_code == 200 and ALICE_MARK in r.text


def test_the_component_server_route_is_refused_in_every_encoding(box, alices_names):
    """The reported hole: component_server with a multipart body naming another user's session passed the
    guard (the same body as JSON got 403). No component of this app has a server function, so the route
    is refused whatever it carries (tests/test_routes.py fails if a component adds one)."""
    server = box["auth"]
    boundary = "b0undary"
    fields = {"session_hash": alices_names["session"], "component_id": "1", "fn_name": "x"}
    multipart = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                        for k, v in fields.items()) + f"--{boundary}--\r\n"
    for headers, body in (({"content-type": f"multipart/form-data; boundary={boundary}"}, multipart.encode()),
                          ({"content-type": "application/json"}, json.dumps(fields).encode())):
        for user_session in (fields["session_hash"], f"fresh-{os.urandom(4).hex()}"):
            r = httpx.post(f"{server.url}gradio_api/component_server", timeout=30, cookies=_bob_cookies(server),
                           headers=headers, content=body.replace(fields["session_hash"].encode(), user_session.encode()))
            assert r.status_code == 404 and "not served by this app" in r.text


def test_bob_reading_alices_event_by_its_id_or_her_session_hash_neither_streams_it_nor_cancels_it(box, alices_names):
    server = box["auth"]
    bob_cookies = login_cookies(server, "bob")
    for name in (alices_names["event"], alices_names["session"], alices_names["client_session"]):
        r = _bob_request(server, bob_cookies, "GET", f"gradio_api/call/history/{name}", None, b"")
        assert r.status_code == 404 and "no such event of yours" in r.text
    with httpx.stream("GET", f"{server.url}gradio_api/call/history/{alices_names['event']}",
                      cookies=alices_names["cookies"], timeout=60) as r:
        text = "".join(r.iter_text())
    assert r.status_code == 200 and "event: complete" in text and ALICE_MARK in text
    assert alices_names["job"].status().code.name not in ("FINISHED", "CANCELLED")


def _alices_export(server: Server) -> Path:
    exported = sorted((server.cache / "exports").rglob("report-*.csv"))
    assert exported and exported[0].parent.name.startswith("alice-")
    return exported[0]


def _path_variants(target: Path, server: Server) -> list[str]:
    """Ways to write alice's file's path from bob's folder: plain, `..`, encoded once and twice."""
    exports = server.cache / "exports"
    bob_folder = next((p.name for p in exports.iterdir() if p.name.startswith("bob-")), "bob-00000000")
    via_bob = f"{exports}/{bob_folder}/../{target.parent.name}/{target.name}"
    return [str(target), via_bob, via_bob.replace("..", "%2e%2e"), via_bob.replace("..", "%252e%252e"),
            via_bob.replace("/", "%2F"), str(target).replace("/", "%252F"), f"{exports}/./{target.parent.name}//{target.name}"]


@pytest.mark.parametrize("route", ["gradio_api/file=", "gradio_api/file/"])
def test_alices_files_reach_bob_by_no_path_on_any_file_route(box, alices_run, route):
    server = box["auth"]
    target = _alices_export(server)
    alice_cookies, bob_cookies = login_cookies(server, "alice"), login_cookies(server, "bob")
    assert httpx.get(f"{server.url}gradio_api/file={target}", cookies=alice_cookies, timeout=30).status_code == 200
    for variant in _path_variants(target, server):
        for cookies in (bob_cookies, None):
            r = httpx.get(f"{server.url}{route}{variant}", cookies=cookies, timeout=30)
            # 404 from the guard; 403 from Gradio for a path inside bob's own folder that it decodes again
            assert r.status_code in (401, 403, 404) and "per_device_batch" not in r.text, (variant, r.status_code)


def test_exports_are_served_from_their_owners_folder_not_from_gradios_cache(box, alices_run):
    """The link the app returns for an export points into the exports folder (served to its owner only),
    so no cache copy of it exists for another user to fetch."""
    server = box["auth"]
    target = _alices_export(server)
    copies = [p for p in (server.cache / "gradio").rglob(target.name)]
    assert copies == [], copies


def test_alices_upload_is_hers_to_read_and_to_use(box, alice, tmp_path):
    server = box["auth"]
    alice_cookies, bob_cookies = login_cookies(server, "alice"), login_cookies(server, "bob")
    plan = b'{"alice": "' + ALICE_MARK.encode() + b'-' + os.urandom(4).hex().encode() + b'"}'
    r = httpx.post(f"{server.url}gradio_api/upload", files={"files": ("plan.json", plan)}, cookies=alice_cookies,
                   timeout=30)
    assert r.status_code == 200, r.text
    path = r.json()[0]
    assert httpx.get(f"{server.url}gradio_api/file={path}", cookies=alice_cookies, timeout=30).content == plan
    r = httpx.get(f"{server.url}gradio_api/file={path}", cookies=bob_cookies, timeout=30)
    assert r.status_code == 404 and ALICE_MARK not in r.text
    # bob naming her upload as his run's plan file is refused before Gradio reads it
    file_data = {"path": path, "meta": {"_type": "gradio.FileData"}, "orig_name": "plan.json"}
    r = httpx.post(f"{server.url}gradio_api/call/run", json={"data": [file_data]}, cookies=bob_cookies, timeout=30)
    assert r.status_code == 403 and "not yours" in r.text


def test_a_100_mb_body_is_refused_before_it_is_read(box):
    server = box["auth"]
    cookies = login_cookies(server, "bob")
    before = _rss_mb(server.proc.pid)
    r = httpx.post(f"{server.url}gradio_api/queue/join", content=b"{" + b" " * (100 << 20) + b"}", cookies=cookies,
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 413 and "request body over" in r.text

    def chunks():  # no declared length: counted as it arrives
        for _ in range(100):
            yield b" " * (1 << 20)
    r = httpx.post(f"{server.url}gradio_api/queue/join", content=chunks(), cookies=cookies,
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 413
    assert _rss_mb(server.proc.pid) - before < 40


def test_an_upload_of_200_files_is_refused_and_leaves_no_file(box):
    server = box["auth"]
    cookies = login_cookies(server, "bob")
    files = [("files", (f"f{i}.py", f"x = {i}\n{os.urandom(8).hex()}\n".encode())) for i in range(200)]
    before = {p for p in (server.cache / "gradio").rglob("*") if p.is_file()}
    r = httpx.post(f"{server.url}gradio_api/upload", files=files, cookies=cookies, timeout=60)
    assert r.status_code == 413 and "at most 20 files" in r.text
    after = {p for p in (server.cache / "gradio").rglob("*") if p.is_file()}
    assert not [p for p in after - before if p.name.startswith("f") and p.suffix == ".py"]


def test_uploads_past_a_users_room_are_refused_and_other_users_still_upload(box):
    server = box["auth"]
    bob_cookies, alice_cookies = login_cookies(server, "bob"), login_cookies(server, "alice")
    refused = None
    for i in range(20):  # 4.5 MB each, under Gradio's 5 MB per file: the 64 MiB room is gone by the 15th
        r = httpx.post(f"{server.url}gradio_api/upload", cookies=bob_cookies, timeout=60,
                       files={"files": (f"big{i}.json", os.urandom(4_500_000))})
        if r.status_code != 200:
            refused = r
            break
    assert refused is not None and refused.status_code == 413, refused
    assert "left of your 64 MiB of uploads" in refused.text or "quota reached" in refused.text, refused.text
    leftovers = [p for p in (server.cache / "gradio").iterdir() if p.is_file() and p.stat().st_size > 1_000_000]
    assert not leftovers, "a refused upload left its partial file behind"
    r = httpx.post(f"{server.url}gradio_api/upload", files={"files": ("ok.py", b"x = 1\n")}, cookies=alice_cookies,
                   timeout=30)
    assert r.status_code == 200

    def chunks():  # an upload that does not say how long it is: refused before Gradio writes a byte
        yield b"--x\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.py\"\r\n\r\n"
        yield b"x = 1\r\n--x--\r\n"
    r = httpx.post(f"{server.url}gradio_api/upload", content=chunks(), cookies=alice_cookies, timeout=30,
                   headers={"content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 411 and "Content-Length" in r.text


def test_a_50000_finding_check_returns_a_capped_table_and_counts_the_rest(box, alice):
    server = box["auth"]
    before = _rss_mb(server.proc.pid)
    summary, table = alice.predict("import jax\n" + "jax.pmap(f)\n" * 50_000, [], api_name="/code_check")[:2]
    assert "50,000 finding(s)" in summary, summary[:300]
    assert "more: PMAP" in summary and "python -m migration check" in summary
    rows = value(table)["data"]
    assert 0 < len(rows) <= 200
    assert _rss_mb(server.proc.pid) - before < 40


def test_logout_is_refused_by_get_and_from_another_site(box):
    server = box["auth"]
    cookies = login_cookies(server, "bob")
    assert httpx.get(f"{server.url}logout", cookies=cookies, timeout=30).status_code == 405
    r = httpx.post(f"{server.url}logout", cookies=cookies, timeout=30)  # a form from nowhere: no Origin
    assert r.status_code == 403
    r = httpx.post(f"{server.url}logout", cookies=cookies, timeout=30, headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    assert httpx.get(f"{server.url}gradio_api/user", cookies=cookies, timeout=30).status_code == 200  # still signed in
    r = httpx.post(f"{server.url}logout", cookies=cookies, timeout=30, headers={"origin": server.url.rstrip("/")})
    assert r.status_code in (200, 302)
    assert httpx.get(f"{server.url}gradio_api/user", cookies=cookies, timeout=30).status_code == 401


def test_routes_outside_the_table_and_refused_ones_answer_nothing(box):
    server = box["auth"]
    cookies = login_cookies(server, "bob")
    for path in ("monitoring", "gradio_api/proxy=http://127.0.0.1:1/", "gradio_api/vibe-code", "openapi.json",
                 "gradio_api/no-such-route", "gradio_api/token"):
        r = httpx.get(f"{server.url}{path}", cookies=cookies, timeout=30)
        assert r.status_code == 404, (path, r.status_code)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


IDENTITIES = ("bob", "anonymous")
PLACEMENTS = ("path", "query", "body")


# MIGRATION_FUZZ_EXAMPLES=500 for a deeper run
@settings(max_examples=int(os.environ.get("MIGRATION_FUZZ_EXAMPLES", "40")), deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
@given(template=st.sampled_from([*named_templates(), "/gradio_api/file={path_or_url:path}"]),
       who=st.sampled_from(IDENTITIES), where=st.sampled_from(PLACEMENTS),
       kind=st.sampled_from(CONTENT_TYPES), method=st.sampled_from(("GET", "POST")),
       name=st.sampled_from(("session", "event", "client_session", "export")))
def test_fuzz_no_route_gives_bob_alices_data_or_changes_her_job(box, alices_names, template, who, where, kind, method,
                                                                  name):
    server = box["auth"]
    cookies = _bob_cookies(server) if who == "bob" else None
    value_ = str(_alices_export(server)) if name == "export" else alices_names[name]
    params = dict(PLACEHOLDERS, session_hash=value_ if where == "path" else "bob-own-session",
                  event_id=value_ if where == "path" else "bob-none", path_or_url=value_ if where == "path" else "x")
    target = re.sub(r"{(\w+)(:\w+)?}", lambda m: params[m.group(1)], template)
    body = b""
    if where == "query":
        target += f"?session_hash={value_}&event_id={value_}"
    elif where == "body":
        body = (f"session_hash={value_}".encode() if kind == "application/x-www-form-urlencoded" else
                json.dumps({"data": [{"path": value_, "meta": {"_type": "gradio.FileData"}}], "fn_index": 0,
                            "session_hash": value_, "event_id": value_}).encode())
    r = _bob_request(server, cookies, method, target, kind, body)
    assert r.status_code < 500, (template, r.status_code, r.text[:300])
    assert ALICE_MARK not in r.text and "per_device_batch" not in r.text, (template, where, r.text[:300])
    assert alices_names["job"].status().code.name not in ("FINISHED", "CANCELLED")


def _bob_cookies(server: Server) -> httpx.Cookies:
    if "bob" not in _COOKIES:
        _COOKIES["bob"] = login_cookies(server, "bob")
    return _COOKIES["bob"]
