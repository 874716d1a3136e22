"""tandem's dependency engine: ops ordered by the vars they read and write (after MXNet's engine).

Public API: Var, Engine, ThreadedEngine, NaiveEngine, get_engine, set_engine, bulk, EngineError,
EngineTimeout and the trace module. See docs/engine.md for semantics, knobs and measurements.
"""

from __future__ import annotations

from tandem import trace  # the shared trace module (tandem/trace.py), also tandem.engine.trace
from tandem.engine.base import Engine
from tandem.engine.bulking import bulk
from tandem.engine.default import get_engine, set_engine
from tandem.engine.errors import EngineError, EngineTimeout
from tandem.engine.naive import NaiveEngine
from tandem.engine.threaded import ThreadedEngine, ThreadedEngineConfig
from tandem.engine.var import Var

__all__ = [
    "Var",
    "Engine",
    "ThreadedEngine",
    "ThreadedEngineConfig",
    "NaiveEngine",
    "get_engine",
    "set_engine",
    "bulk",
    "EngineError",
    "EngineTimeout",
    "trace",
]
