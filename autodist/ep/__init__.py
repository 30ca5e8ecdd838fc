"""ep: expert parallelism, ``parallelize(model, loader, ep=K)`` - the experts of each mixture-of-experts layer
placed over K data-parallel ranks, found from the model (:mod:`~autodist.ep.experts`: a module of ``num_experts``
experts called with the tokens, their top-k experts and weights), held as ``(num_experts, ...)`` parameters
(:mod:`~autodist.ep.place`: Hugging Face's fused experts, a slice a rank) or as expert modules
(:mod:`~autodist.ep.modules`: Switch Transformers, a user's ``nn.ModuleList``, whole experts a rank), each token
sent to the ranks holding its experts and its contributions sent back by all-to-all (:mod:`~autodist.ep.exchange`),
dropless, added in one process's order; what a checkpoint needs of experts held as modules
(:mod:`~autodist.ep.saved`); what it would do, read from one forward (:mod:`~autodist.ep.explain`); the options it
is built with (:mod:`~autodist.ep.options`). May import: layers, faults, runtime (never dp, mp or cp). Entry
points: :func:`autodist.ep.place.setup`, :func:`autodist.ep.experts.find`, :func:`autodist.ep.options.check`.
"""
