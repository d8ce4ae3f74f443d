"""The two EngineClient implementations the manager uses for builtin engines: in-process (local_client) and over
HTTP (http_client).
"""
