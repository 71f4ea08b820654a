"""The gRPC server: `python -m jaxserve.serve --config FILE`.

Data flow: an RPC handler thread validates a request and hands it to the EngineLoop, whose own
thread owns the Engine (add, step, abort); each step's outputs become deltas pushed to the
request's stream, which the handler yields to the client. A cancelled RPC aborts its request on
the loop thread, freeing its pages at once. Prometheus metrics are updated after every step.
"""
