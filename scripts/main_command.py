"""Wall-clock time of the README's main command, `socllm generate "The capital of France is"`,
with no service running (a private engine in its own Ray session, started and stopped by the
command), as a user at a shell meets it: Python's start, imports, Ray's start, the engine's,
the request, and the exit. Also the time to its first streamed byte.

    python -m socllm.scripts.main_command [--reps 5] [--exe OTHER/.venv/bin/socllm ...] [--json F]

Each run is a fresh process. With several --exe (another checkout's command, say), runs
alternate between them, so that both see the same machine. Reports min/median/max for each.
The first run of each is a warm-up (it may time the plan or build kernels into the cache) and is
left out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from socllm.scripts.cli_ttft import first_byte_s

PROMPT = "The capital of France is"


def one_run(exe: str) -> tuple:
    """(seconds to the first byte of output, seconds to the command's exit)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    first, total, err = first_byte_s([PROMPT], exe, env)
    if "[private:" not in err:
        raise RuntimeError(f"{exe} generate ran on a running service, not a private engine: stop it")
    return first, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="main_command", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--exe", action="append", help="a socllm command (default: this venv's)")
    ap.add_argument("--json", help="write the runs here")
    a = ap.parse_args(argv)
    exes = a.exe or [os.path.join(os.path.dirname(sys.executable), "socllm")]
    for exe in exes:
        one_run(exe)                                  # warm-up
    runs = {exe: [] for exe in exes}
    for _ in range(a.reps):
        for exe in exes:
            runs[exe].append(one_run(exe))
    out = {"command": f'socllm generate "{PROMPT}"', "machine": platform.node(),
           "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                        if line.startswith("model name")), platform.machine()),
           "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d"), "results": {}}
    for exe, rs in runs.items():
        first, total = [r[0] for r in rs], [r[1] for r in rs]
        out["results"][exe] = {"first_byte_s": [round(x, 3) for x in first],
                               "wall_s": [round(x, 3) for x in total]}
        print(f"{exe}: wall {statistics.median(total):.2f} s [{min(total):.2f}-{max(total):.2f}], "
              f"first byte {statistics.median(first):.2f} s [{min(first):.2f}-{max(first):.2f}] "
              f"(median [min-max] of {len(rs)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
