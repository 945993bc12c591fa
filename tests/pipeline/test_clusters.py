"""The local cluster's life cycle; SLURM and Kubernetes clusters, tested as far as the
generated job script and spec."""

from __future__ import annotations

import logging

from offaug.pipeline.engine.clusters import (
    connect,
    disconnect,
    kubernetes_spec,
    slurm_job_script,
)
from offaug.pipeline.schema.run_sections import ClusterModel


def test_disconnect_closes_the_local_cluster_and_restores_the_nanny_log_level() -> None:
    nanny = logging.getLogger("distributed.nanny")
    before = nanny.level
    client, cluster = connect(ClusterModel(workers=1))
    assert client.submit(sum, [1, 2]).result() == 3
    disconnect(client, cluster)
    assert client.status == "closed" and cluster.status.name == "closed"
    assert nanny.level == before


def test_slurm_job_script_carries_the_workflow_settings() -> None:
    config = ClusterModel(
        kind="slurm",
        workers=4,
        threads_per_worker=2,
        job={
            "queue": "gpu",
            "walltime": "02:00:00",
            "memory": "8GB",
            "scheduler_options": {"host": "127.0.0.1"},
            "job_extra_directives": ["--gres=gpu:1"],
        },
    )
    script = slurm_job_script(config)
    assert "#SBATCH -p gpu" in script
    assert "#SBATCH -t 02:00:00" in script
    assert "#SBATCH --cpus-per-task=2" in script
    assert "#SBATCH --gres=gpu:1" in script
    assert "export OMP_NUM_THREADS=2" in script
    assert "--nthreads 2" in script and "tcp://127.0.0.1:" in script


def test_kubernetes_spec_has_image_replicas_and_threads() -> None:
    config = ClusterModel(
        kind="kubernetes", workers=3, job={"image": "example/offaug:1", "name": "aug"}
    )
    spec = kubernetes_spec(config)
    assert spec["kind"] == "DaskCluster" and spec["metadata"]["name"] == "aug"
    worker = spec["spec"]["worker"]
    assert worker["replicas"] == 3
    container = worker["spec"]["containers"][0]
    assert container["image"] == "example/offaug:1"
    assert "--nthreads" in container["args"] and "1" in container["args"]
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]
