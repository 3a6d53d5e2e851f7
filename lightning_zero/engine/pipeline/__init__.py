"""Pipeline parallelism composed with ZeRO 0-2: one engine per stage chunk over its data-parallel group
(pipeline_zero.py), cutting a model into stages (split.py), the stages' full-value state (state.py).

May import: everything in the engine (it composes engines); nothing in the engine imports it.
"""
