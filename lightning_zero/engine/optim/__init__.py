"""Optimizers under ZeRO: master shards and the user's optimizer rebound onto them (optimizer.py), several optimizers
and ``add_param_group`` (param_groups.py), their state consolidated and re-sliced (optimizer_state.py), the user's
object routed while the engine manages it (optimizer_routes.py), the loss scaler, publishing updated masters into
the module (publish.py), and the compressed 1-bit optimizers (onebit/).

May import: ``comm``, ``layout``, ``placement``, ``grads``, the plan. Not ``stage3``: a stage-3 source of masters is
handed in.
"""
