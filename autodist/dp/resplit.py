"""Data split once: what ``parallelize`` returned holds this rank's share, and a second split is refused.

Frameworks split the data they are given by rank themselves: torch's ``DistributedSampler`` (and Lightning's
wrappers of it), Accelerate's ``BatchSamplerShard``, ``IterableDatasetShard`` and ``DataLoaderDispatcher`` (under
Hugging Face's Trainer too). Given the shard ``parallelize`` returned, each rank would train on 1/N of its share,
on a different global batch from the others, and nothing would fail. The sharded Dataset and the sharded
loader's batch sampler look, when asked their length or iterated, for such a splitter among their callers (in
the frameworks' files only; the splitters are known by class name, so none is imported). What slips past them
is caught at the step: the ranks' batches carry the identity of their global batch
(:mod:`autodist.dp.grad_sync` compares it).

Example:
    >>> shard = RankShard(dataset, range(0, len(dataset), 2))
    >>> DistributedSampler(shard)     # RuntimeError: the Dataset parallelize returned is split again
"""
from __future__ import annotations

from torch.utils.data import Subset

from autodist.runtime.callers import calling_class

_SPLITTERS = ("DistributedSampler", "BatchSamplerShard", "IterableDatasetShard", "DataLoaderDispatcher")
_SPLITTER_FILES = ("torch/utils/data/distributed.py", "accelerate/", "lightning/", "lightning_fabric/",
                   "pytorch_lightning/", "transformers/")


def refuse_split_again(what: str) -> None:
    """Raise if a rank-splitting sampler or loader is among the callers (see the module docstring)."""
    kind = calling_class(_SPLITTERS, files=_SPLITTER_FILES)
    if kind is not None:
        raise RuntimeError(
            f"{what} that parallelize returned is being split by rank again, by {kind}: it holds this rank's share "
            f"already, so each rank would train on 1/N of it, on another global batch than the other ranks; give "
            f"the framework the original data (and the model not parallelized), or iterate what parallelize "
            f"returns yourself; docs/frameworks.md has each framework's route")


class RankShard(Subset):
    """The Dataset ``parallelize`` returns: rank's strided view of the user's map-style Dataset, which refuses to
    be split by rank again."""

    def __len__(self) -> int:
        refuse_split_again("the Dataset")
        return len(self.indices)
