"""Command-line tools around the engine, none importing Lightning at import time: ``cli.py``
(``lightning-zero``), ``estimate.py`` (model-state floors, which settings fit), ``tuning/`` (measured
search), ``deepspeed_config.py`` (a DeepSpeed JSON config as strategy + precision + Trainer flags)."""
