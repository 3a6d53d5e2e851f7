"""What test modules share: models, data, launchers, reference runs and the parity check.

Test modules import from here only, never from one another (tests/test_test_layout.py checks it), so a test
file can be split, renamed or deleted without breaking another one. One concept per module:

- ``dist_utils``: forked gloo ranks (``run_distributed``), one optimizer step of a run or its reference.
- ``parity``: the named tolerances, ``close`` / ``is_close`` / ``check_parity``, and the ParityNet run under
  ZeroEngine or torch DDP (``train_parity_net``, ``ddp_reference``).
- ``models``: ParityNet (every case ZeRO must get right) and its deterministic data and optimizers; Block /
  TiedBlocks, a tied-weight model cut into stage-3 units for the pieces tested on their own.
- ``lightning_models`` / ``lightning_parity``: ParityNet as a LightningModule, Trainer arguments, per-rank
  result files; a Trainer fit of it and the comparison with Lightning's DDP fit.
- ``zoo_models``, ``gpt2_module``, ``tp_models``, ``pipeline_gpt2``, ``pipeline_lightning``: models users bring
  (HF GPT-2 / T5 / Llama from small configs, MoE, a TP block, GPT-2 cut into pipeline stages) with their data
  and single-process references.
- ``ckpt_models``, ``ckpt_files``: tied-weight checkpoint models; hand-made checkpoint files.
- ``lifecycle_harness``, ``batch_size_models``, ``hydra_recipe``: Trainer lifecycle sequences, the batch-size
  finder's modules, the Hydra recipe's composed configs.
"""
