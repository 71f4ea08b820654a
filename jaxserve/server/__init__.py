"""The gRPC server: `python -m jaxserve.serve --config FILE`.

Data flow: a call passes the API-key check (auth.py) and is parsed by its method (rpc.py), on a
thread pool of its kind so that streams never take the threads health checks need. Generate checks
the request against the server's limits (limits.py) before tokenizing, then hands it to the
EngineLoop, whose own thread owns the Engine (add, step, abort) under a handle of the server's
making; each step's outputs become deltas on the request's stream (request_stream.py), which the
handler yields to the client. A stream holds its in-flight slot until its RPC ends; a cancelled
RPC, or one whose client stops reading for stream_idle_timeout, aborts exactly its own request.
Prometheus metrics are updated after every step and served under the same TLS and keys.
"""
