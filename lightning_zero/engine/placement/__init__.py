"""State placement: where each kind of training state lives ([Note: placement], placement.py) and the stores that
keep it there: stage 3's parameter shards (param_stores.py, nvme_params.py; others registered by name,
param_store_registry.py), masters + optimizer state (state_stores.py, nvme_states.py), saved activations
(activation_stores.py); the NVMe scratch files, their checksums and space agreement; one I/O agreement for all.

May import: ``comm``, ``layout``. Nothing above asks an offload knob: it asks the placement or a store.
"""
