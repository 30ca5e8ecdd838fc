"""layers: the public model-parallel layers, exact drop-ins for ``nn.Linear`` split over ranks, the autograd
Functions that communicate for them (:mod:`~autodist.layers.comm`), :class:`~autodist.layers.shard.Shard`,
how a parameter is split, and the gradients of split parameters, whose norms over the whole model are the
model's (:mod:`~autodist.layers.split_grad`: ``clip_grad_norm_`` under mp). May import: faults, runtime. Entry points: the classes below.

``MPInitialReshape``, ``MPInitialLinear``, ``MPBaseReshape``, ``MPBaseLinear``
and ``MPTanh`` are TorchAD-NN's layers, done right: each takes a full tensor
and returns a full tensor, so they compose in any ``nn.Sequential``; the bias
is added once and gradients are exact. ``ColumnParallelLinear`` and
``RowParallelLinear`` are Megatron's pair, which ``parallelize(mp=K)`` swaps in
where it can; ``MPMultiheadAttention`` is ``nn.MultiheadAttention`` split by heads. Every split layer defaults to the whole world as its group.
``context_attention`` is attention over a sequence split across ranks by a ``SequenceSplit`` (context
parallelism, :mod:`~autodist.layers.context`), exact against one process.

Example:
    TorchAD-NN's README network, by hand (run under ``autodist run -n 2``):

    >>> import autodist
    >>> from autodist.layers import MPBaseLinear, MPInitialLinear, MPInitialReshape, MPTanh
    >>> autodist.init()
    >>> net = nn.Sequential(MPInitialReshape(1024), MPInitialLinear(1024, 2048), MPTanh(), MPBaseLinear(2048, 10))
    >>> net, data = autodist.parallelize(net, data)   # implies mp = group size; syncs data parallel if any
    >>> out = net(torch.randn(128, 32, 32))           # (128, 10), the same on every rank

Note:
    Build split layers after ``autodist.init()`` (they read their rank in the
    group when built), with the same seed on every rank of the group: built
    directly, a layer draws the dense ``nn.Linear`` weights and keeps its slice.
"""
from autodist.layers.activation import MPTanh
from autodist.layers.attention import MPMultiheadAttention
from autodist.layers.context import SequenceSplit, context_attention
from autodist.layers.linear import ColumnParallelLinear, MPBaseLinear, MPInitialLinear, RowParallelLinear
from autodist.layers.reshape import MPBaseReshape, MPInitialReshape

__all__ = ["MPInitialReshape", "MPInitialLinear", "MPBaseReshape", "MPBaseLinear", "MPTanh",
           "ColumnParallelLinear", "RowParallelLinear", "MPMultiheadAttention", "SequenceSplit", "context_attention"]
