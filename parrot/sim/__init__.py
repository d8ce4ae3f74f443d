"""parrot.sim: paper-scale discrete-event simulation of a Parrot cluster (no torch).

* :mod:`parrot.sim.vloop` -- an asyncio event loop on a virtual clock (jumps to the next timer when idle)
* :mod:`parrot.sim.cost_model` -- iteration cost models (roofline GPU models, fitted this-machine model)
* :mod:`parrot.sim.engine` -- SimEngine: an EngineClient over the real engine scheduler / KV block pool
* :mod:`parrot.sim.tokenizer` -- the synthetic word tokenizer and seeded output lengths
* :mod:`parrot.sim.cluster` -- SimCluster: the real Manager + N SimEngines, Parrot and baseline drivers
* :mod:`parrot.sim.workloads`, :mod:`parrot.sim.experiments` -- the paper's experiments (``python -m
  parrot.sim.experiments``); :mod:`parrot.sim.profile` -- ``parrot profile`` (measures the builtin engine)
"""
