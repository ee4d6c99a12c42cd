"""The session's check for what tests leave in /tmp and /dev/shm (tests/conftest.py), on
stand-in folders."""

import os
import subprocess
import sys

from conftest import other_sessions, project_entries


def test_new_project_entries_are_found_and_nothing_else(tmp_path):
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    for d in (tmp, shm, tmp / "clairvoyant-0", shm / "clairvoyant-65534.1"):
        d.mkdir()
    (shm / "clairvoyant-65534.1" / "old.state").write_text("")
    before = project_entries([tmp, shm])
    assert before == {str(tmp / "clairvoyant-0"), str(shm / "clairvoyant-65534.1"), str(shm / "clairvoyant-65534.1" / "old.state")}
    (tmp / "clairvoyant-0" / "agent-1").mkdir()
    (shm / "clairvoyant-65534.1" / "clairvoyant-abc.ring").write_text("")
    (tmp / "clairvoyant-test-shm-x").mkdir()
    (shm / "cv-segment").write_text("")
    (tmp / "clairvoyant-tests-other").mkdir()  # a test session's own folder
    (tmp / "someone-else").mkdir()
    (tmp / "clairvoyant-0x").mkdir()  # not a user folder: only its name counts
    (tmp / "clairvoyant-0x" / "inner").mkdir()
    new = project_entries([tmp, shm]) - before
    assert new == {
        str(tmp / "clairvoyant-0" / "agent-1"),
        str(shm / "clairvoyant-65534.1" / "clairvoyant-abc.ring"),
        str(tmp / "clairvoyant-test-shm-x"),
        str(shm / "cv-segment"),
        str(tmp / "clairvoyant-0x"),
    }


def test_other_running_test_sessions_are_told_from_this_one_and_from_finished_ones(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    own = tmp_path / f"clairvoyant-tests-{os.getpid()}-a"
    other = tmp_path / f"clairvoyant-tests-{child.pid}-b"
    for d in (own, other, tmp_path / "clairvoyant-tests-c", tmp_path / "clairvoyant-tests-x-d"):
        d.mkdir()
    try:
        assert other_sessions([tmp_path, tmp_path / "absent"], [str(own)]) == {str(other)}
    finally:
        child.communicate(b"")
    assert other_sessions([tmp_path], [str(own)]) == set(), "a finished session's kept folder"
