"""What ``parallelize(..., ep=K)`` is built with, checked before anything is set up: each refusal names what to
choose instead.

Example:
    >>> check(2, dp=4, mp=1, pp=2, cp=1, shard=None, exact=True, hooks=True, elastic=False)
"""
from __future__ import annotations

from typing import Any


def check(ep: Any, *, dp: int | None, mp: int, pp: int, cp: int, shard: str | None, exact: bool, hooks: bool,
          elastic: bool) -> None:
    """Raise where ``ep`` is not a positive int, does not divide the ``dp`` data-parallel ranks (None: not known
    yet, one process), or is combined with what it is not built with yet."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep must be a positive int (the ranks the experts of each layer are placed over), got {ep!r}")
    if ep == 1:
        return
    with_ = [name for name, on in ((f"cp={cp}", cp > 1), ("autodist run --elastic", elastic),
                                   ("sync='manual'", exact and not hooks)) if on]
    if with_:
        raise NotImplementedError(f"ep={ep} is not built with {', '.join(with_)} yet: use ep with data parallelism "
                                  f"(sync='backward'), mp, pp, any shard= level, "
                                  f"checkpoint=True and mixed precision, or leave ep=1")
    if not exact:
        raise ValueError(f"ep={ep} trains as one process does, with sync='backward'; a low-communication strategy "
                         f"is not built with it")
    if dp is not None and dp % ep:
        raise ValueError(f"ep={ep} does not divide the {dp} data-parallel ranks (the experts of each layer are placed "
                         f"over ep of them, their groups replicas of each other): choose ep from "
                         f"{[k for k in range(1, dp + 1) if dp % k == 0]}")
