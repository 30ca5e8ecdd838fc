"""mp: model parallelism planned from what the model executes - torch.fx tracing or one recorded forward,
Megatron regions and the split rules that follow a split tensor through ops (:mod:`~autodist.mp.shard_flow`),
the rewrite that swaps in the MP layers, ``explain``, and gathering the dense state dict back.
May import: layers, faults, runtime (never dp, cp or ep). Entry points: :func:`autodist.mp.rewrite.explain`,
:func:`autodist.mp.rewrite.apply`, :func:`autodist.mp.gather.gather_state_dict`.
"""
