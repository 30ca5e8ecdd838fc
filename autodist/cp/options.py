"""What ``parallelize(..., cp=K)`` is built with, checked before anything is set up: each refusal names what to
choose instead.

Example:
    >>> check(2, mp=1, pp=1, exact=True, elastic=False)
"""
from __future__ import annotations

from typing import Any


def check(cp: Any, *, mp: int, pp: int, exact: bool, elastic: bool, one_f_one_b: bool = False) -> None:
    """Raise where ``cp`` is not a positive int or is combined with what it is not built with yet
    (``one_f_one_b``: ``loss_fn=``, the loss inside the forward; pp's 1F1B)."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be a positive int (the ranks sharing each sequence), got {cp!r}")
    if cp == 1:
        return
    with_ = [name for name, on in (("autodist run --elastic", elastic),
                                   ("loss_fn= (the loss inside the model's forward; under pp, 1F1B; without it "
                                    "pp runs GPipe, which cp is built with)", one_f_one_b)) if on]
    if with_:
        raise NotImplementedError(f"cp={cp} is not built with {', '.join(with_)} yet: use cp with data "
                                  f"parallelism, mp and pp's default schedule only, or leave cp=1")
    if not exact:
        raise ValueError(f"cp={cp} trains as one process does, with sync='backward' or 'manual'; a low-"
                         f"communication strategy is not built with it")


def world_check(cp: int, ranks: int, parts: int = 1) -> None:
    """Raise where ``cp`` does not divide the ``ranks`` holding the same part of the model (the world over the
    ``parts`` it is split in: mp x pp)."""
    if ranks % cp:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        over = f"{ranks} ranks" if parts == 1 else \
            f"{ranks} ranks holding each part of the model (the world over mp x pp = {parts})"
        raise ValueError(f"cp={cp} does not divide the {over} (each sequence is split over cp ranks, the world "
                         f"being data-parallel x cp{' x pp x mp' if parts > 1 else ''}); choose cp from {divisors}")


def loader_check(cp: int, data: Any) -> None:
    """Raise where ``data`` is not a DataLoader (a context-parallel model's batches are cut as they are handed
    over, by the loader ``parallelize`` returns)."""
    from torch.utils.data import DataLoader

    if not isinstance(data, DataLoader):
        raise NotImplementedError(f"cp={cp} cuts each batch of a DataLoader into this rank's tokens as the loader "
                                  f"hands it over; got {type(data).__name__}: wrap the data in a DataLoader (a "
                                  f"TensorDataset of (batch, seq) tensors, say)")

