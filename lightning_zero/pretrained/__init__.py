"""Weights from outside lightning-zero: a Hugging Face ``save_pretrained`` directory, safetensors files or a
``torch.save`` state dict, read a tensor at a time into a model that may already be sharded (``loading.py``, over
the files of ``files.py``). Imports: ``checkpoints/``, ``stage3/`` and below.
"""
