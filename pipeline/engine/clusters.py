"""The Dask cluster offaug runs on: local, an existing scheduler, SLURM or Kubernetes.

:func:`connect` gives the client (and the cluster it started, if any), its workers set up by
:func:`prepare_workers`; :func:`connected` is the same as a context manager that closes both. A
workflow run and ``offaug rank`` both get their cluster here. SLURM
clusters are built with dask-jobqueue, Kubernetes ones with dask-kubernetes' operator; both are
optional dependencies (the ``cluster`` extra), so they are imported where they are used.
``cluster.job`` passes keyword arguments through (SLURM: ``queue``, ``account``, ``walltime``,
``memory``, ``job_extra_directives``, ...; Kubernetes: ``image`` (one with offaug installed),
``namespace``, ``resources``, ``env``). :func:`slurm_job_script` and :func:`kubernetes_spec`
show what would be submitted without submitting anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from distributed import Client, LocalCluster

from offaug.pipeline.engine.workers import WorkerSetup
from offaug.pipeline.schema.run_sections import ClusterModel

DEFAULT_IMAGE = "ghcr.io/dask/dask:latest"


def connect(config: ClusterModel, scheduler: str | None = None) -> tuple[Client, Any]:
    """A Dask client and the cluster started for it (``None`` when it joined a scheduler).

    ``scheduler`` or ``config.address`` if given, a SLURM or Kubernetes cluster for those
    kinds, else a LocalCluster of ``config.workers`` processes (one per core by default) with
    its dashboard on a free port. Its workers are set up by :func:`prepare_workers`.
    """
    client, cluster = _start(config, scheduler)
    prepare_workers(client, config.threads_per_worker)
    return client, cluster


@contextlib.contextmanager
def connected(config: ClusterModel, scheduler: str | None = None) -> Iterator[Client]:
    """:func:`connect`'s client; on leaving, it closes and so does any cluster it started."""
    client, cluster = connect(config, scheduler)
    try:
        yield client
    finally:
        disconnect(client, cluster)


def disconnect(client: Client, cluster: Any) -> None:
    """Close the client, then the cluster it started (``None``: it joined one, left running).

    A worker process that imported torch and the data stack takes a second or more to tear its
    interpreter down (torch's exit handlers, module cleanup), several on a loaded machine, while
    a nanny waits 4 s for it before it kills the process and logs a warning. Every task has
    finished and written its results by then, so the kill loses nothing: the nanny's warnings
    are kept off the user's console while the cluster closes.
    """
    client.close()
    if cluster is None:
        return
    nanny = logging.getLogger("distributed.nanny")
    level = nanny.level
    nanny.setLevel(logging.ERROR)
    try:
        cluster.close()
    finally:
        nanny.setLevel(level)


def prepare_workers(client: Client, threads: int) -> None:
    """Set every worker up for offaug's tasks
    (:class:`~offaug.pipeline.engine.workers.WorkerSetup`):
    torch and BLAS pinned to ``threads`` threads, torch imported in the background."""
    client.register_plugin(WorkerSetup(threads))


def _start(config: ClusterModel, scheduler: str | None) -> tuple[Client, Any]:
    address = scheduler or (config.address if config.kind == "address" else None)
    if address:
        return Client(address, timeout="30s"), None
    if config.kind in ("slurm", "kubernetes"):
        cluster = build_cluster(config)
        return Client(cluster), cluster
    local = LocalCluster(
        n_workers=config.workers or os.cpu_count() or 1,
        threads_per_worker=config.threads_per_worker,
        processes=True,
        memory_limit=config.memory_limit,
        dashboard_address=":0",
    )
    return Client(local), local


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
