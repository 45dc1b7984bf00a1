"""The router core without I/O (core.py): worker state with one in-flight count, decisions with their timing and
stats, holds, completions, retries' bookkeeping. The HTTP router (framework/serving/router) and the simulator
(framework/sim/router.py) drive the same object."""
from framework.routing.core import (BROKEN_STREAM, CLIENT_DISCONNECT, FAIL, OK, Attempt, RouterCore, route_fields)
from framework.routing.stats import RouterStats
from framework.routing.workers import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, WorkerState

__all__ = ["Attempt", "BROKEN_STREAM", "CLIENT_DISCONNECT", "CLOSED", "CircuitBreaker", "FAIL", "HALF_OPEN", "OK",
           "OPEN", "RouterCore", "RouterStats", "WorkerState", "route_fields"]
