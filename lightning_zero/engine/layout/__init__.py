"""The parallel layout: which ranks do what. Parallel dims and their combinations (dims.py, [Note: one parallel
layout]), every process group and device mesh made once per process (groups.py), torchrun restart attempts
(elastic.py), tensor parallelism's local pieces (tensor_parallel.py), which slice of a flattened parameter a rank
owns (sharding.py).

May import: ``comm``.
"""
