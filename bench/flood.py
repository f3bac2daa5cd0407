"""One signed-in user's flood against another user's page, on the running app with auth (loopback).

Starts `app.py` with three users (alice floods, bob works, mallory guesses passwords), then measures, side
by side in one run:

1. Foreign sessions: bob names alice's session or event in every encoding (the route table crossed with
   JSON, nested and repeated keys, UTF-16, URL-encoded and multipart forms, a file part, text/plain, a
   header, the query; chunked and not): how many the guard refused and how many reached Gradio.
2. Fresh sessions: alice sends `--fresh` requests that each make a session in one of the ways there are
   (a heartbeat, a queue join, an unqueued call, a /call that names none, a deep link, component_server),
   fresh names every time. Reported: the server's resident memory per 1,000 such requests, and a
   session's size (the memory of `--sessions` sessions made at the pace the rate allows, divided) times
   the cap on one user's sessions: the most her flood may hold. Then bob's page still answers.
3. Flood: bob's history (the page's unqueued call), Stop (the page's unqueued call) and cancel_job (a
   client's queued /call) timed idle, then while alice sends `--flood` light calls at once (history,
   Stop and cancel_job by every route). Reported: bob's p50 and max under the flood over his idle p50
   (target: within max(3x idle, 0.5 s)), and what alice was answered (ok, 429 with a retry time).
4. Run lanes: alice submits `--runs` runs at once; then bob submits his first run. Reported: how alice's
   were answered (admitted, refused by the job service, refused at the gateway) and when bob's run
   started (its queue position and seconds to its first step) against the same run with nothing queued.
5. Sign-in: mallory guesses alice's password from another address for `--guess-s` seconds. Reported:
   guesses checked and refused, and whether alice signs in from her own address meanwhile.

    python bench/flood.py [--flood 250] [--fresh 10000] [--sessions 80] [--runs 50] [--guess-s 20]
                          [--json bench/results/flood.json]

`--flood 60 --fresh 600 --sessions 0 --runs 0 --guess-s 0` is the smoke size the suite runs
(tests/test_benches.py); tests/test_attacks.py runs the flood and the fresh sessions on its own server.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402
from tests.server import Server, users_file  # noqa: E402

USERS = {"alice": "pw-alice-flood", "bob": "pw-bob-works", "carol": "pw-carol-size", "mallory": "pw-mallory-x"}
HISTORY_ARGS = ["mine", "all", "all", "all"]
RUN_FORM = ["mlp", "tiny", "tpu-v5e-8", 8, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
            0, 0, "preset", "auto", 8]
WITHIN_FACTOR, WITHIN_FLOOR_S = 3.0, 0.5
ACTIONS = {"history": HISTORY_ARGS, "stop": [None], "cancel_job": ["999999"]}  # the light actions, their data


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def sign_in(server: Server, user: str, password: str | None = None, address: str | None = None) -> httpx.Cookies:
    headers = {"x-forwarded-for": address} if address else {}
    r = httpx.post(f"{server.url}login/", data={"username": user, "password": password or USERS[user]},
                   headers=headers, timeout=30)
    r.raise_for_status()
    return r.cookies


class Page:
    """A signed-in user's page: their cookies, a session and the function indices of the light events."""

    def __init__(self, server: Server, user: str, password: str | None = None):
        self.server, self.user = server, user
        self.cookies = sign_in(server, user, password)
        self.http = httpx.Client(cookies=self.cookies, timeout=60)  # one connection, kept, as a page's
        self.session = f"{user}-page-{os.urandom(6).hex()}"
        config = self.http.get(f"{server.url}config").json()
        self.fn = {(d.get("api_name") or "").strip("/"): d["id"] for d in config["dependencies"]}
        self.base = f"{server.url}gradio_api"

    def unqueued(self, api: str, data: list[Any]) -> httpx.Response:
        return self.http.post(f"{self.base}/run/{api}",
                              json={"data": data, "fn_index": self.fn[api], "session_hash": self.session})

    def history(self) -> float:
        t0 = time.monotonic()
        r = self.unqueued("history", HISTORY_ARGS)
        assert r.status_code == 200, r.text[:300]
        return time.monotonic() - t0

    def stop(self) -> float:
        t0 = time.monotonic()
        r = self.unqueued("stop", [None])
        assert r.status_code == 200 and "Nothing of yours" in r.text, r.text[:300]
        return time.monotonic() - t0

    def cancel_job(self) -> float:
        return self.called("cancel_job")

    def called(self, api: str) -> float:
        """A client's queued call: POST /call, then its result's stream to the end."""
        t0 = time.monotonic()
        r = self.http.post(f"{self.base}/call/{api}", json={"data": ACTIONS[api]})
        assert r.status_code == 200, r.text[:300]
        with self.http.stream("GET", f"{self.base}/call/{api}/{r.json()['event_id']}") as s:
            text = "".join(s.iter_text())
        assert "event: error" in text or "event: complete" in text, text[:300]
        return time.monotonic() - t0


def timings(page: Page, n: int, by_call: bool = False, only: str | None = None) -> dict[str, list[float]]:
    """`n` of each light action (or `only` one), paced within the user's own rate: as the page sends them,
    or (`by_call`) each as a client's queued /call (a path every version of the app has)."""
    out: dict[str, list[float]] = {name: [] for name in ACTIONS if only in (None, name)}
    for _ in range(n):
        for name in out:
            out[name].append(page.called(name) if by_call else getattr(page, name)())
            time.sleep(0.25)
    return out


async def _flood(page: Page, n: int, sent: threading.Event | None = None, only: str | None = None) -> dict[str, int]:
    """`n` light calls of `page`'s user at once, every route a client can take (or `only` that action, each a
    /call); what each was answered. `sent` is set once every one of them is on its way."""
    answers: dict[str, int] = {}
    kinds = ([("call", only, ACTIONS[only])] if only else
             [("run", "history", HISTORY_ARGS), ("call", "history", HISTORY_ARGS), ("join", "history", HISTORY_ARGS),
              ("run", "stop", [None]), ("call", "cancel_job", ["999999"])])
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    started = [0]

    async def count(_request: httpx.Request) -> None:
        started[0] += 1
        if sent is not None and started[0] >= n:
            sent.set()
    async with httpx.AsyncClient(cookies=page.cookies, timeout=120, limits=limits,
                                 event_hooks={"request": [count]}) as client:
        async def one(i: int) -> None:
            how, api, data = kinds[i % len(kinds)]
            if how == "call":
                r = await client.post(f"{page.base}/call/{api}", json={"data": data})
            else:
                body = {"data": data, "fn_index": page.fn[api], "session_hash": page.session}
                r = await client.post(f"{page.base}/{'run/' + api if how == 'run' else 'queue/join'}", json=body)
            key = f"{r.status_code}"
            if r.status_code == 429:
                answers.setdefault("sample", r.json()["error"])  # type: ignore[arg-type]
                answers.setdefault("retry-after", r.headers.get("retry-after"))  # type: ignore[arg-type]
            answers[key] = answers.get(key, 0) + 1
        await asyncio.gather(*(one(i) for i in range(n)))
    return answers


def flood(victim: Page, flooder: Page, n: int, bursts: int = 8, by_call: bool = False,
          only: str | None = None) -> dict[str, Any]:
    """The victim's light actions idle, then during each of `bursts` floods of `n` calls sent at once (the
    victim's history, Stop and cancel_job start just after the last of the flood's calls is sent)."""
    idle = timings(victim, bursts, by_call, only)
    under: dict[str, list[float]] = {name: [] for name in idle}
    answers: list[dict[str, int]] = []
    for _ in range(bursts):
        sent = threading.Event()
        burst = threading.Thread(target=lambda: answers.append(asyncio.run(_flood(flooder, n, sent, only))))
        burst.start()
        sent.wait(30)  # every call of the flood is on its way: the victim's go behind them
        time.sleep(0.02)
        for name in under:
            under[name].append(victim.called(name) if by_call else getattr(victim, name)())
        burst.join()
        time.sleep(1.5)  # the flooder's rate refills a little between bursts
    rows = []
    for name in idle:
        p50_idle = statistics.median(idle[name])
        bound = max(WITHIN_FACTOR * p50_idle, WITHIN_FLOOR_S)
        rows.append({"action": name, "idle_p50_ms": 1e3 * p50_idle, "flood_p50_ms": 1e3 * statistics.median(under[name]),
                     "flood_max_ms": 1e3 * max(under[name]), "bound_ms": 1e3 * bound,
                     "ratio": statistics.median(under[name]) / p50_idle, "within": max(under[name]) <= bound})
    total: dict[str, Any] = {}
    for a in answers:
        for k, v in a.items():
            total[k] = v if isinstance(v, str) or v is None else total.get(k, 0) + v
    return {"rows": rows, "answers": total, "floods": len(answers)}


ENCODINGS = ("json", "json-nested", "json-repeated-key", "json-utf16", "urlencoded", "multipart", "multipart-file",
             "text", "header", "query")
GUARD_REFUSED = re.compile(r"another user|no such event of yours|takes a JSON body|takes no request body|"
                           r"not valid JSON|appears twice")
PLACEHOLDERS = {"api_name": "history", "run": "r0", "component_id": "1", "segment_id": "0", "ext": "ts",
                "path": "x", "path_or_url": "x"}


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How a request spells what it carries: the media types' capitalisation (`case`: one flag a letter,
    repeated), the JSON content type (None: no header), a charset parameter, the multipart boundary, the
    type of a text body, and whether the body comes in chunks."""

    case: tuple[bool, ...] = (False,)
    json_type: str | None = "application/json"
    charset: str = ""
    boundary: str = "b0undary"
    text_type: str = "text/plain"
    chunked: bool = False

    def spell(self, text: str) -> str:
        return "".join(c.upper() if self.case[i % len(self.case)] else c for i, c in enumerate(text))


def encode_names(encoding: str, key: str, value: str, how: Spelling) -> tuple[str, dict[str, str], bytes]:
    """(query, headers, body) of a request naming `value` under `key` in `encoding`, spelled `how`."""
    call = {"data": HISTORY_ARGS, "fn_index": 0}
    headers = {"content-type": how.spell(how.json_type) + how.charset} if how.json_type else {}
    if encoding in ("json", "json-nested", "json-utf16"):
        body_obj = {**call, key: value} if encoding != "json-nested" else {**call, "data": [{"x": {key: value}}]}
        return "", headers, json.dumps(body_obj).encode("utf-16" if encoding == "json-utf16" else "utf-8")
    if encoding == "json-repeated-key":  # the caller's own value first, the named one last (what a parser keeps)
        return "", headers, f'{{"data": [], "fn_index": 0, "{key}": "own", "{key}": "{value}"}}'.encode()
    if encoding == "urlencoded":
        kind = how.spell("application/x-www-form-urlencoded") + how.charset
        return "", {"content-type": kind}, f"{key}={value}&component_id=1&fn_name=x".encode()
    if encoding in ("multipart", "multipart-file"):
        b = how.boundary
        file = '; filename="s.txt"' if encoding == "multipart-file" else ""
        body = (f'--{b}\r\nContent-Disposition: form-data; name="{key}"{file}\r\n\r\n{value}\r\n'
                f'--{b}\r\nContent-Disposition: form-data; name="fn_name"\r\n\r\nx\r\n--{b}--\r\n')
        return "", {"content-type": how.spell("multipart/form-data") + f"; boundary={b}"}, body.encode()
    if encoding == "text":
        return "", {"content-type": how.spell(how.text_type) + how.charset}, json.dumps({**call, key: value}).encode()
    if encoding == "header":
        return "", {**headers, how.spell("session_hash"): value}, json.dumps(call).encode()
    return f"?{key}={value}", headers, json.dumps(call).encode()  # query


def named_templates() -> list[str]:
    from ui.routes import ROUTES, Access
    return sorted(t for t, rule in ROUTES.items() if rule.access in (Access.SESSION, Access.EVENT))


def foreign_attempt(server: Server, client: httpx.Client, template: str, encoding: str, key: str, value: str,
                    how: Spelling, own_event: str) -> tuple[int, str]:
    """One request on `template` naming `value` (someone else's) in `encoding`; the caller's own session
    and event in the path, so the named value is the only foreign name. (status, the first of the text)."""
    from ui.routes import JSON, ROUTES
    query, headers, body = encode_names(encoding, key, value, how)
    params = dict(PLACEHOLDERS, session_hash=f"own-{os.urandom(4).hex()}", event_id=own_event)
    path = re.sub(r"{(\w+)(:\w+)?}", lambda m: params[m.group(1)], template)
    method = "POST" if ROUTES[template].body == JSON or template.endswith("/close") else "GET"
    content = iter([body[:7], body[7:]]) if how.chunked else body
    with client.stream(method, f"{server.url}{path.lstrip('/')}{query}", content=content, headers=headers,
                       timeout=10) as r:
        return r.status_code, r.read().decode("utf-8", "replace")[:2000]


def refused_by_the_guard(status: int, text: str) -> bool:
    return status == 405 or (status in (400, 403, 404, 415) and bool(GUARD_REFUSED.search(text)))


def foreign_sessions(server: Server, victim: Page, attacker: Page, spellings: int = 2) -> dict[str, Any]:
    """The route table crossed with every encoding: the attacker names the victim's session or event,
    in `spellings` spellings each; how many the guard refused, and how many it let through to Gradio."""
    import random
    rng = random.Random(0)
    called = victim.http.post(f"{victim.base}/call/history", json={"data": HISTORY_ARGS})
    own = attacker.http.post(f"{attacker.base}/call/history", json={"data": HISTORY_ARGS})
    victim.unqueued("history", HISTORY_ARGS)  # binds the victim's page session
    names = {"session_hash": victim.session, "event_id": called.json()["event_id"]}
    counts = {"requests": 0, "refused": 0, "passed": 0}
    passed: list[str] = []
    for template in named_templates():
        for encoding in ENCODINGS:
            for key in (("session_hash",) if encoding == "header" else tuple(names)):
                for _ in range(spellings):
                    how = Spelling(case=tuple(rng.random() < 0.5 for _ in range(7)),
                                   json_type=rng.choice((None, "application/json", "application/vnd.gradio+json")),
                                   charset=rng.choice(("", "; charset=utf-8", "; Charset=UTF-16")),
                                   boundary=rng.choice(("b0undary", "----WebKitFormBoundaryAbC")),
                                   text_type=rng.choice(("text/plain", "application/octet-stream")),
                                   chunked=rng.random() < 0.5)
                    status, text = foreign_attempt(server, attacker.http, template, encoding, key, names[key],
                                                   how, own.json()["event_id"])
                    counts["requests"] += 1
                    if refused_by_the_guard(status, text):
                        counts["refused"] += 1
                    else:
                        counts["passed"] += 1
                        passed.append(f"{template} {encoding} {key}: {status} {text[:80]}")
    return {**counts, "passed_examples": passed[:5], "templates": len(named_templates())}


def fresh_sessions(server: Server, page: Page, n: int) -> dict[str, Any]:
    """`n` requests of `page`'s user that each name a fresh session, cycling through every way one is made;
    the server's memory before and after, and what they were answered."""
    ways = ["heartbeat", "join", "run", "call", "deep_link", "component_server"]
    answers: dict[str, dict[str, int]] = {w: {} for w in ways}
    pid = server.proc.pid
    before = rss_mb(pid)
    t0 = time.monotonic()
    with httpx.Client(cookies=page.cookies, timeout=30) as client:
        for i in range(n):
            way, fresh = ways[i % len(ways)], f"fresh-{i}-{os.urandom(4).hex()}"
            body = {"data": HISTORY_ARGS, "fn_index": page.fn["history"], "session_hash": fresh}
            if way == "heartbeat":
                with client.stream("GET", f"{page.base}/heartbeat/{fresh}") as r:
                    status = r.status_code
            elif way == "join":
                status = client.post(f"{page.base}/queue/join", json=body).status_code
            elif way == "run":
                status = client.post(f"{page.base}/run/history", json=body).status_code
            elif way == "call":
                status = client.post(f"{page.base}/call/history", json={"data": HISTORY_ARGS}).status_code
            elif way == "deep_link":
                status = client.get(f"{page.base}/deep_link", params={"session_hash": fresh}).status_code
            else:
                status = client.post(f"{page.base}/component_server", files={"session_hash": (None, fresh),
                                     "component_id": (None, "1"), "fn_name": (None, "x")}).status_code
            answers[way][str(status)] = answers[way].get(str(status), 0) + 1
    wall = time.monotonic() - t0
    time.sleep(1.0)
    after = rss_mb(pid)
    return {"requests": n, "wall_s": wall, "rss_before_mb": before, "rss_after_mb": after,
            "mb_per_1000": (after - before) * 1000 / max(n, 1), "answers": answers}


def session_size(server: Server, page: Page, n: int) -> dict[str, Any]:
    """The memory a session's state takes in the server: `n` fresh sessions, each opened by a queued history
    call paced within the user's rate (so that every one is admitted and Gradio makes its state), then the
    resident memory's growth per session, and the number the cap lets one user keep."""
    pid = server.proc.pid
    before = rss_mb(pid)
    with httpx.Client(cookies=page.cookies, timeout=30) as client:
        for i in range(n):
            body = {"data": HISTORY_ARGS, "fn_index": page.fn["history"], "session_hash": f"size-{i}"}
            r = client.post(f"{page.base}/run/history", json=body)
            assert r.status_code == 200, r.text[:200]
            time.sleep(0.21)
    time.sleep(1.0)
    grown = rss_mb(pid) - before
    return {"sessions": n, "grown_mb": grown}


def run_lanes(server: Server, flooder: Page, victim: Page, n: int) -> dict[str, Any]:
    """The victim's first run with nothing queued, then again after the flooder submitted `n` runs at once."""
    def submit(page: Page, label: str) -> httpx.Response:
        data = [None, 2, 0.003, False, False, False, False, False, *RUN_FORM, label, "", ""]
        return httpx.post(f"{page.base}/call/run", json={"data": data}, cookies=page.cookies, timeout=120)

    def first_step_s(page: Page, label: str) -> tuple[float, str]:
        t0 = time.monotonic()
        r = submit(page, label)
        assert r.status_code == 200, r.text[:300]
        lines = []
        with httpx.stream("GET", f"{page.base}/call/run/{r.json()['event_id']}", cookies=page.cookies,
                          timeout=1800) as s:
            for line in s.iter_lines():
                lines.append(line)
                if "Run finished" in line or "event: error" in line:
                    break
        found = next((re.search(r"position \d+[^\"\\]{0,40}", ln) for ln in lines if "position" in ln), None)
        return time.monotonic() - t0, found.group(0) if found else ""

    first_step_s(victim, "bob alone, warming up")
    alone_s, _ = first_step_s(victim, "bob alone")
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        floods = [pool.submit(submit, flooder, f"alice {i}") for i in range(n)]
        answered = [f.result() for f in floods]
        time.sleep(0.5)
        behind_s, position = first_step_s(victim, "bob behind alice")
    codes: dict[str, int] = {}
    for r in answered:
        codes[str(r.status_code)] = codes.get(str(r.status_code), 0) + 1
    return {"alone_s": alone_s, "behind_s": behind_s, "position": position, "alice_answers": codes}


def guessing(server: Server, seconds: float) -> dict[str, Any]:
    """mallory guesses alice's password from 10.6.6.6 for `seconds`; alice signs in from her own address
    (127.0.0.1, known: she signed in from it before) every second meanwhile, and once from a new one."""
    sign_in(server, "alice")  # her address is known
    counts = {"checked": 0, "refused": 0}
    alice_ok, deadline = [], time.monotonic() + seconds
    with httpx.Client(timeout=30) as client:
        last_alice = 0.0
        while time.monotonic() < deadline:
            r = client.post(f"{server.url}login/", data={"username": "alice", "password": "guess"},
                            headers={"x-forwarded-for": "10.6.6.6"})
            counts["refused" if r.status_code == 429 else "checked"] += 1
            if time.monotonic() - last_alice > 1.0:
                last_alice = time.monotonic()
                ok = httpx.post(f"{server.url}login/", data={"username": "alice", "password": USERS["alice"]},
                                timeout=30)
                alice_ok.append(ok.status_code == 200)
        new_address = client.post(f"{server.url}login/", data={"username": "alice", "password": USERS["alice"]},
                                  headers={"x-forwarded-for": "10.7.7.7"}).status_code
    return {"seconds": seconds, **counts, "alice_signed_in": sum(alice_ok), "alice_tries": len(alice_ok),
            "new_address_status": new_address}


def before_and_after(before: Path, args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """Each light action flooded by itself, as the hosting review did it: alice sends `--flood` /calls of
    it at once and bob's own /call of it is timed (idle, then as each of 4 floods lands); and the fresh
    sessions. Against `before`'s app, then this checkout's, one after the other on this machine."""
    import subprocess
    commit = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or str(before)
    sides: dict[str, Any] = {}
    for name, root in ((commit, before), ("this checkout", ROOT)):
        with tempfile.TemporaryDirectory(prefix="flood-side-") as tmp_name:
            tmp = Path(tmp_name)
            server = Server(tmp, "--auth-file", str(users_file(tmp / "users.txt", USERS)), client=False, root=root)
            try:
                alice, bob = Page(server, "alice"), Page(server, "bob")
                sides[name] = {"flood": {a: flood(bob, alice, args.flood, bursts=4, by_call=True, only=a)
                                         for a in ACTIONS},
                               "fresh": fresh_sessions(server, alice, min(args.fresh, 2000))}
            finally:
                server.close()
    data["before_and_after"] = sides
    rows = []
    for action in ACTIONS:
        row = [action]
        for side in sides.values():
            r = side["flood"][action]["rows"][0]
            row += [f"{_ms(r['idle_p50_ms'])} / {_ms(r['flood_p50_ms'])} / {_ms(r['flood_max_ms'])}"]
        rows.append(row)
    rows.append(["memory per 1,000 fresh-session requests", *(f"{side['fresh']['mb_per_1000']:+.1f} MB"
                                                              for side in sides.values())])
    return record.table(f"before ({commit}) and after: alice sends {args.flood} /calls of one action at once, 4 times; "
                        "bob's own /call of it, idle p50 / p50 and max as each flood lands; and the server's memory "
                        "over fresh-session requests", ["", *sides], rows)


def _ms(x: float) -> str:
    return f"{x:.0f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=250, help="light calls the flooder sends at once")
    parser.add_argument("--fresh", type=int, default=10_000, help="fresh-session requests")
    parser.add_argument("--sessions", type=int, default=63, help="sessions made at the allowed pace to size one "
                                                                  "(at most the cap less one)")
    parser.add_argument("--runs", type=int, default=50, help="runs the flooder submits at once (0: skip)")
    parser.add_argument("--guess-s", type=float, default=20.0, help="seconds of password guessing (0: skip)")
    parser.add_argument("--before", metavar="DIR", default=None,
                        help="also run the flood (every action as a client's /call) and the fresh sessions against "
                             "the app in another checkout (git worktree add DIR COMMIT), then this one's, side by side")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args()
    if args.before and not (Path(args.before) / "app.py").is_file():
        parser.error(f"--before {args.before}: not a checkout of this project (no app.py there); make one with "
                     "git worktree add DIR COMMIT")
    if args.flood < 1 or min(args.fresh, args.sessions, args.runs) < 0 or args.guess_s < 0:
        parser.error("--flood takes 1 or more calls; --fresh, --sessions, --runs and --guess-s 0 or more")
    from ui.ownership import OwnershipLimits
    cap = OwnershipLimits().sessions_per_user
    tables, notes, data = [], [], {}
    if args.before:
        tables.append(before_and_after(Path(args.before), args, data))
    with tempfile.TemporaryDirectory(prefix="flood-") as tmp_name:
        tmp = Path(tmp_name)
        server = Server(tmp, "--auth-file", str(users_file(tmp / "users.txt", USERS)), client=False)
        try:
            size = None
            if args.sessions:  # first, by a user with no other session, below the cap: every one is kept
                size = session_size(server, Page(server, "carol"), min(args.sessions, cap - 1))
                data["session_size"] = size
            alice, bob = Page(server, "alice"), Page(server, "bob")
            foreign = foreign_sessions(server, bob, alice)
            data["foreign"] = foreign
            notes.append(f"foreign sessions: alice named bob's session or event in {foreign['requests']} requests "
                         f"({foreign['templates']} routes x {len(ENCODINGS)} encodings, 2 spellings each): "
                         f"{foreign['refused']} refused by the guard, {foreign['passed']} reached Gradio"
                         + (f" ({'; '.join(foreign['passed_examples'])})" if foreign["passed"] else "") + ".")
            result = flood(bob, alice, args.flood)
            data["flood"] = result
            tables.append(record.table(
                f"bob's light actions idle and as each of {result['floods']} floods of {args.flood} light calls "
                f"alice sends at once lands; bound: max({WITHIN_FACTOR:g}x idle p50, {WITHIN_FLOOR_S * 1e3:.0f} ms)",
                ["action", "idle p50", "flood p50", "flood max", "bound", "p50 flood / idle", "within"],
                [[r["action"], _ms(r["idle_p50_ms"]), _ms(r["flood_p50_ms"]), _ms(r["flood_max_ms"]), _ms(r["bound_ms"]),
                  f"{r['ratio']:.2f}x", "yes" if r["within"] else "NO"] for r in result["rows"]]))
            answers = result["answers"]
            notes.append(f"alice's answers: {answers.get('200', 0)} ok, {answers.get('429', 0)} refused with 429 "
                         f"(Retry-After {answers.get('retry-after')} s; \"{answers.get('sample', '')}\").")
            fresh = fresh_sessions(server, alice, args.fresh)
            data["fresh"] = fresh
            rows = [[way, ", ".join(f"{k}: {v}" for k, v in sorted(a.items()))] for way, a in fresh["answers"].items()]
            tables.append(record.table(f"{args.fresh} fresh-session requests of alice's, by way ({fresh['wall_s']:.0f} s)",
                                       ["way", "answers (status: count)"], rows))
            line = (f"memory: {fresh['rss_before_mb']:.0f} -> {fresh['rss_after_mb']:.0f} MB resident, "
                    f"{fresh['mb_per_1000']:+.1f} MB per 1,000 fresh-session requests")
            if size is not None:
                per = size["grown_mb"] / size["sessions"]
                line += (f"; a session's state {per * 1e3:.0f} KB ({size['sessions']} made at the allowed pace: "
                         f"+{size['grown_mb']:.1f} MB), so one user's cap of {cap} sessions holds at most "
                         f"{cap * per:.0f} MB")
            notes.append(line + ".")
            bob.history()  # bob's page still answers
            if args.runs:
                lanes = run_lanes(server, alice, bob, args.runs)
                data["run_lanes"] = lanes
                notes.append(f"run lanes: bob's run (2 steps of mlp/tiny, submitted to its end) took "
                             f"{lanes['alone_s']:.1f} s with nothing queued and {lanes['behind_s']:.1f} s after alice "
                             f"submitted {args.runs} at once ({lanes['position'] or 'no queue position shown'}); "
                             f"alice's {args.runs} were answered {lanes['alice_answers']} (200: the call was queued and "
                             "the job service took it or refused it past her jobs; 429: refused at the gateway).")
            if args.guess_s:
                g = guessing(server, args.guess_s)
                data["sign_in"] = g
                notes.append(f"sign-in: mallory's {g['checked'] + g['refused']} guesses at alice's password in "
                             f"{g['seconds']:.0f} s from another address: {g['checked']} checked, {g['refused']} "
                             f"refused (429) before any check; alice signed in {g['alice_signed_in']} of "
                             f"{g['alice_tries']} times from her own address meanwhile; from a new address: "
                             f"HTTP {g['new_address_status']}.")
        finally:
            server.close()
    for t in tables:
        print(f"\n{t['title']}\n| " + " | ".join(t["columns"]) + " |")
        for row in t["rows"]:
            print("| " + " | ".join(row) + " |")
    for n in notes:
        print(n)
    record.write(args.json, "flood", tables, notes, data=data)
    within = all(r["within"] for r in data["flood"]["rows"])
    return 0 if within and data["foreign"]["passed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
