"""Pipeline stages and the Dask graph that runs them (see the pipeline issue)."""
