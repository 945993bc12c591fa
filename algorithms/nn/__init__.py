"""Networks every learner builds on, the hand-written CPU kernels under them, and the action
distributions with the map between an env's action bounds and ``[-1, 1]^d``."""
