"""Finding the Ray cluster (actors/front/cluster.py) with real `ray start` heads: one started with
--temp-dir and RAY_TMPDIR, with token authentication on, found without RAY_AUTH_MODE; a cluster
file left by a Ray that was killed answered at once; no cluster, an error naming what was tried.
And reap_orphans() passing over a segment it may not unlink.

Each test gives its subprocesses their own environment (no RAY_ADDRESS, RAY_TMPDIR in a fresh
short folder: Ray's socket paths must stay under 108 characters) and kills what it started by
its process group, never with `ray stop` (which stops every Ray of this machine)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from testlib import free_port

BIN = os.path.dirname(sys.executable)
SOCLLM = [sys.executable, "-m", "socllm.actors.front.cli"]
RAY = os.path.join(BIN, "ray")
# a bound on each command, not a speed assertion: a stale cluster file answered in well under a
# second here, against minutes of Ray retrying it before; 60 s leaves room for a loaded machine
ANSWER_S = 60


def _env(tmp: str, home: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["RAY_TMPDIR"] = tmp
    if home:
        env["HOME"] = home
    return env


class Head:
    """`ray start --head --block --temp-dir=D`, in a process group of its own."""

    def __init__(self, temp: str, env: dict):
        self.temp, self.file = temp, os.path.join(temp, "ray_current_cluster")
        self.log = open(os.path.join(temp, "ray-start.log"), "w")
        self.proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--temp-dir={temp}", "--port=0", "--num-cpus=1",
             "--include-dashboard=false", "--disable-usage-stats"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 180
        while not (os.path.exists(self.file) and open(self.file).read().strip()):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise AssertionError("ray start failed: " + open(self.log.name).read()[-2000:])
            time.sleep(0.2)
        self.address = open(self.file).read().strip()

    def kill(self):
        """SIGKILL the whole group (ray start, its GCS, raylet, agents): a crash, no `ray stop`."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        self.log.close()


@pytest.fixture
def token_home():
    """A HOME holding a Ray token: `ray start --head` then turns token authentication on."""
    home = tempfile.mkdtemp(prefix="sh", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": home}
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, check=True,
                   timeout=120)
    assert os.path.isfile(os.path.join(home, ".ray", "auth_token"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def _cli(env, *args, timeout=ANSWER_S):
    return subprocess.run(SOCLLM + list(args), env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_head_started_with_temp_dir_and_token_auth_is_found(short_tmp, token_home):
    env = _env(short_tmp, token_home)
    head = Head(short_tmp, env)
    try:
        assert "Token authentication is enabled" in open(head.log.name).read()
        # found through RAY_TMPDIR alone, through RAY_ADDRESS, through --address; never the
        # InvalidAuthToken retries of a driver that does not send the token
        for extra_env, args in (({}, ()), ({"RAY_ADDRESS": head.address}, ()),
                                ({}, ("--address", head.address))):
            r = _cli(env | extra_env, "status", *args)
            assert r.returncode == 1 and "no service is running" in r.stderr, (extra_env, args, r.stderr)
            assert "InvalidAuthToken" not in r.stderr and "no Ray cluster" not in r.stderr
        r = _cli(env, "stop")
        assert r.returncode == 0 and "no service is running" in r.stdout, r.stdout + r.stderr
    finally:
        head.kill()


def test_a_stale_cluster_file_is_answered_at_once(short_tmp):
    env = _env(short_tmp)
    head = Head(short_tmp, env)
    head.kill()                                # as an OOM kill would: the file stays
    assert os.path.exists(head.file)
    for cmd in (["status"], ["serve", "--http-port", "0"]):
        r = _cli(env, *cmd)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        msg = r.stderr.strip()
        assert msg.count("\n") == 0 and msg.startswith("socllm: error: no Ray cluster"), msg
        assert head.file in msg and head.address in msg and "nothing answers" in msg, msg
    r = _cli(env, "stop")
    assert r.returncode == 0 and head.address in r.stdout and "nothing to stop" in r.stdout
    # generate: a private engine, after a note that the recorded cluster does not answer. Its
    # prompt is measured against its context before Ray starts, so a prompt too long ends it
    # there (a private engine's text is test_plan_cli's README check: it costs a Ray session)
    r = _cli(env, "generate", "The capital of France is Paris. " * 8, "--context", "16")
    assert r.returncode == 2, r.stderr
    note, error = r.stderr.strip().splitlines()
    assert "a private engine runs this request" in note and head.address in note, note
    assert error.startswith("socllm: error: the prompt has") and "context holds 16" in error, error


def test_no_cluster_names_what_was_tried(short_tmp):
    env = _env(short_tmp)
    for cmd in (["status"], ["serve", "--http-port", "0"]):
        r = _cli(env, *cmd)
        assert r.returncode == 2, r.stderr
        for tried in ("--address (not given)", "RAY_ADDRESS (unset)",
                      os.path.join(short_tmp, "ray", "ray_current_cluster") + " (absent)",
                      os.path.join(short_tmp, "ray_current_cluster") + " (absent)"):
            assert tried in r.stderr, (tried, r.stderr)
    dead = f"127.0.0.1:{free_port()}"
    r = _cli(env, "status", "--address", dead)
    assert r.returncode == 2 and f"--address {dead} (nothing answers there)" in r.stderr, r.stderr
    r = _cli(env | {"RAY_ADDRESS": dead}, "status")
    assert r.returncode == 2 and f"RAY_ADDRESS={dead} (nothing answers there)" in r.stderr, r.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_cluster_file_of_another_user_is_not_followed(short_tmp, monkeypatch):
    """A planted /tmp/ray/ray_current_cluster naming a live address redirects nothing."""
    import socket

    from socllm.actors.front import cluster
    os.makedirs(os.path.join(short_tmp, "ray"))
    planted = os.path.join(short_tmp, "ray", "ray_current_cluster")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with open(planted, "w") as f:
            f.write(f"127.0.0.1:{s.getsockname()[1]}")
        os.chown(planted, 65534, 65534)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setenv("RAY_TMPDIR", short_tmp)
        with pytest.raises(cluster.NoCluster, match="not this user"):
            cluster.find()
        os.chown(planted, os.getuid(), os.getgid())      # the same file of this user's is followed
        assert cluster.find() == (f"127.0.0.1:{s.getsockname()[1]}", planted)


def test_reap_orphans_passes_over_a_segment_it_may_not_unlink(tmp_path, monkeypatch):
    from socllm.memory import arena
    dead = subprocess.Popen(["true"])
    dead.wait()                                           # a pid whose process is gone
    theirs, mine = f"socllm-{dead.pid}-0badc0de", f"socllm-{dead.pid}-0000cafe"
    for name in (theirs, mine, f"socllm-{os.getpid()}-1234abcd"):   # the last: alive, kept
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setattr(arena, "SHM_DIR", str(tmp_path))
    unlink = os.unlink

    def refuse(path, *a, **k):           # another user's segment in the sticky /dev/shm
        if os.path.basename(path) == theirs:
            raise PermissionError(1, "Operation not permitted", path)
        return unlink(path, *a, **k)
    monkeypatch.setattr(os, "unlink", refuse)
    assert arena.reap_orphans() == [mine]
    assert sorted(os.listdir(tmp_path)) == sorted([theirs, f"socllm-{os.getpid()}-1234abcd"])


@pytest.mark.parametrize("env", [{}, {"TMPDIR": "/t1"}, {"RAY_TMPDIR": "/t2", "TMPDIR": "/t1"}])
def test_the_cluster_file_is_looked_for_by_rays_own_rule(monkeypatch, env):
    """actors/front/cluster.py finds Ray's temp dir without importing Ray (`generate` to a running
    service imports none): the folder Ray's own function gives."""
    from ray._common.utils import get_default_system_temp_dir
    from socllm.actors.front.cluster import ray_temp_root
    for name in ("RAY_TMPDIR", "TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ray_temp_root() == get_default_system_temp_dir()
