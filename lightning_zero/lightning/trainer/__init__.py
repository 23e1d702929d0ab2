"""lightning-zero the Trainer's adapter: ZeroStrategy, its precision plugin, checkpoint hooks, ZeroCheckpointIO."""
