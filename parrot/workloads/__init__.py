"""parrot.workloads: the inputs the benchmarks (:mod:`parrot.bench`) and the simulator (:mod:`parrot.sim`) replay.

Both import this package; it imports neither (``tests/test_layering.py`` checks it). Every draw is seeded, so a
workload is the same under every policy, engine and run.

* :mod:`parrot.workloads.apps` -- the paper's long-document apps (chain / map-reduce summary) as data, the example
  document
* :mod:`parrot.workloads.multi_agent` -- the MetaGPT-style multi-agent workflow (paper §8.4) as data
* :mod:`parrot.workloads.synth` -- seeded synthetic text sized in simulator tokens, paper-scale apps, GPTs prompts
* :mod:`parrot.workloads.cluster_mix` -- the sizes of cluster_bench's scenarios and their document chunks
* :mod:`parrot.workloads.preble` -- request streams with the shape of Preble's five workloads (Table 1)
* :mod:`parrot.workloads.azure_trace` -- Preble §5.3's mixed workload on the shipped Azure LLM trace excerpt
  (``data/``)
* :mod:`parrot.workloads.tools` -- the INFERCEPT / LAMPS tool mixes at Table 2 scale (simulator) and CPU scale
  (real engine)
* :mod:`parrot.workloads.arrivals` -- arrival processes (Poisson, bursty)
* :mod:`parrot.workloads.baseline_client` -- the request-centric baseline client (LangChain-style, one emulated
  round trip per call) that runs the apps against an OpenAI-style completion service
"""
