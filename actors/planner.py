"""The planner actor: policies/planner.PlannerCore (the plans as passes, compiled by
graph/planner.py into step programs, cached, one per plan/phase/bucket) served from its own
process."""
from __future__ import annotations

import ray

from socllm.policies.planner import PlannerCore


@ray.remote(num_cpus=0)
class Planner(PlannerCore):
    pass
