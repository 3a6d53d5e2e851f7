"""Gradients: parameters grouped into flat buckets (buckets.py) and the bucket table (bucket_table.py); the reducer
that reduces or reduce-scatters them during backward (reducer.py); clearing them (grad_clear.py); the global norm
(grad_norm.py) and torch's clipping on an engine's parameters routed to it (clip_routes.py); DDP's buffer broadcast
(buffer_sync.py).

May import: ``comm``, ``layout``, ``placement``, the plan.
"""
