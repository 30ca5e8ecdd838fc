"""ep: expert parallelism, ``parallelize(model, loader, ep=K)`` - the experts of each mixture-of-experts layer
placed over K data-parallel ranks (:mod:`~autodist.ep.place`), found from the model (:mod:`~autodist.ep.experts`:
Hugging Face's fused experts, called with the tokens, their top-k experts and weights), each token sent to the
ranks holding its experts and its contributions sent back by all-to-all (:mod:`~autodist.ep.exchange`), dropless,
added in one process's order; what it would do, read from one forward (:mod:`~autodist.ep.explain`); the options
it is built with (:mod:`~autodist.ep.options`). May import: layers, faults, runtime (never dp, mp or cp). Entry
points: :func:`autodist.ep.place.setup`, :func:`autodist.ep.experts.find`, :func:`autodist.ep.options.check`.
"""
