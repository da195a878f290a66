"""The folders are the architecture (DESIGN.md §2): who may import whom, held by reading every
import (ast, those inside functions too). Arrows point down: actors -> policies -> graph,
actors -> memory, models -> graph; graph, memory, policies and models never import Ray, pyopencl
or openvino; the processors' backends (actors/cpu, gpu, npu) hold no Ray, and reach the rest of
actors/ only through the worker's unit protocol. The arrows that still run the wrong way are
listed, each with where it belongs: a new one fails, and so does a listed one that is gone."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("models", "graph", "memory", "policies", "actors", "scripts")
# layer -> the socllm layers it may import (itself always)
ALLOWED = {"models": {"graph"}, "graph": set(), "memory": set(), "policies": {"graph"},
           "actors": {"policies", "graph", "memory", "models"},
           "scripts": set(LAYERS)}
DEVICE_LIBS = ("ray", "pyopencl", "openvino")
BACKENDS = ("actors/cpu", "actors/gpu", "actors/npu")
# (file, module it imports): wrong-way arrows today, each with where it belongs (REVIEW.md §1)
KNOWN = {
    ("models/inspect.py", "socllm.policies.placement"),    # formats a backend reads: to models/quant
    ("graph/program.py", "socllm.models.quant"),           # the format table below both
    ("memory/layout.py", "socllm.models.quant"),           # models should hand memory bytes and a ref
    ("policies/sim/soc_plans.py", "socllm.memory.layout"),     # the simulator: a sub-package
    ("policies/sim/soc_serving.py", "socllm.memory.blocks"),   # blocks are natural here: DESIGN to allow
    ("policies/placement.py", "socllm.models.quant"),      # formats each backend reads: to models/
    ("actors/front/cli.py", "socllm.scripts.bench"),       # `socllm bench`: a script behind the CLI
    ("actors/front/plan.py", "socllm.scripts.profile_ops"),  # its first run measures a profile
    ("actors/front/simulate.py", "socllm.scripts"),        # its workload's text: with the simulator
    ("actors/front/moefy.py", "socllm.scripts.perplexity"),  # `moefy --ppl`: a measurement, as bench
}


def imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:          # relative: resolved against the file's package
                pkg = ["socllm", *path.relative_to(ROOT).parent.parts]
                pkg = pkg[:len(pkg) - node.level + 1]
                yield ".".join(pkg + ([node.module] if node.module else []))
            else:
                yield node.module


def test_every_import_follows_the_arrows():
    found, wrong = set(), []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            backend = rel.startswith(BACKENDS)
            for mod in imports(path):
                top = mod.split(".")[0]
                if top in DEVICE_LIBS and (layer not in ("actors", "scripts") or backend and top == "ray"):
                    wrong.append(f"{rel} imports {mod}")
                if top != "socllm" or mod.count(".") == 0:
                    continue
                target = mod.split(".")[1]
                ok = target == layer or target in ALLOWED[layer]
                if backend and mod.startswith("socllm.actors."):
                    own = "socllm." + rel.rsplit("/", 1)[0].replace("/", ".")
                    ok = mod.startswith(own) or mod == "socllm.actors.worker"
                if not ok:
                    (found.add((rel, mod)) if (rel, mod) in KNOWN else wrong.append(f"{rel} imports {mod}"))
    assert not wrong, "imports against DESIGN.md's arrows:\n" + "\n".join(wrong)
    assert found == KNOWN, f"listed arrows that are gone (take them off KNOWN): {KNOWN - found}"


def test_the_serving_core_reads_in_short_methods():
    """Issue 26's bar for the Ray processes at actors/ (engine, service, runner, pool, worker,
    ...): no function or method over 30 lines, docstring included (STYLE.md: nano-vllm's)."""
    long = [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((ROOT / "actors").glob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 30]
    assert not long, long


def test_finding_the_service_does_not_load_the_engine():
    """Ray's get_actor imports the module of the actor's class: in every client process (the
    HTTP replica, an agent's `socllm.connect()`) actors/service.py, the client and the HTTP
    front end load no engine, graph, model reader, tokenizer or template library (measured:
    +9 MB PSS a process and 92 modules with the engine, 35 without)."""
    import subprocess
    import sys
    heavy = ("socllm.actors.engine", "socllm.actors.pool", "socllm.graph.build", "socllm.models.tokenizer",
             "tokenizers", "jinja2")
    code = ("import sys, socllm.actors.service, socllm.actors.front.client, socllm.actors.front.http; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout + out.stderr
