"""lightning-zero checkpoints: sharded directories (DCP), full files, consolidation and export, pretrained weights."""
