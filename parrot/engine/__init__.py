"""The builtin PyTorch engine (the contract it serves, EngineClient's Fill / Generate / FreeContext, is
:mod:`parrot.protocol`)::

    engine/
      settings.py   one validated settings object (env PARROT_ENGINE_*, CLI, config)
      files/        model files without torch: config, GGUF reader, default model, tokenizer
      loader/       weights into the model (GGUF / safetensors), the packed-weight cache, build_engine (builder)
      models/       model families and the decoder
      layers/       linear / attention / rotary layers over the kernels
      kernels/      native CPU kernels (C++), built once per machine
      kv_cache/     the paged KV pool, prefix cache, host swap store, tool pauses
      scheduler/    batch planning (budgets, KV, preemption) and the engine policies (admission order, pauses)
      runtime/      the core (op lifecycle), its wall-clock loop, the runner, sampling, stop strings, CPU plan
      clients/      the EngineClients the manager uses for builtin engines: in-process, over HTTP
      server/       an engine as its own process: HTTP app, registration with the manager, idempotent fills
"""
