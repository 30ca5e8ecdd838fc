"""dp: what every data-parallel strategy stands on - sharding the data (map-style, and streams: every rank reads them
and keeps its rows; Hugging Face datasets by their own shard), where each loader stands in its epochs (for
checkpoints to resume mid-epoch), and counting each rank's share of a batch (from the data, or from what the loss
divides by: loss_reading, loss_watch), what couples the ranks' rows (BatchNorm on the global batch, whole_batch,
the load-balancing term) and the check of a step against one process, the same-model check and broadcast,
exact bucketed gradient sync from backward hooks (sample-weighted), buffer averaging, the exchange that sums the
buckets (shared memory on one machine, the process group else), and the mixed-precision option's casts
(:mod:`autodist.dp.precision`).
May import: layers, faults, runtime (never mp, cp or ep). Entry points: :func:`autodist.dp.data.shard`,
:func:`autodist.dp.grad_sync.attach`, :func:`autodist.dp.grad_sync.synchronize_model`.
"""
