"""Prefill/decode disaggregation: prefill on one engine (or replica), decode on another, KV handed over.

    prefill engine (role "prefill")            decode engine (role "decode")
                                                reserve: claim the cached prefix, allocate the rest
    add_request -> steps to the first token <-- prompt, params, held page keys
    park: pages held
    send only the pages whose key is not held -> scatter into the reserved pages
    release the parked pages                    complete: admit with KV + first token; decode on

prefill_side.py and decode_side.py hold each engine's half (both time out and free pages).
In one process: handover.py runs a handover, transport.py moves the bytes with jax.device_put between
two meshes. Across processes (replicas of `jaxserve.serve`, driven by the router's disaggregated mode):
service.py registers the jaxserve.disagg.v1 services (proto/disagg.proto), prefill_service.py and
decode_service.py run them over each replica's EngineLoop, page_transfers.py moves the bytes with JAX's
transfer server; the metadata travels over gRPC. roles.py picks a half by engine.role and compiles the
page copies (device/page_copies.py: power-of-two chunks) at warm-up.
"""
