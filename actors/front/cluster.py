"""Which Ray socllm runs in: the running cluster (found by Ray's own rules, checked before Ray
waits on them), else a private one for this process (ensure_ray, stop_ray).

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

import contextlib
import os
import socket
import sys
import tempfile

# where the service lives in a cluster: its Ray namespace and its actor's name (here, not in
# actors/service.py: the HTTP replica and the client find it without importing the engine)
NAMESPACE, NAME = "socllm", "service"
OBJECT_STORE_BYTES = 256 << 20     # Ray's default takes 30 % of RAM; the pool carries the tensors
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


def ray_env_options(threads: int) -> dict:
    """Ray options that give an actor policies/threads.py's actor_env: none where the Ray itself
    started with it (a private Ray socllm started: every worker inherits the raylet's
    environment, and an actor with a runtime_env of its own started ~0.2 s later), else a
    runtime_env that carries it."""
    from socllm.policies.threads import actor_env
    env = actor_env(threads)
    if os.environ.get(INHERITED) == _stamp(env):
        return {}
    return {"runtime_env": {"env_vars": env}}


INHERITED = "SOCLLM_RAY_ENV"       # set in a private Ray's environment: what its workers inherit


def _stamp(env: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(env.items()))


def private_ray_env(threads: int) -> dict:
    """The environment variables a private Ray is started with (and so every actor in it)."""
    from socllm.policies.threads import actor_env
    env = actor_env(threads)
    return env | {INHERITED: _stamp(env)}


def ensure_ray(threads: int, address: str | None = None) -> bool:
    """Join the running Ray cluster (find()'s rules: address, RAY_ADDRESS, Ray's
    cluster file), else start a private local one. Returns True if we started it. A cluster
    that is found but does not answer (a stale cluster file) is passed over at once; an
    explicit `address` that does not answer raises NoCluster."""
    import ray
    if ray.is_initialized():
        return False
    try:
        join(address)
        return False
    except NoCluster:
        if address:
            raise
    _start_private_ray(threads)
    return True


def _start_private_ray(threads: int):
    """A new local Ray instance for this process (never the address of a stale cluster file or
    RAY_ADDRESS), for a budget of `threads`:
    - its workers run at nice 0, not Ray's 15: on a 2-core device our actors' kernel threads
      then yield to Ray's own daemons (at 0, decode measured ~5 % faster and steadier);
    - PRIVATE_WORKERS worker processes started with it, and no API server (_no_api_server);
    - the thread budget's variables in its own environment, which every worker inherits: no
      runtime_env per actor (ray_env_options); stop_ray() puts them back;
    - its autoscaler monitor and log monitor stopped as they appear: one machine has no nodes to
      add and no worker log goes to the driver; they took CPU from everything else's start (~0.2
      s of the README's command on two cores), and ray.shutdown() waited a second for the first."""
    import threading
    import ray
    env = private_ray_env(threads)
    _saved_env.update({k: os.environ.get(k) for k in env})
    os.environ.update(env)
    started = threading.Event()
    watcher = threading.Thread(target=_stop_idle_daemons, args=(started,), daemon=True)
    watcher.start()
    try:
        with _no_api_server():
            ray.init(address="local", num_cpus=PRIVATE_WORKERS, object_store_memory=OBJECT_STORE_BYTES,
                     include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     _system_config=PRIVATE_RAY_CONFIG)
    finally:
        started.set()
        watcher.join()


# The worker processes a private Ray starts with itself, for the two actors every engine starts
# (the service and its base processor): their Python starts while Ray's agents start, not after
# (~1 s of the README's command on a 2-core Xeon). Ray prestarts one a CPU it is given, and
# socllm's actors take no CPU slots: the private Ray is given this many CPUs.
PRIVATE_WORKERS = 2
PRIVATE_RAY_CONFIG = {"worker_niceness": 0, "enable_worker_prestart": False,
                      "prestart_worker_first_driver": True,
                      # no task events: they feed Ray's state API and dashboard, which a private Ray
                      # does not run, and the driver's flush of them took ~0.25 s of ray.shutdown()
                      # (0.24-0.37 -> 0.10-0.15 s on a 2-core Xeon)
                      "task_events_report_interval_ms": 0}


@contextlib.contextmanager
def _no_api_server():
    """Ray's start without its API server: Ray's dashboard.py, which without the dashboard still
    serves job submission and the state API. Nothing outside this process reaches a private Ray,
    and ray.init waits for that server's start (~1 s of the README's command on a 2-core Xeon,
    ~110 MB). And without importing the dashboard's libraries in this process only to learn they
    are installed (aiohttp, grpc, opentelemetry ...: 0.3 s before the raylet starts, here):
    _dashboard_deps looks them up unimported. A Ray lacking either function starts unchanged."""
    import ray
    node = getattr(getattr(getattr(ray, "_private", None), "node", None), "Node", None)
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    patches = [(owner, name, stand_in) for owner, name, stand_in in
               ((node, "start_api_server", lambda self, **_: None),
                (utils, "get_dashboard_dependency_error", _dashboard_deps))
               if getattr(owner, name, None) is not None]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, stand_in in patches:
        setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


DASHBOARD_DEPS = ("aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry",
                  "prometheus_client", "pydantic")   # ray/dashboard/optional_deps.py's packages


def _dashboard_deps():
    """ray._private.utils.get_dashboard_dependency_error, by finding the packages, not importing
    them: None where all are installed (ray[default]), else an ImportError naming one missing."""
    import importlib.util
    missing = next((m for m in DASHBOARD_DEPS if importlib.util.find_spec(m) is None), None)
    return None if missing is None else ImportError(f"No module named '{missing}'")


_saved_env: dict = {}          # what ensure_ray's private Ray changed in this process's environment


def stop_ray():
    """Stop the private Ray that ensure_ray started, and undo its environment."""
    import ray
    ray.shutdown()
    for k, v in _saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _saved_env.clear()


IDLE_DAEMONS = {"monitor": "autoscaler/_private/monitor.py", "log_monitor": "_private/log_monitor.py"}


def _stop_idle_daemons(started):
    """Kill the IDLE_DAEMONS among this process's children as they appear, until Ray has
    started (`started` set); then reap them through Ray's own record (ray.shutdown() passes over
    a process that is gone)."""
    import psutil
    import ray
    me, left = psutil.Process(), set(IDLE_DAEMONS.values())
    while left and not started.is_set():
        for p in me.children():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            for tag in [t for t in left if t in cmd]:
                p.kill()
                left.discard(tag)
        started.wait(0.01)
    started.wait()                      # both may be gone before ray.init has returned
    node = getattr(ray._private.worker, "_global_node", None)
    for kind in IDLE_DAEMONS:
        for info in (getattr(node, "all_processes", None) or {}).get(kind, ()):
            try:
                info.process.kill()
                info.process.wait(timeout=5)
            except Exception:           # a Ray without this record: ray.shutdown() stops it
                pass
