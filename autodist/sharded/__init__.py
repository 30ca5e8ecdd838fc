"""sharded: sharded data parallelism (ZeRO) - each data-parallel rank keeps and updates only its slice of the
optimizer state, the same training as one process. ``parallelize(model, data, shard="optimizer")`` sets it up.
May import: dp, mp, layers, faults, runtime. Entry points: :func:`autodist.sharded.optimizer.setup`,
:class:`autodist.sharded.layout.Layout`.
"""
