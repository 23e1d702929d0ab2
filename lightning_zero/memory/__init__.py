"""The host heap and what a step costs it: the lowest layer, below every collective and buffer.

``costs.py`` counts, without a clock, the engine's own large allocations, the bytes it copies and the process's minor
page faults; ``heap_pin.py`` holds a small block at the top of the heap so a step's activations stay mapped;
``host_memory.py`` is the escape hatch of a process-wide mmap threshold (off by default) and the trim after setup.
Imports: the standard library and torch only.
"""
