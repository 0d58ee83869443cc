"""The tests' engine launcher is the project's one (tools/local_engine.py), which the drills and
benchmarks use too."""

from tools.local_engine import ROOT, EngineProcess

__all__ = ["ROOT", "EngineProcess"]
