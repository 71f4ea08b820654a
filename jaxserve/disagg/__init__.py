"""Prefill/decode disaggregation: prefill on one engine (or process), decode on another, KV handed over.

    prefill engine (role "prefill")            decode engine (role "decode")
    add_request -> steps to the first token
    park: pages held  ----- prompt, params -->  reserve: claim the cached prefix, allocate the rest
                      <---- held page keys ---
    send only the pages whose key is not held -> scatter into the reserved pages (transport.py)
    release the parked pages                    complete: admit with KV + first token; decode on

prefill_side.py and decode_side.py hold each engine's half (both time out and free pages);
handover.py runs one handover in one process; transport.py moves the page bytes (jax.device_put
between two meshes, or JAX's transfer server between processes).
"""
