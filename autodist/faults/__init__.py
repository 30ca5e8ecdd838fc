"""faults: a hang or a lost rank becomes one named error on every rank - the watchdog thread (heartbeats
through the rendezvous store), the reader that reads every status once a tick for all ranks and writes
their digest, and the verdicts in words; in an elastic job (``autodist run --elastic``) the generations of
ranks alive together instead (:mod:`autodist.faults.elastic`).
May import: runtime. Entry points: :func:`autodist.faults.watchdog.start`, :func:`autodist.faults.watchdog.rank_left`,
:func:`autodist.faults.verdicts.judge`.
"""
