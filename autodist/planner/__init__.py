"""planner: ``parallelize(model, data, plan="auto")`` and ``autodist.plan`` - the layout (data x pipeline x model
parallel, ``shard=``, ``checkpoint=``, in the precision given) chosen for the model, the world and a memory budget,
or predicted for a world that is not here (:mod:`~autodist.planner.target`): every candidate's memory
predicted by kind (:mod:`~autodist.planner.memory`, from the layout and one measured forward/backward,
:mod:`~autodist.planner.profile`), the fitting ones ranked by a time model calibrated on this machine
(:mod:`~autodist.planner.timing`), the best few measured for a few steps on a copy of the model
(:mod:`~autodist.planner.trial`), and the choice explained (:class:`~autodist.planner.plan.ParallelPlan`, a table
that saves as JSON). It runs layouts through ``parallelize`` itself, which the public face passes in.
May import: train, pp, sync, sharded, dp, mp, cp, ep, layers, faults, runtime. Entry points:
:func:`autodist.planner.search.search`, :class:`autodist.planner.plan.ParallelPlan`,
:class:`autodist.planner.plan.Auto`, :class:`autodist.planner.target.Target`.
"""
