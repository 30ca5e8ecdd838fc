"""What a rank holds for a model, by kind: the vocabulary ``autodist.memory`` counts in, which every part of
autodist that keeps tensors or shared memory for a model reports through (``held()`` methods).

Example:
    >>> held = Held()
    >>> held.add("optimizer state", *state.values())
    >>> held.share(mapping, sharers=2)          # a file of shared memory both ranks of this host map
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

# The kinds, in the order a storage is given to the first that claims it (a gradient that is a view of a
# bucket is a gradient, not a buffer of autodist's).
KINDS = ("parameters", "model buffers", "gradients", "optimizer state", "autodist buffers", "shared memory")


@dataclass
class Held:
    """Tensors by kind, and files of shared memory with the number of ranks of this host that map each."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    files: list[tuple[mmap.mmap, int]] = field(default_factory=list)

    def add(self, kind: str, *tensors: torch.Tensor | None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
        self.tensors += [(kind, t) for t in tensors if t is not None]

    def share(self, mapping: mmap.mmap | None, sharers: int) -> None:
        """A file of shared memory ``sharers`` ranks of this host map (each pays 1/``sharers`` of it)."""
        if mapping is not None and not any(m is mapping for m, _ in self.files):
            self.files.append((mapping, sharers))

    def extend(self, other: "Held") -> None:
        self.tensors += other.tensors
        for mapping, sharers in other.files:
            self.share(mapping, sharers)
