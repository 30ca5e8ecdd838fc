"""runtime: the process's place among the ranks - the environment (read here for the library), World and
process groups, the dp x mp mesh and the Layout a plan chooses, RNG sharing, nested-batch walking, the batches the data pipeline handed
out, where this rank waits, and the typed collectives (``autodist.comm``).
May import: nothing of autodist's. Entry points: :func:`autodist.runtime.world.init`,
:mod:`autodist.runtime.environment`, :mod:`autodist.runtime.comm`, :class:`autodist.runtime.position.waiting`.
"""
