"""Communication: the only calls into ``torch.distributed`` (collectives.py, counted per group), int8 blocks for
quantized collectives (quantize.py), the per-step traffic report (comm_report.py) and the flat buffers collectives
borrow (buffer_pool.py).

May import: nothing else from the engine (the bottom layer; pyproject.toml's import-linter contract).
"""
