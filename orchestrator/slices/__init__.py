"""The slice verbs as plain functions returning dataclasses; the CLI is a thin layer over these, and `run`, `ssh`
and the supervisor call them directly. One module per job:
- plan: what `up` will create, and the zones that can hold it;
- create: `up` and `recreate`;
- delete: `down`;
- inspect: `status`, `ls`, `workers`, `node` (reading, no side effect) and `refresh` (writes the record);
- gc: what was left behind.
Where a slice lives is its provider's business (orchestrator/provider); nothing here asks which one it is.
"""
from orchestrator.slices.common import HOLDS_QUOTA, fmt_duration
from orchestrator.slices.create import (VALID_UNTIL_MARGIN_S, Attempt, Interrupted, UpResult, _check_name_free,
                                        recreate, spec_of, up, valid_until_s)
from orchestrator.slices.delete import DELETE_WAIT_BASE_S, DELETE_WAIT_PER_HOST_S, DownResult, delete_wait_s, down
from orchestrator.slices.gc import GcItem, GcResult, gc
from orchestrator.slices.inspect import SliceStatus, ls, node, refresh, status, workers
from orchestrator.slices.quote import Plan, make_plan

__all__ = ["HOLDS_QUOTA", "fmt_duration", "VALID_UNTIL_MARGIN_S", "Attempt", "Interrupted", "UpResult",
           "_check_name_free", "recreate", "spec_of", "up", "valid_until_s", "DELETE_WAIT_BASE_S",
           "DELETE_WAIT_PER_HOST_S", "DownResult", "delete_wait_s", "down", "GcItem", "GcResult", "gc", "SliceStatus",
           "ls", "node", "refresh", "status", "workers", "Plan", "make_plan"]
