"""pp: pipeline parallelism - the model cut into ``pp`` stages at its blocks, each rank holding one stage's
blocks and running its micro-batches as they arrive (``parallelize(model, data, pp=K)``); the same training as
one process on the same global batch.
May import: sync, sharded, dp, mp, cp, ep, layers, faults, runtime. Entry points: :func:`autodist.pp.cut.choose`
(where the
stages begin), :func:`autodist.pp.pipeline.setup` (the stages installed in the model),
:func:`autodist.pp.pipeline.pipeline_of`.
"""
