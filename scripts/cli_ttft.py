"""Wall-clock time from starting `socllm generate` to its first streamed byte, against a running
service (`socllm serve`) and with a private one (`--local`: a Service of its own, in its own Ray
session, stopped after), as a user at a shell meets it.

    python -m socllm.scripts.cli_ttft [--reps 5] [--prompt "The capital of France is"] [--no-local]

Each run is a fresh process (`socllm generate PROMPT --max-tokens 8`); the time includes Python's
start, imports, joining Ray, the request and the prefill. Reports min/median/max per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def first_byte_s(args: list, exe: str | None = None, env: dict | None = None) -> tuple:
    """`socllm generate ARGS` (exe: another socllm command): (seconds to its first byte of output,
    seconds to its exit, its stderr)."""
    exe = exe or os.path.join(os.path.dirname(sys.executable), "socllm")
    t0 = time.perf_counter()
    p = subprocess.Popen([exe, "generate", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = p.stdout.read(1)
    t1 = time.perf_counter()
    rest, err = p.communicate(timeout=600)
    total = time.perf_counter() - t0
    if p.returncode != 0 or not first:
        raise RuntimeError(f"socllm generate failed: {err.decode().strip()}")
    return t1 - t0, total, err.decode()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cli_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--no-local", action="store_true", help="skip the private-service (--local) runs")
    ap.add_argument("--json", default=None, help="also write the runs to this file")
    a = ap.parse_args(argv)
    # service: over its HTTP endpoint, no Ray in the command (actors/front/direct.py); service-ray:
    # the same service through Ray (the command finds no record of it: another runtime dir)
    nowhere = tempfile.mkdtemp()
    modes = [("service", [], None), ("service-ray", [], {**os.environ, "XDG_RUNTIME_DIR": nowhere})]
    modes += [] if a.no_local else [("local", ["--local"], None)]
    rows = {name: [] for name, _, _ in modes}
    for rep in range(a.reps):                # interleaved: the machine's drift hits every mode
        for name, extra, env in modes:
            if name == "local" and rep >= max(1, a.reps // 2):
                continue
            rows[name].append(first_byte_s([a.prompt, "--max-tokens", "8", *extra], env=env)[:2])
    out = {}
    for name, runs in rows.items():
        firsts, totals = [r[0] for r in runs], [r[1] for r in runs]
        out[name] = {"first_byte_s": firsts, "command_s": totals}
        print(f"{name:>11}: first byte {statistics.median(firsts):.2f} s [{min(firsts):.2f}-{max(firsts):.2f}]"
              f", whole command {statistics.median(totals):.2f} s [{min(totals):.2f}-{max(totals):.2f}]"
              f" (median [min-max] of {len(runs)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m socllm.scripts.cli_ttft " + " ".join(argv or sys.argv[1:]),
                       "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                    if line.startswith("model name")), ""),
                       "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d"),
                       "prompt": a.prompt, "runs": {k: {m: [round(x, 3) for x in v] for m, v in r.items()}
                                                    for k, r in out.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
