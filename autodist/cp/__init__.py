"""cp: context parallelism, ``parallelize(model, loader, cp=K)`` - each sequence split over K ranks along its
tokens: every batch the loader hands over cut to this rank's tokens (:mod:`~autodist.cp.batches`, which also
counts them, the gradient's weight), and the model's attention and position calls, met as its forward runs,
routed to the whole sequence's (:mod:`~autodist.cp.forward`), masked with the whole batch's padding and packed
documents (:mod:`~autodist.cp.masks`), split under torch.compile into what stays in the graphs and what runs
eagerly between them (:mod:`~autodist.cp.compiled`); the options it is built with (:mod:`~autodist.cp.options`); what it
would do, read from one forward (:mod:`~autodist.cp.explain`). May import: layers, faults, runtime (never dp, mp or
ep). Entry points:
:class:`autodist.cp.batches.SequenceCut`, :func:`autodist.cp.forward.attach`, :func:`autodist.cp.options.check`.
"""
