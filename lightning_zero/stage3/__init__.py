"""lightning-zero stage 3: units gathered around their use, sharded parameters, construction without the full model."""
