"""Who owns what the web layer hands out: Gradio sessions (bound to the signed-in user who first names
one), events (bound to the user whose request created them), uploaded files (bound to their uploader,
with a quota on disk and an age), and sign-in attempts (limited per address and per user name).

Nothing here evicts one user's entry to make room for another's: a user past their own limit is refused
new sessions; what expires is a user's own idle entries (a session no request has named for
`session_idle_s` and none holds open; events and uploads past their age)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path


class Refused(Exception):
    """A request the ownership tables refuse: `status` and one line for the client."""

    def __init__(self, status: int, text: str, retry_after_s: float | None = None):
        super().__init__(text)
        self.status, self.text, self.retry_after_s = status, text, retry_after_s


@dataclasses.dataclass(frozen=True)
class OwnershipLimits:
    sessions_per_user: int = 500  # live sessions (pages and API clients) of one user
    session_idle_s: float = 3600.0  # a session nobody names or holds open this long is forgotten
    events_per_user: int = 5000  # the user's own oldest events are forgotten past it
    event_age_s: float = 24 * 3600.0
    upload_files_per_request: int = 20
    upload_bytes_per_user: int = 64 << 20  # live uploads on disk
    upload_age_s: float = 6 * 3600.0
    sign_in_per_user: int = 10  # attempts in a burst per user name, refilled at one per `sign_in_refill_s`
    sign_in_per_address: int = 30
    sign_in_refill_s: float = 6.0


@dataclasses.dataclass
class _Session:
    user: str
    last_s: float
    open_requests: int = 0


class Ownership:
    """The tables, behind one lock (every operation is a few dictionary lookups)."""

    def __init__(self, limits: OwnershipLimits = OwnershipLimits(), forget_session: object = None):
        self.limits = limits
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._sessions_of: dict[str, set[str]] = {}
        self._events: dict[str, tuple[str, float]] = {}  # event id -> (user, created)
        self._events_of: dict[str, dict[str, None]] = {}  # user -> their events, oldest first
        self._uploads: dict[str, dict[str, tuple[int, float]]] = {}  # real path -> {user: (bytes, created)}
        self._upload_bytes: dict[str, int] = {}
        self._sign_in: dict[str, tuple[float, float]] = {}  # bucket key -> (tokens, at)
        self._forget_session = forget_session  # called with a hash whose binding expired (Gradio's state)
        self._swept_s = time.monotonic()

    # -- sessions -----------------------------------------------------------------------------------

    def open_session(self, session: str, user: str) -> None:
        """Bind `session` to `user` at its first use, or check it is theirs; counts an open request on it
        until `close_session`. Refused: another user's (403), or past the user's live sessions (429)."""
        now = time.monotonic()
        with self._lock:
            self._sweep(now)
            found = self._sessions.get(session)
            if found is None:
                mine = self._sessions_of.setdefault(user, set())
                if len(mine) >= self.limits.sessions_per_user:
                    raise Refused(429, f"too many open sessions for one user ({self.limits.sessions_per_user}); "
                                       "close some pages or API clients, or wait for idle ones to expire")
                found = self._sessions[session] = _Session(user, now)
                mine.add(session)
            elif found.user != user:
                raise Refused(403, "that session belongs to another user")
            found.last_s = now
            found.open_requests += 1

    def close_session(self, session: str) -> None:
        with self._lock:
            found = self._sessions.get(session)
            if found is not None:
                found.open_requests = max(0, found.open_requests - 1)
                found.last_s = time.monotonic()

    def session_owner(self, session: str) -> str | None:
        with self._lock:
            found = self._sessions.get(session)
            return None if found is None else found.user

    # -- events -------------------------------------------------------------------------------------

    def bind_event(self, event_id: str, user: str) -> None:
        now = time.monotonic()
        with self._lock:
            if event_id in self._events:
                return
            self._events[event_id] = (user, now)
            if event_id not in self._sessions:  # Gradio takes an event's id as its session when the call named none
                self._sessions[event_id] = _Session(user, now)  # (not counted among the user's open sessions)
            mine = self._events_of.setdefault(user, {})
            mine[event_id] = None
            while len(mine) > self.limits.events_per_user:  # the user's own oldest, never another's
                self._events.pop(next(iter(mine)), None)
                del mine[next(iter(mine))]

    def check_event(self, event_id: str, user: str) -> None:
        with self._lock:
            found = self._events.get(event_id)
        if found is None or found[0] != user:
            raise Refused(404, "no such event of yours")

    # -- uploads ------------------------------------------------------------------------------------

    def upload_room(self, user: str) -> int:
        """Bytes `user` may still upload (0: refuse the upload)."""
        with self._lock:
            self._sweep(time.monotonic())
            return max(0, self.limits.upload_bytes_per_user - self._upload_bytes.get(user, 0))

    def bind_uploads(self, paths: list[str], user: str) -> None:
        """`user` uploaded these files. Gradio names an upload by its content, so two users who upload the
        same bytes get the same path: each owns it (and is charged for it) until their own entry expires."""
        now = time.monotonic()
        with self._lock:
            for path in paths:
                real = os.path.realpath(path)
                try:
                    size = os.stat(real).st_size
                except OSError:
                    continue
                owners = self._uploads.setdefault(real, {})
                if user not in owners:
                    self._upload_bytes[user] = self._upload_bytes.get(user, 0) + size
                owners[user] = (size, now)

    def drop_uploads(self, paths: list[str], user: str) -> None:
        """Take back `user`'s part in these uploads (a refused upload); the files go when nobody owns them."""
        with self._lock:
            for path in paths:
                real = os.path.realpath(path)
                owners = self._uploads.get(real, {})
                size = owners.pop(user, (0, 0.0))[0]
                self._upload_bytes[user] = max(0, self._upload_bytes.get(user, 0) - size)
                if not owners:
                    self._uploads.pop(real, None)
                    remove_upload(Path(real))

    def owns_upload(self, real_path: str, user: str) -> bool:
        with self._lock:
            return user in self._uploads.get(real_path, {})

    # -- sign-in ------------------------------------------------------------------------------------

    def take_sign_in(self, address: str, user_name: str) -> None:
        """One sign-in attempt from `address` for `user_name`; Refused (429) past either bucket, before any
        password is checked. A successful sign-in gives its tokens back (`refund_sign_in`)."""
        now = time.monotonic()
        lim = self.limits
        keys = ((f"address:{address}", lim.sign_in_per_address), (f"user:{user_name[:128]}", lim.sign_in_per_user))
        with self._lock:
            levels = [self._level(key, burst, now) for key, burst in keys]
            for (key, _), level in zip(keys, levels):
                if level < 1.0:
                    wait = (1.0 - level) * lim.sign_in_refill_s
                    what = "address" if key.startswith("address:") else "user name"
                    raise Refused(429, f"too many sign-in attempts from this {what}; try again in {wait:.0f} s",
                                  retry_after_s=wait)
            for (key, _), level in zip(keys, levels):
                self._sign_in[key] = (level - 1.0, now)
            if len(self._sign_in) > 100_000:  # bounded: full buckets carry no information
                self._sign_in = {k: v for k, v in self._sign_in.items() if v[0] < 1.0}

    def refund_sign_in(self, address: str, user_name: str) -> None:
        now = time.monotonic()
        lim = self.limits
        with self._lock:
            for key, burst in ((f"address:{address}", lim.sign_in_per_address),
                               (f"user:{user_name[:128]}", lim.sign_in_per_user)):
                self._sign_in[key] = (min(float(burst), self._level(key, burst, now) + 1.0), now)

    def _level(self, key: str, burst: int, now: float) -> float:
        tokens, at = self._sign_in.get(key, (float(burst), now))
        return min(float(burst), tokens + (now - at) / self.limits.sign_in_refill_s)

    # -- expiry -------------------------------------------------------------------------------------

    def sweep(self) -> None:
        with self._lock:
            self._sweep(time.monotonic(), force=True)

    def _sweep(self, now: float, force: bool = False) -> None:
        """Forget idle sessions, old events and old or deleted uploads (at most once a minute)."""
        if not force and now - self._swept_s < 60.0:
            return
        self._swept_s = now
        lim = self.limits
        for session, found in list(self._sessions.items()):
            if found.open_requests == 0 and now - found.last_s > lim.session_idle_s:
                del self._sessions[session]
                self._sessions_of.get(found.user, set()).discard(session)
                if callable(self._forget_session):
                    self._forget_session(session)
        for event_id, (user, created) in list(self._events.items()):
            if now - created > lim.event_age_s:
                del self._events[event_id]
                self._events_of.get(user, {}).pop(event_id, None)
        for path, owners in list(self._uploads.items()):
            gone = not os.path.exists(path)
            for user, (size, created) in list(owners.items()):
                if gone or now - created > lim.upload_age_s:
                    del owners[user]
                    self._upload_bytes[user] = max(0, self._upload_bytes.get(user, 0) - size)
            if not owners:
                del self._uploads[path]
                if not gone:
                    remove_upload(Path(path))


def remove_upload(path: Path) -> None:
    """An upload's file and its folder (Gradio keeps each upload in a folder of its own)."""
    try:
        path.unlink()
        path.parent.rmdir()
    except OSError:
        pass
