"""The only Dask code: a workflow planned as stages, the scheduler that submits them as their
inputs finish, clusters and worker set-up."""
