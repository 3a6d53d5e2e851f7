"""State placement: where each kind of training state lives ([Note: placement], placement.py) and the stores that
keep it there -- host and NVMe offload of masters and optimizer state, of stage 3's parameter shards, the scratch
files, their checksums and space agreement.

May import: ``comm``, ``layout``. Nothing above asks an offload knob: it asks the placement or a store.
"""
