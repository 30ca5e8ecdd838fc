"""train: what a training loop needs beside the model - the engine (prefetch, exact metrics, split evaluation,
progress bar, epoch logs; public as ``autodist.engine``) and checkpoints (atomic, checksummed, dense and portable
across world sizes and mp degrees; public as ``autodist.checkpoint``).
May import: pp, sync, sharded, dp, mp, cp, ep, layers, faults, runtime. Entry points:
:func:`autodist.train.checkpoint.save`,
:func:`~autodist.train.checkpoint.load`, :func:`~autodist.train.checkpoint.resume`, :mod:`autodist.train.engine`.
"""
