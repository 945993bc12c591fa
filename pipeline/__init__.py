"""Pipeline stages and the Dask graph that runs them: rollouts, training, diagnostics, reports."""
