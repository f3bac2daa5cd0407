"""Who owns what the web layer hands out: Gradio sessions (bound to the signed-in user who first names
one), events (bound to the user whose request created them), uploaded files (bound to their uploader,
with a quota on disk and an age), and sign-in attempts (limited per address and per user name).

Nothing here evicts one user's entry to make room for another's. Every session counts against its user's
cap, wherever it was made (a page, a call that named none and took its event's id, a heartbeat); a user at
the cap loses their own least recently used session that no request holds open and no event uses, and is
refused a new one when every one of theirs is in use. What else expires is a user's own idle entries (a
session nobody has named for `session_idle_s`; events and uploads past their age) and sign-in attempts
refill with time. An address that has signed a user in before keeps its own attempts for that user name,
so a guessing loop on a name from elsewhere does not lock its owner out."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path

from migration.service.job import TokenBuckets, retry_text


class Refused(Exception):
    """A request the ownership tables refuse: `status` and one line for the client."""

    def __init__(self, status: int, text: str, retry_after_s: float | None = None):
        super().__init__(text)
        self.status, self.text, self.retry_after_s = status, text, retry_after_s


@dataclasses.dataclass(frozen=True)
class OwnershipLimits:
    sessions_per_user: int = 64  # live sessions (pages, API clients, calls that named none) of one user
    session_idle_s: float = 3600.0  # a session nobody names or holds open this long is forgotten
    events_per_user: int = 5000  # the user's own oldest events are forgotten past it
    event_age_s: float = 24 * 3600.0
    upload_files_per_request: int = 20
    upload_bytes_per_user: int = 64 << 20  # live uploads on disk
    upload_age_s: float = 6 * 3600.0
    sign_in_per_user: int = 10  # attempts in a burst per user name, refilled at one per `sign_in_refill_s`
    sign_in_per_address: int = 30
    sign_in_refill_s: float = 6.0
    known_addresses: int = 10_000  # (user, address) pairs that signed in, kept for their own attempts


@dataclasses.dataclass
class _Session:
    user: str
    last_s: float
    open_requests: int = 0


class Ownership:
    """The tables, behind one lock (every operation is a few dictionary lookups)."""

    def __init__(self, limits: OwnershipLimits = OwnershipLimits(), forget_session: object = None,
                 busy_sessions: object = None):
        self.limits = limits
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._sessions_of: dict[str, set[str]] = {}
        self._events: dict[str, tuple[str, float]] = {}  # event id -> (user, created)
        self._events_of: dict[str, dict[str, None]] = {}  # user -> their events, oldest first
        self._uploads: dict[str, dict[str, tuple[int, float]]] = {}  # real path -> {user: (bytes, created)}
        self._upload_bytes: dict[str, int] = {}
        # sign-in attempts: a bucket for each address and one for each user name
        self._sign_in = _SignInBuckets(limits)
        self._forget_session = forget_session  # called with a hash whose binding went (Gradio's state goes too)
        self._busy_sessions = busy_sessions  # () -> the sessions Gradio's queue has events of (never dropped)
        self._known: dict[tuple[str, str], None] = {}  # (user name, address) that signed in, oldest first
        self._swept_s = time.monotonic()

    # -- sessions -----------------------------------------------------------------------------------

    def open_session(self, session: str, user: str) -> None:
        """Bind `session` to `user` at its first use, or check it is theirs; counts an open request on it
        until `close_session`. Refused: another user's (403), or every session of the user's in use (429)."""
        now = time.monotonic()
        with self._lock:
            self._sweep(now)
            found = self._sessions.get(session)
            if found is None:
                self._make_room(user)
                found = self._add_session(session, user, now)
            elif found.user != user:
                raise Refused(403, "that session belongs to another user")
            found.last_s = now
            found.open_requests += 1

    def check_session(self, session: str, user: str) -> None:
        """Refused (403) when `session` is another user's; binds nothing."""
        with self._lock:
            found = self._sessions.get(session)
        if found is not None and found.user != user:
            raise Refused(403, "that session belongs to another user")

    def make_room(self, user: str) -> None:
        """Room for one more session of `user` (their own least recently used idle one dropped); Refused
        (429) when every one of theirs is in use. Called before a call that will make its own session."""
        with self._lock:
            self._sweep(time.monotonic())
            self._make_room(user)

    def _make_room(self, user: str) -> None:
        mine = self._sessions_of.setdefault(user, set())
        if len(mine) < self.limits.sessions_per_user:
            return
        busy = self._busy_sessions() if callable(self._busy_sessions) else set()
        idle = [s for s in mine if self._sessions[s].open_requests == 0 and s not in busy]
        if not idle:
            raise Refused(429, f"too many open sessions for one user ({self.limits.sessions_per_user}), all in use; "
                               "close some pages or API clients, or wait for their calls to end", retry_after_s=5.0)
        self._drop_session(min(idle, key=lambda s: self._sessions[s].last_s))

    def _add_session(self, session: str, user: str, now: float) -> _Session:
        found = self._sessions[session] = _Session(user, now)
        self._sessions_of.setdefault(user, set()).add(session)
        return found

    def _drop_session(self, session: str) -> None:
        found = self._sessions.pop(session, None)
        if found is not None:
            self._sessions_of.get(found.user, set()).discard(session)
            if not self._sessions_of.get(found.user):
                self._sessions_of.pop(found.user, None)
        if callable(self._forget_session):
            self._forget_session(session)

    def sessions_of(self, user: str) -> int:
        with self._lock:
            return len(self._sessions_of.get(user, ()))

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
        """`user` made this event. Gradio takes an event's id as its session when the call named none: that
        session is the user's too, and counts against their cap like any other."""
        now = time.monotonic()
        with self._lock:
            if event_id in self._events:
                return
            self._events[event_id] = (user, now)
            if event_id not in self._sessions:
                self._add_session(event_id, user, now)
                mine = self._sessions_of[user]
                if len(mine) > self.limits.sessions_per_user:  # made past a concurrent check: the user's own go
                    with contextlib.suppress(Refused):
                        self._make_room_excluding(user, event_id)
            mine_events = self._events_of.setdefault(user, {})
            mine_events[event_id] = None
            while len(mine_events) > self.limits.events_per_user:  # the user's own oldest, never another's
                self._events.pop(next(iter(mine_events)), None)
                del mine_events[next(iter(mine_events))]

    def _make_room_excluding(self, user: str, keep: str) -> None:
        mine = self._sessions_of[user]
        busy = self._busy_sessions() if callable(self._busy_sessions) else set()
        idle = [s for s in mine if s != keep and self._sessions[s].open_requests == 0 and s not in busy]
        if idle:
            self._drop_session(min(idle, key=lambda s: self._sessions[s].last_s))

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
        password is checked. The user name's bucket is shared by every address that has never signed that
        user in; an address that has keeps one of its own. A successful sign-in gives its attempt back."""
        wait = self._sign_in.take(*self._sign_in_keys(address, user_name))
        if wait > 0.0:
            level = self._sign_in.level(("address", address))
            what = "address" if level < 1.0 else "user name"
            raise Refused(429, f"too many sign-in attempts from this {what}; try again in {retry_text(wait)}",
                          retry_after_s=wait)

    def refund_sign_in(self, address: str, user_name: str) -> None:
        """A successful sign-in: its attempt back, and the address known for the user name from now on."""
        self._sign_in.give_back(*self._sign_in_keys(address, user_name))
        with self._lock:
            self._known[(user_name[:128], address)] = None
            while len(self._known) > self.limits.known_addresses:
                del self._known[next(iter(self._known))]

    def _sign_in_keys(self, address: str, user_name: str) -> tuple[tuple[str, ...], ...]:
        name = user_name[:128]
        with self._lock:
            known = (name, address) in self._known
        return ("address", address), (("user", name, address) if known else ("user", name))

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
                self._drop_session(session)
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


class _SignInBuckets:
    """The sign-in attempts: an address's bucket holds `sign_in_per_address`, a user name's
    `sign_in_per_user`; both refill one attempt every `sign_in_refill_s`."""

    def __init__(self, limits: OwnershipLimits):
        self._address = TokenBuckets(1.0 / limits.sign_in_refill_s, limits.sign_in_per_address, max_keys=100_000)
        self._user = TokenBuckets(1.0 / limits.sign_in_refill_s, limits.sign_in_per_user, max_keys=100_000)

    def take(self, address_key: tuple[str, ...], user_key: tuple[str, ...]) -> float:
        wait = self._address.take(address_key)
        if wait > 0.0:
            return wait
        wait = self._user.take(user_key)
        if wait > 0.0:
            self._address.give_back(address_key)
        return wait

    def give_back(self, address_key: tuple[str, ...], user_key: tuple[str, ...]) -> None:
        self._address.give_back(address_key)
        self._user.give_back(user_key)

    def level(self, address_key: tuple[str, ...]) -> float:
        return self._address.level(address_key)


def remove_upload(path: Path) -> None:
    """An upload's file and its folder (Gradio keeps each upload in a folder of its own)."""
    try:
        path.unlink()
        path.parent.rmdir()
    except OSError:
        pass
