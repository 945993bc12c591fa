"""Dask clusters on SLURM (dask-jobqueue) and Kubernetes (dask-kubernetes' operator).

``cluster.kind: slurm`` or ``kubernetes`` in a workflow builds the cluster here; ``cluster.job``
passes keyword arguments through (SLURM: ``queue``, ``account``, ``walltime``, ``memory``,
``job_extra_directives``, ...; Kubernetes: ``image`` (one with offaug installed), ``namespace``,
``resources``, ``env``). :func:`slurm_job_script` and :func:`kubernetes_spec` show what would be
submitted without submitting anything.
"""

from __future__ import annotations

from typing import Any

from offaug.pipeline.workflow import ClusterModel

DEFAULT_IMAGE = "ghcr.io/dask/dask:latest"


def _slurm_kwargs(config: ClusterModel) -> dict[str, Any]:
    job = dict(config.job)
    kwargs: dict[str, Any] = {
        "cores": config.threads_per_worker,
        "processes": 1,
        "memory": job.pop(
            "memory", "4GB" if config.memory_limit == "auto" else config.memory_limit
        ),
        # Workers pin torch and BLAS to their cores (offaug's worker plugin does too).
        "job_script_prologue": [f"export OMP_NUM_THREADS={config.threads_per_worker}"],
    }
    kwargs.update(job)
    return kwargs


def slurm_job_script(config: ClusterModel) -> str:
    """The ``sbatch`` script one worker job would run."""
    from dask_jobqueue.slurm import SLURMCluster

    cluster = SLURMCluster(**_slurm_kwargs(config))
    try:
        return str(cluster.job_script())
    finally:
        cluster.close()


def kubernetes_spec(config: ClusterModel) -> dict[str, Any]:
    """The ``DaskCluster`` custom resource the operator would be given."""
    from dask_kubernetes.operator import make_cluster_spec

    job = dict(config.job)
    resources = job.pop("resources", {"limits": {"cpu": str(config.threads_per_worker)}})
    spec: dict[str, Any] = make_cluster_spec(
        name=job.pop("name", "offaug"),
        image=job.pop("image", DEFAULT_IMAGE),
        n_workers=config.workers or 2,
        resources=resources,
        env={"OMP_NUM_THREADS": str(config.threads_per_worker), **job.pop("env", {})},
        worker_command=f"dask-worker --nthreads {config.threads_per_worker}",
    )
    return spec


def build_cluster(config: ClusterModel) -> Any:
    """Start the cluster and scale it to ``config.workers`` (default 2) workers."""
    workers = config.workers or 2
    if config.kind == "slurm":
        from dask_jobqueue.slurm import SLURMCluster

        cluster = SLURMCluster(**_slurm_kwargs(config))
        cluster.scale(jobs=workers)
        return cluster
    if config.kind == "kubernetes":
        from dask_kubernetes.operator import KubeCluster

        return KubeCluster(
            custom_cluster_spec=kubernetes_spec(config), namespace=config.job.get("namespace")
        )
    raise ValueError(f"cluster.kind {config.kind!r} is not built here")
