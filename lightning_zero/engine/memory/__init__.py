"""Memory: the model-state floors and the estimator's model of a rank's bytes (floors.py), the bytes a rank really
holds (report.py), the one "fits" rule on CPU (step_bytes.py), activation checkpointing (activations.py; where the
saved activations live is an activation store's, engine/placement).

May import: ``comm``, ``layout``, ``placement``, the plan; ``activations`` reads ``stage3``'s module policy.
"""
