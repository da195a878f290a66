"""Which Ray cluster socllm's commands join: Ray's own rules, checked before Ray waits on them.

In order, the first that names a cluster:
  1. an explicit address (`--address` of `socllm serve | generate | stop | status`, or the
     argument of `socllm.connect`);
  2. RAY_ADDRESS;
  3. the file that `ray start` writes, `ray_current_cluster`, where `ray.init()` reads it: in
     Ray's temp dir (RAY_TMPDIR, else TMPDIR, else /tmp, then `ray/`), and in RAY_TMPDIR itself
     (where `ray start --temp-dir=$RAY_TMPDIR` writes it).
These are `ray.init()`'s rules (it joins the recorded cluster, else starts one). socllm does not
scan for other raylets as `ray.init(address="auto")` does as a last resort: a cluster started with
`--temp-dir` elsewhere is named with --address, RAY_ADDRESS or RAY_TMPDIR. A cluster file of
another user is never followed (a planted `/tmp/ray/ray_current_cluster` redirects nothing).

Before Ray is asked to connect, the address must accept a TCP connection within CONNECT_S: a
cluster file left by a Ray that died without `ray stop` is reported (or passed over) at once
instead of Ray retrying it for minutes. When none answers, the error lists every place looked at
and what was there.

Ray 2.60's `ray start` turns token authentication on when a token exists (~/.ray/auth_token,
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH), but a driver given an explicit address (or RAY_ADDRESS)
sends its token only if RAY_AUTH_MODE=token: socllm sets that in its own process when a token
exists and RAY_AUTH_MODE is unset, so no one has to export it.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile

CONNECT_S = 2.0      # a GCS on this machine or the LAN answers a TCP connect well within this


class NoCluster(LookupError):
    """No Ray cluster answers; str(): what was tried."""

    def __init__(self, tried: list[str], stale: bool = False):
        self.tried, self.stale = tried, stale
        super().__init__("no Ray cluster is running here (tried " + "; ".join(tried)
                         + "): start one with `ray start --head`, or name it with --address, "
                         "RAY_ADDRESS, or RAY_TMPDIR for one started with --temp-dir")


def _host_port(address: str):
    """(host, port) of 'host:port' or 'ray://host:port', else None (a form Ray resolves itself)."""
    a = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def answers(address: str, timeout: float = CONNECT_S) -> bool:
    """Whether something accepts a TCP connection at the address (not yet whether it is Ray)."""
    hp = _host_port(address)
    if hp is None:
        return True                      # not host:port: let Ray judge it
    try:
        with socket.create_connection(hp, timeout=timeout):
            return True
    except OSError:
        return False


def ray_temp_root() -> str:
    """Where Ray keeps its temp dir by default: ray._common.utils.get_default_system_temp_dir's
    rule, without importing Ray (0.45 s here; `socllm generate` to a running service needs none)."""
    if "RAY_TMPDIR" in os.environ:
        return os.environ["RAY_TMPDIR"]
    if sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        return os.environ["TMPDIR"]
    return "/tmp" if sys.platform.startswith(("linux", "darwin")) else tempfile.gettempdir()


def _cluster_files() -> list[str]:
    files = [os.path.join(ray_temp_root(), "ray", "ray_current_cluster")]   # get_ray_address_file(None)
    if os.environ.get("RAY_TMPDIR"):
        files.append(os.path.join(os.environ["RAY_TMPDIR"], "ray_current_cluster"))
    return list(dict.fromkeys(os.path.abspath(f) for f in files))


def _read_own(path: str) -> tuple[str | None, str]:
    """(the address in a cluster file of this user's, what was found)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None, f"{path} (absent)"
    if st.st_uid != os.getuid():
        return None, f"{path} (ignored: owned by uid {st.st_uid}, not this user)"
    with open(path) as f:
        addr = f.read().strip()
    return (addr or None), f"{path} ({addr or 'empty'})"


def find(address: str | None = None) -> tuple[str, str]:
    """(address, where it came from) of the cluster to join; NoCluster names what was tried.
    address: an explicit one (None or "auto": look for one)."""
    if address and address != "auto":
        if not answers(address):
            raise NoCluster([f"--address {address} (nothing answers there)"], stale=True)
        return address, "--address"
    tried, stale = ["--address (not given)"], False
    env = os.environ.get("RAY_ADDRESS")
    if env and env != "auto":
        if answers(env):
            return env, "RAY_ADDRESS"
        tried.append(f"RAY_ADDRESS={env} (nothing answers there)")
        stale = True
    else:
        tried.append(f"RAY_ADDRESS ({'auto' if env else 'unset'})")
    for path in _cluster_files():
        addr, what = _read_own(path)
        if addr is not None:
            if answers(addr):
                return addr, path
            what = f"{path} ({addr}: nothing answers there; a Ray that ended without `ray stop`?)"
            stale = True
        tried.append(what)
    raise NoCluster(tried, stale)


def enable_token_auth():
    """RAY_AUTH_MODE=token in this process when it is unset and a Ray token exists here."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:                  # a Ray without token authentication
        return
    if AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        _enable_token_auth()


def join(address: str | None = None, namespace: str | None = None) -> str:
    """Connect this process to the cluster find() names (no-op if connected); returns its
    address (the form find() gives; the GCS's if this process had joined already). Raises
    NoCluster."""
    import ray
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    addr, source = find(address)
    enable_token_auth()
    try:
        ray.init(address=addr, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NoCluster([f"{addr} from {source} (it answers, but Ray could not join it: "
                         f"{first})"]) from None
    return addr
