"""The running engine: the core (op lifecycle, planning, stop checks), the wall-clock loop around it (engine_loop),
the model runner, sampling, contexts, constrained decoding, stop strings, threads and the CPU plan.
"""
