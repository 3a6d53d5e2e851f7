"""Stage 3: parameters sharded between steps, gathered unit by unit around forward and backward.

``units.py`` builds the units (the policy choosing them is ``unit_policy.py``), ``partition.py`` owns their
lifecycle (``[Note: unit lifecycle]``), ``release.py`` decides when a unit's backward is over,
``guard.py`` catches reads of released parameters, ``join.py`` lets ranks run different numbers of
forwards in evaluation, ``deferred_init.py`` materializes meta-device models already sharded, ``pretrained*.py``
read weights straight into the shards, ``setup.py`` is the stage-3 side of an engine. Where a unit's shard lives
between uses is a parameter store's business (``engine/placement``).

May import: ``comm``, ``layout``, ``placement``, ``grads``, the config, ``memory.activations``; not ``optim``.
"""
