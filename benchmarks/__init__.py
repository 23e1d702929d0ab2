"""Measurements behind benchmarks/RESULTS.md: one module per question, run from the repository root.

    python -m benchmarks.memory states|phases   # model-state bytes per stage against the paper's table and DDP;
                                                # the peak of each phase of a step, against DDP and FSDP2
    python -m benchmarks.compare                # step time and memory: ddp, zero1-3, FSDP2, DeepSpeed side by side,
                                                # and interleaved A/B runs of strategy options
    python -m benchmarks.check_speed            # regression check before merging: zero1-3 against DDP at N=2
    python -m benchmarks.gloo_collectives       # gloo's collectives on one buffer (why CPU runs use all-reduce)
    python -m benchmarks.activations            # activation checkpointing (ZeRO-R): bytes held, peak, step time
    python -m benchmarks.construction           # zero3's sharded construction: host memory and time per rank
    python -m benchmarks.checkpoint_io          # checkpoint save, resume, consolidate and inference-load costs
    python -m benchmarks.recut                  # reading a tensor-parallel slice at another size (universal ckpts)
    python -m benchmarks.offload                # ZeRO-Offload: the CPU step, and training steps with offload
    python -m benchmarks.disk                   # disk offload (ZeRO-Infinity): peak RSS, step time, window bytes
    python -m benchmarks.gpu_check              # every precision and stage on one CUDA device
    python -m benchmarks.zeropp_loss            # ZeRO++'s qwZ/qgZ: the demo GPT's loss against the exact run, bytes

Private modules: ``_model`` (the GPT sizes, data and LightningModules, around examples/gpt.py's ``GPT``),
``_worker`` (one rank of a GPT launch), ``_probes`` (what a rank measures), ``_peers`` (FSDP2, DeepSpeed),
``_report`` (compare's tables and plot), ``_construction_rank`` and ``_checkpoint_rank`` (one rank of
``construction``, of ``checkpoint_io``), ``_zeropp_rank`` (one rank of ``zeropp_loss``). ``results`` renders
RESULTS.md, docs/results.md and the plots from the committed records in ``records/`` (one per question).
"""
