"""The pipeline: stages from a dataset to a verdict, and the Dask engine that runs them.

Sub-packages, from the bottom up (each imports only those before it, and
:mod:`offaug.pipeline.contracts`, the references stages pass each other):

==============  =====================================================================
``rollouts``    noise, behaviour densities, rollout policies, the simulator loop,
                learned dynamics, rollouts as tasks and shard sets
``schema``      the workflow file: sections, recipes, validation, the ranking metric
``rundir``      the run directory: its layout, records, lock and stage keys
``media``       filming episodes: frames and encoded videos
``diagnostics`` distribution-shift diagnostics of data and policies
``outcome``     metrics.json, the verdict over seeds, rliable statistics, human review
``report``      the self-contained HTML report
``stages``      every stage as a plain function (no Dask)
``engine``      the plan of a workflow's stages and the Dask code that runs it
==============  =====================================================================
"""
