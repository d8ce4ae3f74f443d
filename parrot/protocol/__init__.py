"""The engine contract: what the manager, the backends and the simulator speak to an engine. No torch.

interface.py     the EngineClient interface and its data (FillResult, GenerateResult, EngineStatus, ModelInfo, ...)
wire.py          their JSON form over HTTP
metrics.py       an EngineStatus as Prometheus metrics (the same names on an engine and on the manager)
block_hashes.py  how a KV block is named (engines' prefix caches, the manager's prefix-aware placement)
"""
