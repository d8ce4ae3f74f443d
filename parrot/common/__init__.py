"""What the frontend, the manager, the engine and the simulator share (plain Python, no torch; the client
frontend imports it):

* ``errors``     -- typed errors, each with its HTTP status and OpenAI-style code;
* ``sampling``   -- SamplingParams (the one sampling parameter set) and FinishReason;
* ``perf``       -- PerfCriteria, LatencyTargets (as a GET states them) and PinnedTargets (deadline absolute);
* ``template``   -- prompt templates with ``{{input:x}}`` / ``{{output:y}}`` placeholders, and an output's default stop;
* ``transforms`` -- declarative output transforms (data, validated, never code);
* ``step_cost``  -- the online model of one engine iteration's time, for cost-aware scheduling.
"""
