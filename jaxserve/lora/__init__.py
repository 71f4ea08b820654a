"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

    adapter.py   a PEFT directory -> per-projection A [in, r] and B [r, out] (scaling folded in), checked
    slots.py     the device: zero slots beside each targeted projection, each step's per-token slots, and
                 the compiled-once write of one slot
    registry.py  the host: which adapter is in which slot; load / unload while serving

A request names an adapter (SamplingParams.lora, the OpenAI `model` field); the engine turns the name into
its slot (a per-row step input, device/step_inputs.py) and its identity (the root of its prefix-cache
keys). The batched matmul itself is pallas_kernels/matmul/lora.py, an entry of the projections' plan.
"""
