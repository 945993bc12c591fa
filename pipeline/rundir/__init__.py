"""The run directory: where each stage's outputs live, the stage records read and written there,
the lock of a run in progress, and the keys that say whether a stage is still valid."""
