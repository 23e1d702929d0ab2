"""The multi-process launcher the tests and the benchmarks share (run from a checkout of the repository: it starts
``tests/workers`` scripts and benchmark ranks on N gloo processes with a hard timeout)."""
