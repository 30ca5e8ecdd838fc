"""sharded: sharded data parallelism (ZeRO) - each data-parallel rank keeps and updates only its slice of the
optimizer state (``shard="optimizer"``), of the averaged gradients (``shard="gradients"``) and of the
parameters between uses (``shard="parameters"``), the same training as one process; and the blocks'
activations recomputed in backward (``checkpoint=True``, :func:`autodist.sharded.recompute.setup`).
``parallelize(model, data, shard=..., checkpoint=...)`` sets it up.
May import: dp, mp, cp, ep, layers, faults, runtime. Entry points: :func:`autodist.sharded.optimizer.setup`,
:class:`autodist.sharded.layout.Layout`, :class:`autodist.sharded.scatter.Scatter` (the buckets GradSync
reduce-scatters), :class:`autodist.sharded.grads.ShardedGrad` (what ``.grad`` holds then),
:func:`autodist.sharded.parameters.setup` and :class:`~autodist.sharded.parameters.BlockScatter` (the
blocks, :func:`autodist.sharded.blocks.find`, gathered and freed).
"""
