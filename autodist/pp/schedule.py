"""The order in which a stage runs its micro-batches' forwards (F) and backwards (B).

GPipe: every forward, then every backward, last first; the forwards run in ``model(x)`` and the backwards in
``loss.backward()``, so the user's loop is untouched, and each stage keeps all ``M`` micro-batches'
activations until backward. 1F1B: after ``K - s - 1`` forwards on stage ``s`` of ``K``, one forward and one
backward in turn, so a stage keeps at most ``K - s`` micro-batches' activations; the backward of a micro-batch
needs its loss, so the whole step runs inside ``model(x)`` (``parallelize(..., loss_fn=...)``). Both leave
the same idle time: a stage waits ``(K - 1) / (M + K - 1)`` of the step (:func:`bubble`).

Example:
    >>> one_f_one_b(stages=2, stage=0, pieces=3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
"""
from __future__ import annotations

Step = tuple[str, int]


def gpipe_forwards(pieces: int) -> list[Step]:
    return [("F", m) for m in range(pieces)]


def gpipe_backwards(pieces: int) -> list[Step]:
    return [("B", m) for m in reversed(range(pieces))]


def one_f_one_b(stages: int, stage: int, pieces: int) -> list[Step]:
    """Stage ``stage``'s steps under 1F1B (see the module docstring)."""
    warm = min(stages - stage - 1, pieces)
    order = [("F", m) for m in range(warm)]
    for m in range(warm, pieces):
        order += [("F", m), ("B", m - warm)]
    return order + [("B", m) for m in range(pieces - warm, pieces)]


def bubble(stages: int, pieces: int) -> float:
    """The share of a step a stage waits, with the micro-batches' steps alike and sends free."""
    return (stages - 1) / (pieces + stages - 1)
