"""The tests' engine launcher is the project's one (shared/local_engine.py), which the drills and
benchmarks use too."""

from shared.local_engine import ROOT, EngineProcess

__all__ = ["ROOT", "EngineProcess"]
