"""The web layer's ownership tables (`ui.ownership`) and the code check's cap (`CodeCheck.capped`), in-process:
who owns a session, an event and an upload; that a table never makes room by forgetting another user's
entry; expiry of idle entries; the sign-in buckets; and the checklist's counts over capped findings."""

from __future__ import annotations

import os
import time

import pytest

from migration.codecheck import CodeCheck, Finding
from ui.ownership import Ownership, OwnershipLimits, Refused


def test_a_session_is_bound_to_its_first_user_and_refused_to_another():
    tables = Ownership()
    tables.open_session("s1", "alice")
    tables.close_session("s1")
    tables.open_session("s1", "alice")  # hers again
    with pytest.raises(Refused) as refused:
        tables.open_session("s1", "bob")
    assert refused.value.status == 403 and "another user" in refused.value.text
    assert tables.session_owner("s1") == "alice"


def test_a_user_at_their_cap_loses_their_own_oldest_idle_session_never_anyone_elses():
    forgotten = []
    tables = Ownership(OwnershipLimits(sessions_per_user=3), forget_session=forgotten.append)
    tables.open_session("alice-1", "alice")
    tables.close_session("alice-1")
    for i in range(3):
        tables.open_session(f"junk-{i}", "bob")
        tables.close_session(f"junk-{i}")
        time.sleep(0.001)
    tables.open_session("junk-3", "bob")  # bob's own least recently used goes, with its Gradio state
    assert forgotten == ["junk-0"] and tables.session_owner("junk-0") is None
    assert tables.sessions_of("bob") == 3 and tables.session_owner("alice-1") == "alice"
    with pytest.raises(Refused):
        tables.open_session("alice-1", "bob")  # the flood did not free alice's session for a claim
    tables.open_session("alice-2", "alice")  # alice is not limited by bob's sessions


def test_a_user_whose_sessions_are_all_in_use_is_refused_a_new_one():
    busy: set[str] = set()
    tables = Ownership(OwnershipLimits(sessions_per_user=3), busy_sessions=lambda: busy)
    tables.open_session("page", "bob")  # held open (a page's heartbeat)
    tables.bind_event("event-1", "bob")  # a call that named no session: its event's id is its session
    tables.bind_event("event-2", "bob")
    busy |= {"event-1", "event-2"}  # Gradio's queue still has their events
    assert tables.sessions_of("bob") == 3
    for make in (lambda: tables.open_session("one-more", "bob"), lambda: tables.make_room("bob")):
        with pytest.raises(Refused) as refused:
            make()
        assert refused.value.status == 429 and "all in use" in refused.value.text
    busy.discard("event-1")  # its event ended: the user's own idle session makes the room
    tables.make_room("bob")
    assert tables.session_owner("event-1") is None and tables.session_owner("event-2") == "bob"


def test_sessions_made_by_calls_count_against_the_callers_cap():
    forgotten = []
    tables = Ownership(OwnershipLimits(sessions_per_user=5), forget_session=forgotten.append)
    tables.open_session("alice-page", "alice")
    for i in range(1000):
        tables.make_room("bob")
        tables.bind_event(f"bob-call-{i}", "bob")
    assert tables.sessions_of("bob") == 5 and len(forgotten) == 995
    assert tables.session_owner("alice-page") == "alice" and tables.sessions_of("alice") == 1


def test_an_idle_session_expires_with_its_gradio_state_but_an_open_one_stays():
    forgotten = []
    tables = Ownership(OwnershipLimits(session_idle_s=0.05), forget_session=forgotten.append)
    tables.open_session("idle", "alice")
    tables.close_session("idle")
    tables.open_session("streaming", "alice")  # a request still open on it (a page's heartbeat)
    time.sleep(0.1)
    tables.sweep()
    assert tables.session_owner("idle") is None and forgotten == ["idle"]
    assert tables.session_owner("streaming") == "alice"


def test_an_event_is_its_creators_and_an_unknown_one_is_nobodys():
    tables = Ownership(OwnershipLimits(events_per_user=2))
    tables.bind_event("e1", "alice")
    tables.check_event("e1", "alice")
    for who, event in (("bob", "e1"), ("alice", "never-created")):
        with pytest.raises(Refused) as refused:
            tables.check_event(event, who)
        assert refused.value.status == 404
    # an event's id is also its session when the call named none: bob cannot take it as a session
    with pytest.raises(Refused):
        tables.open_session("e1", "bob")
    for i in range(3):  # past the limit, alice's own oldest goes; bob's never does
        tables.bind_event(f"a{i}", "alice")
    tables.bind_event("b0", "bob")
    with pytest.raises(Refused):
        tables.check_event("e1", "alice")
    tables.check_event("a2", "alice")
    tables.check_event("b0", "bob")


def test_uploads_are_their_uploaders_within_a_quota(tmp_path):
    files = []
    for i, size in enumerate((600, 600)):
        folder = tmp_path / f"h{i}"
        folder.mkdir()
        (folder / "x.py").write_bytes(b"x" * size)
        files.append(str(folder / "x.py"))
    tables = Ownership(OwnershipLimits(upload_bytes_per_user=1000))
    assert tables.upload_room("alice") == 1000
    tables.bind_uploads(files[:1], "alice")
    assert tables.owns_upload(os.path.realpath(files[0]), "alice")
    assert not tables.owns_upload(os.path.realpath(files[0]), "bob")
    assert tables.upload_room("alice") == 400 and tables.upload_room("bob") == 1000
    tables.bind_uploads(files[:1], "bob")  # the same bytes from bob: Gradio gives both the same path
    assert tables.owns_upload(os.path.realpath(files[0]), "bob")
    tables.drop_uploads(files[:1], "alice")
    assert os.path.exists(files[0]), "bob still owns it"
    tables.drop_uploads(files[:1], "bob")
    assert not os.path.exists(files[0]) and not os.path.exists(os.path.dirname(files[0]))


def test_old_uploads_expire_and_their_files_go(tmp_path):
    (tmp_path / "h").mkdir()
    path = tmp_path / "h" / "plan.json"
    path.write_text("{}")
    tables = Ownership(OwnershipLimits(upload_age_s=0.05))
    tables.bind_uploads([str(path)], "alice")
    time.sleep(0.1)
    tables.sweep()
    assert not path.exists() and not tables.owns_upload(os.path.realpath(path), "alice")
    assert tables.upload_room("alice") == OwnershipLimits().upload_bytes_per_user


def test_sign_in_attempts_are_limited_per_user_name_and_per_address_and_a_success_gives_its_attempt_back():
    tables = Ownership(OwnershipLimits(sign_in_per_user=3, sign_in_per_address=5, sign_in_refill_s=60))
    for _ in range(3):
        tables.take_sign_in("10.0.0.1", "alice")
    with pytest.raises(Refused) as refused:
        tables.take_sign_in("10.0.0.2", "alice")
    assert refused.value.status == 429 and "user name" in refused.value.text and refused.value.retry_after_s > 0
    tables.take_sign_in("10.0.0.1", "bob")
    tables.take_sign_in("10.0.0.1", "carol")
    with pytest.raises(Refused) as refused:
        tables.take_sign_in("10.0.0.1", "dave")
    assert "address" in refused.value.text
    tables.refund_sign_in("10.0.0.1", "carol")
    tables.take_sign_in("10.0.0.1", "dave")


def _finding(rule: str, line: int, severity: str = "warning") -> Finding:
    return Finding("train.py", line, 1, rule, severity, "m", "r")


def test_a_capped_check_keeps_the_first_findings_and_the_first_of_every_rule_and_counts_the_rest():
    findings = ([_finding("PMAP001", i) for i in range(1, 51)] + [_finding("TPU001", 60, "error")]
                + [_finding("PMAP001", 70)])
    check = CodeCheck(files=("train.py",), findings=tuple(findings), env_settings=(), monitoring=())
    capped = check.capped(10)
    assert [f.line for f in capped.findings] == [*range(1, 11), 60]
    assert capped.omitted == (("PMAP001", "warning", 41),)
    assert capped.total == check.total == 52
    assert capped.count(("PMAP001",)) == 51 and capped.count(("TPU001",), "error") == 1
    assert CodeCheck.from_dict(capped.to_dict()) == capped
    assert capped.capped(5).total == 52  # capping again keeps the counts
    assert check.capped(100) is check


def test_a_guessing_loop_on_a_name_does_not_lock_out_an_address_that_signed_it_in_before():
    tables = Ownership(OwnershipLimits(sign_in_per_user=3, sign_in_per_address=50, sign_in_refill_s=60))
    tables.take_sign_in("10.0.0.1", "alice")
    tables.refund_sign_in("10.0.0.1", "alice")  # alice signed in from her desk
    for _ in range(3):
        tables.take_sign_in("10.6.6.6", "alice")  # someone else guesses her password
    with pytest.raises(Refused) as refused:
        tables.take_sign_in("10.6.6.7", "alice")
    assert "user name" in refused.value.text
    for _ in range(3):
        tables.take_sign_in("10.0.0.1", "alice")  # her own address keeps its own attempts
    with pytest.raises(Refused):
        tables.take_sign_in("10.0.0.1", "alice")  # and they are limited too
