"""The shared box's users: a file of `user:scrypt:N:r:p:SALT:HASH` lines (salted scrypt hashes from
the standard library, never passwords), readable by the service user alone.

`python -m migration add-user users.txt alice` adds or replaces a user (the password is read from
the terminal, or from standard input when it is not one) and keeps the file at mode 0600. The app
refuses a users file that others can read or that holds a plain-text password, saying how to fix it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1  # about 16 MiB and some tens of milliseconds per check
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}", re.ASCII)
PASSWORD_MAX_CHARS = 1024


class AccountsError(ValueError):
    """A users file that cannot be used; `str()` says what to do."""


def hash_password(password: str, *, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=2**26, dklen=32)
    return f"scrypt:{n}:{r}:{p}:{salt.hex()}:{digest.hex()}"


def verify_password(stored: str, password: str) -> bool:
    """Whether `password` matches the stored hash (compared in constant time)."""
    if not isinstance(password, str) or len(password) > PASSWORD_MAX_CHARS:
        return False
    try:
        kind, n, r, p, salt, digest = stored.split(":")
        if kind != "scrypt":
            return False
        computed = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p),
                                  maxmem=2**26, dklen=len(bytes.fromhex(digest)))
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(computed, bytes.fromhex(digest))


def _private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AccountsError(f"the users file {path} can be read by other users (mode {stat.S_IMODE(mode):04o}); "
                            f"make it private: chmod 600 {path}")


def read_users(path: str | Path) -> dict[str, str]:
    """user -> stored hash, from a private users file; AccountsError saying what is wrong."""
    path = Path(path)
    try:
        _private(path)
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AccountsError(f"cannot read the users file {path} ({exc.strerror}); add users with "
                            f"`python -m migration add-user {path} NAME`") from None
    users = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        user, _, stored = line.strip().partition(":")
        if not USER_NAME.fullmatch(user):
            raise AccountsError(f"{path} line {number}: a user name is 1 to 64 letters, digits and . _ @ -")
        if not stored.startswith("scrypt:"):
            raise AccountsError(f"{path} line {number}: user {user!r} has a plain-text password; passwords are stored "
                                f"hashed: `python -m migration add-user {path} {user}`")
        users[user] = stored
    return users


def add_user(path: str | Path, user: str, password: str) -> None:
    """Add `user` (or replace their password) in the users file, created private if missing."""
    if not USER_NAME.fullmatch(user):
        raise AccountsError("a user name is 1 to 64 letters, digits and . _ @ -, starting with a letter or digit")
    if not password or len(password) > PASSWORD_MAX_CHARS:
        raise AccountsError(f"the password must be 1 to {PASSWORD_MAX_CHARS} characters")
    path = Path(path)
    users = read_users(path) if path.exists() else {}
    users[user] = hash_password(password)
    fd = os.open(path.with_suffix(path.suffix + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(f"{name}:{stored}\n" for name, stored in users.items()))
    os.chmod(path.with_suffix(path.suffix + ".tmp"), 0o600)
    os.replace(path.with_suffix(path.suffix + ".tmp"), path)


class Authenticator:
    """(user, password) -> whether they match a stored hash. Gradio's `auth` is `check`: a sign-in's
    scrypt (tens of milliseconds of CPU, the same for wrong passwords and unknown users) runs in a
    thread, never on the server's event loop, at most `CONCURRENT_CHECKS` at once; so a flood of
    sign-ins, right or wrong, from anyone, waits its turn instead of holding every page."""

    CONCURRENT_CHECKS = 1

    def __init__(self, users: dict[str, str]):
        self.users = dict(users)
        self._checks: asyncio.Semaphore | None = None

    async def check(self, user: str, password: str) -> bool:
        if self._checks is None:  # made on the server's loop, at the first sign-in
            self._checks = asyncio.Semaphore(self.CONCURRENT_CHECKS)
        async with self._checks:
            return await asyncio.to_thread(self, user, password)

    def __call__(self, user: str, password: str) -> bool:
        stored = self.users.get(user) if isinstance(user, str) else None
        if stored is None:
            verify_password(_DUMMY, password if isinstance(password, str) else "")  # same time for unknown users
            return False
        return verify_password(stored, password)

    def __len__(self) -> int:
        return len(self.users)


_DUMMY = hash_password("not a password")
