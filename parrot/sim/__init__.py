"""parrot.sim: paper-scale discrete-event simulation of a Parrot cluster (no torch).

* :mod:`parrot.sim.vloop` -- an asyncio event loop on a virtual clock (jumps to the next timer when idle)
* :mod:`parrot.sim.cost_model` -- iteration cost models (roofline GPU models, fitted this-machine model)
* :mod:`parrot.sim.sim_engine` -- SimEngine: the builtin engine's core (scheduler, KV block pool, op lifecycle) on
  the virtual clock, reached through the builtin engine's in-process client
* :mod:`parrot.sim.runner` -- SimRunner: a plan's synthetic step output and its cost (instead of a forward)
* :mod:`parrot.sim.tokenizer` -- the synthetic word tokenizer and seeded output lengths
* :mod:`parrot.sim.cluster` -- SimCluster: the real Manager + N SimEngines, Parrot and baseline drivers
* :mod:`parrot.sim.experiments` -- the paper's experiments (``python -m parrot.sim.experiments``) on the inputs of
  :mod:`parrot.workloads`; :mod:`parrot.sim.profile` -- ``parrot profile`` (measures the builtin engine)
"""
