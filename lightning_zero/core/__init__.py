"""lightning-zero's primitives, below stage 3, the checkpoints and the engine: the flat layout and its buckets, the
gradient reducer, the collectives and process groups, the sharded optimizer step, mixed precision, offload and
ZeRO-R's activation checkpointing (no Lightning)."""
