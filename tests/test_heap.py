"""shared/heap.py: the start-up heap kept out of the collector's full passes while a server serves
or a sweep runs, and given back after; and the engine says how much it froze."""

from __future__ import annotations

import gc
import weakref

from shared.heap import frozen_heap
from tools.local_engine import EngineProcess


class Node:
    """An object that can sit in a reference cycle and be watched by a weak reference."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A two-node cycle that nothing else references, and a weak reference to one of its nodes."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_cycle_made_before_waits_for_the_block_to_end_and_one_made_within_is_collected() -> None:
    holder = [Node(), Node()]
    holder[0].other, holder[1].other = holder[1], holder[0]
    before = weakref.ref(holder[0])
    with frozen_heap() as frozen:
        assert frozen > 10_000 and gc.get_freeze_count() > 10_000  # pytest, torch, the engine: every module
        holder.clear()  # the cycle made before the block is garbage now, but frozen
        within = cycle()
        gc.collect()
        assert within() is None, "what is made afterwards is collected as before"
        assert before() is not None, "a full pass does not scan the frozen heap"
    assert gc.get_freeze_count() == 0, "given back when the block ends"
    gc.collect()
    assert before() is None, "and collected from then on"


def test_garbage_from_before_the_block_is_collected_first_not_frozen() -> None:
    dropped = cycle()
    with frozen_heap():
        assert dropped() is None


def test_a_served_engine_says_how_many_objects_it_froze() -> None:
    with EngineProcess("--model", "tiny", "--max-context", "64") as engine:
        [serving] = engine.events_named("engine_serving")
    assert serving["gc_frozen_objects"] > 10_000  # torch and the engine's modules, at the least
