"""This process within the job: clean shutdown on signals, the deadline that ends a rank stuck in a native
collective, fault points the tests drive, calls that need every rank, and one report of an error raised on several.
Imports: ``comm/`` and below.
"""
