"""lightning-zero the engine and its parts: one training step, buffers, collectives, offload, ZeRO-R (no Lightning)."""
