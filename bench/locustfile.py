"""Locust users for the shared app (driven headless by bench/load.py; usable on its own too):

    locust -f bench/locustfile.py --headless -H http://127.0.0.1:7860 ...

Each Locust user is one open page: one Gradio session, whose events go as a browser sends them
(POST /gradio_api/queue/join, then the session's /gradio_api/queue/data stream until the event's
`process_completed`). Both are timed as one request named after the endpoint (a run's stream lasts
the whole run, so runs are named "run (whole job)" and kept apart from the light endpoints).

- `Runner`: signs in as its own user (LOAD_USERS: "user:password,..."), plans once for this machine,
  then submits LOAD_RUNS runs of that plan, one after the other, each followed to its end; then it
  stops. Its outcome lines go to LOAD_OUTCOMES (a file, one JSON line per run).
- `Browser`: signs in as its user and calls the light endpoints (/history, /export_history_csv)
  about every LOAD_BROWSE_S seconds until stopped: the latency a person browsing the history sees.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import gevent
from locust import HttpUser, between, events, task
from locust.exception import StopUser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from migration.config.fields import api_values  # noqa: E402  (the form's field table: no JAX)

# The Migrate form's fields by name (LOAD_FORM: a JSON object of more); the rest take the table's defaults,
# so a field added to the form never shifts the values sent.
FORM = {"workload": "transformer", "preset": "tiny", "global_batch": 32, "target": "local",
        **json.loads(os.environ.get("LOAD_FORM", "{}"))}
HISTORY_ARGS = ["mine", "all", "all", "all"]
_users = [tuple(p.split(":", 1)) for p in os.environ.get("LOAD_USERS", "").split(",") if ":" in p]
_runner_users = iter(_users[: int(os.environ.get("LOAD_RUNNERS", len(_users)))])
_browser_users = itertools.cycle(_users[int(os.environ.get("LOAD_RUNNERS", len(_users))):] or [("", "")])
_lock = threading.Lock()
_done = [0]  # runners that finished their runs


class GradioUser(HttpUser):
    abstract = True

    def sign_in(self, user: str, password: str) -> None:
        self.user_name = user
        if user:
            r = self.client.post("/login/", data={"username": user, "password": password}, name="login")
            if r.status_code != 200:
                raise StopUser()
        self.open_session()

    def call(self, api: str, data: list[Any], name: str | None = None, timeout: float = 3600) -> tuple[str, Any]:
        """The event on the user's one session, as a browser page sends it: a queued event by POST
        /queue/join, then /queue/data until its `process_completed`; an unqueued one (`queue=False`:
        the history's) by one POST to /run/<api>, as Gradio's front end does. Returns ("complete",
        outputs) or ("error", message)."""
        name = name or api
        start = time.perf_counter()
        event, payload, failure = "error", None, None
        data = list(data)
        for i in self.state_at[api]:
            data.insert(i, None)
        try:
            if api in self.direct:  # an unqueued event: the page POSTs it and reads the answer, no stream
                r = self.client.post(f"/gradio_api/run/{api}", name=f"{name} (direct)",
                                     json={"data": data, "fn_index": self.fn_index[api], "session_hash": self.session,
                                           "event_data": None, "trigger_id": None}, timeout=timeout)
                if r.status_code == 200:
                    event, payload = "complete", r.json().get("data")
                else:
                    failure = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                event, payload, failure = self.join_and_follow(api, data, name, timeout)
        except Exception as exc:  # noqa: BLE001 - a load client records every failure and goes on
            failure = f"{type(exc).__name__}: {exc}"
        elapsed_ms = (time.perf_counter() - start) * 1000
        events.request.fire(request_type="GRADIO", name=name, response_time=elapsed_ms, response_length=0,
                            exception=None if failure is None and event == "complete" else
                            RuntimeError(failure or str(payload)[:200]), context={})
        return event, payload if failure is None else failure

    def join_and_follow(self, api: str, data: list[Any], name: str, timeout: float) -> tuple[str, Any, str | None]:
        """A queued event: POST /queue/join, then the session's /queue/data stream to its end."""
        event, payload, failure = "error", None, None
        r = self.client.post("/gradio_api/queue/join", name=f"{name} (join)",
                             json={"data": data, "fn_index": self.fn_index[api], "session_hash": self.session,
                                   "event_data": None, "trigger_id": None})
        if r.status_code != 200:
            failure = f"HTTP {r.status_code}: {r.text[:200]}"
        else:
            event_id = r.json()["event_id"]
            with self.client.get("/gradio_api/queue/data", params={"session_hash": self.session}, stream=True,
                                 timeout=timeout, name=f"{name} (data)", catch_response=True) as stream:
                for line in stream.iter_lines(decode_unicode=True):
                    if not line.startswith("data:"):
                        continue
                    message = json.loads(line[5:])
                    if message.get("event_id") == event_id and message.get("msg") == "process_completed":
                        output = message.get("output") or {}
                        event = "complete" if message.get("success") else "error"
                        payload = output.get("data") if event == "complete" else output.get("error")
                        break
                stream.success()
        return event, payload, failure

    def open_session(self) -> None:
        """One session per user, as one open page: the events' numbers read from the app's config."""
        self.session = uuid.uuid4().hex[:11]
        config = self.client.get("/config", name="config").json()
        states = {c["id"] for c in config["components"] if c.get("type") == "state"}
        self.fn_index = {d["api_name"].strip("/"): d["id"] for d in config["dependencies"] if d.get("api_name")}
        self.direct = {d["api_name"].strip("/") for d in config["dependencies"] if d.get("api_name") and d.get("queue") is False}
        # A page sends every input, its session states as null (the server keeps them): where they go.
        self.state_at = {d["api_name"].strip("/"): [i for i, c in enumerate(d["inputs"]) if c in states]
                         for d in config["dependencies"] if d.get("api_name")}


_RUNNERS = int(os.environ.get("LOAD_RUNNERS", len(_users)))


class Runner(GradioUser):
    """One user's runs: a plan, then LOAD_RUNS runs of it followed to the end."""

    fixed_count = _RUNNERS  # one Locust user per runner account, whatever -u says
    wait_time = between(0, 0)

    def on_start(self) -> None:
        with _lock:
            found = next(_runner_users, None)
        if found is None:
            raise StopUser()
        self.sign_in(*found)

    @task
    def plan_then_run(self) -> None:
        label = f"load {self.user_name}"
        # the fields, then the uploads that follow them (no config file: the form's model)
        self.call("plan", [*api_values("plan", **FORM, label=f"{label} plan"), None], name="plan (whole job)")
        for i in range(int(os.environ.get("LOAD_RUNS", "2"))):
            run = api_values("run", **FORM, steps=int(os.environ.get("LOAD_STEPS", "4")), label=f"{label} run {i}")
            # no saved plan file before the fields, no config file after them
            event, payload = self.call("run", [None, *run, None], name="run (whole job)")
            headline = payload[0] if event == "complete" and isinstance(payload, list) else str(payload)
            with _lock, open(os.environ.get("LOAD_OUTCOMES", os.devnull), "a") as f:
                f.write(json.dumps({"user": self.user_name, "label": f"{label} run {i}", "event": event,
                                    "headline": str(headline)[:300]}) + "\n")
        with _lock:
            _done[0] += 1
            last = _done[0] >= _RUNNERS
        if last:  # every runner is done: the browsers stop too, and Locust writes its figures (from a greenlet
            gevent.spawn(self.environment.runner.quit)  # of its own: quit() waits for this user to stop)
        raise StopUser()


class Browser(GradioUser):
    """A person browsing the history while others' runs go on."""

    fixed_count = max(0, len(_users) - _RUNNERS)

    wait_time = between(float(os.environ.get("LOAD_BROWSE_S", "0.5")), float(os.environ.get("LOAD_BROWSE_S", "0.5")))

    def on_start(self) -> None:
        with _lock:
            self.sign_in(*next(_browser_users))

    @task
    def history(self) -> None:
        self.call("history", HISTORY_ARGS, name="/history", timeout=120)

    @task
    def export(self) -> None:
        self.call("export_history_csv", ["mine"], name="/export_history_csv", timeout=120)
