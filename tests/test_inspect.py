"""`socllm inspect` and `socllm models`: what a GGUF holds, and every reason socllm does not run
it, in one listing."""
from __future__ import annotations

import json
import subprocess
import sys

from gguf import GGMLQuantizationType as QT
from tiny_gguf import write_tiny

from socllm.models.inspect import inspect

SOCLLM = [sys.executable, "-m", "socllm.actors.front.cli"]


def _tiny(path, arch="llama", matrix=QT.Q4_1, extra=()):
    return write_tiny(path, arch, matrix, extra=extra)


def _cli(*args):
    return subprocess.run(SOCLLM + list(args), capture_output=True, text=True, timeout=120)


def test_the_default_model_runs_and_says_what_it_holds(model_path):
    d = inspect(model_path)
    assert d["runs"] and d["problems"] == [] and d["architecture"] == "llama"
    assert d["config"]["layers"] == 30 and d["config"]["vocab"] == 49152
    assert {k: v["tensors"] for k, v in d["tensor_types"].items()} == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert d["chat_template"].startswith("{%") and d["tokenizer"]["pre"] == "smollm"
    r = _cli("inspect", model_path)
    assert r.returncode == 0 and "runs it" in r.stdout


def test_every_reason_a_file_does_not_run_is_listed(tmp_path):
    path = write_tiny(tmp_path / "k.gguf", matrix="Q2_K", dim=256, ffn=512, extra=("blk.0.attn_q_norm.weight",))
    d = inspect(path)
    assert not d["runs"]
    assert any(p.startswith("7 tensor(s) of type Q2_K where socllm runs F32/F16/BF16/Q4_0")
               and "(e.g. blk.0.attn_q.weight)" in p for p in d["problems"]), d["problems"]
    assert any("blk.0.attn_q_norm.weight" in p for p in d["problems"])
    r = _cli("inspect", path)
    assert r.returncode == 1 and "does not run it" in r.stdout and "Q2_K" in r.stdout
    ok = inspect(_tiny(tmp_path / "ok.gguf"))
    assert ok["runs"], ok["problems"]


def test_a_file_says_which_processors_read_its_weights(tmp_path, monkeypatch):
    d = inspect(write_tiny(tmp_path / "q0.gguf", matrix="Q4_0"))
    assert d["runs"] and d["processors"] == {"cpu": "runs", "gpu": "runs", "npu": "runs"}
    d = inspect(write_tiny(tmp_path / "k.gguf", matrix="Q6_K", dim=256, ffn=512))
    assert d["runs"] and set(d["processors"].values()) == {"runs"}
    f16 = write_tiny(tmp_path / "h.gguf", matrix="F16")
    assert set(inspect(f16)["processors"].values()) == {"runs"}
    from socllm.policies import placement                 # a build whose GPU lacks F16
    monkeypatch.setitem(placement.MATRIX_FORMATS, "gpu", ("Q4_1",))
    d = inspect(f16)
    assert d["runs"] and d["processors"]["cpu"] == "runs"
    assert d["processors"]["gpu"].startswith("the gpu kernels do not read F16 weights yet")


def test_an_unknown_architecture_and_a_file_that_is_not_gguf(tmp_path):
    d = inspect(_tiny(tmp_path / "g.gguf", arch="phi3"))
    assert d["problems"] == ["architecture 'phi3' is not supported (socllm runs: llama, qwen2, qwen3, "
                            "gemma3, qwen3moe, olmoe)"]
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    r = _cli("inspect", str(bad))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a GGUF" in r.stderr
    r = _cli("inspect", str(tmp_path / "none.gguf"))
    assert r.returncode == 2 and "not found" in r.stderr


def test_models_lists_families_and_types_per_processor():
    r = _cli("models", "--json")
    assert r.returncode == 0
    d = json.loads(r.stdout)
    assert d["families"]["llama"]["runs"] and d["families"]["qwen2"]["runs"]
    assert d["families"]["gemma3"]["runs"] and "sliding-window" in d["families"]["gemma3"]["what"]
    assert d["families"]["qwen3moe"]["runs"] and d["families"]["olmoe"]["runs"]
    matrices = d["tensor_types"]["attention and MLP matrices"]
    assert "Q4_1" in matrices["gpu"] and "Q6_K" in matrices["cpu"]


def test_the_fast_reader_gives_ggufs_own_fields(model_path, tmp_path):
    """models/gguf_file.py reads arrays (a vocabulary) in one pass: every field's parts, data
    indices and types, and every tensor's offset, equal gguf's reader's, on the default model
    and on a file with arrays of every kind, an empty one and a big-endian-free nested one."""
    import gguf
    import numpy as np

    from socllm.models.gguf_file import open_gguf
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("a.strings", ["", "x", "héllo", "a" * 300])
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, -1.25])
    w.add_array("a.bools", [True, False])
    w.add_array("a.empty", [])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (model_path, str(path)):
        a, b = open_gguf(p), gguf.GGUFReader(p, "r")
        assert list(a.fields) == list(b.fields)
        for k, fa in a.fields.items():
            fb = b.fields[k]
            assert (fa.offset, fa.types, fa.data) == (fb.offset, fb.types, fb.data), k
            assert len(fa.parts) == len(fb.parts), k
            assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(fa.parts, fb.parts)), k
        assert [(t.name, t.data_offset) for t in a.tensors] == [(t.name, t.data_offset) for t in b.tensors]
