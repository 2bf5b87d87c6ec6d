"""Three hutchd workers on this machine sharing one database and one S3 bucket: the
shared cluster fixture of this package (``cluster``, package-scoped: one cluster for
every file here, as one module had it before the split). Every sandbox is 128 MiB and
restored from each worker's template of the base image.

The workers share one PostgreSQL database of the suite's server (``tests/pgserver.py``,
Debian's PostgreSQL) and one SeaweedFS (``tests/s3server.py``) as their blob store, as
hosts on many machines would.

The files run in the order of their names and that order matters: the cluster is
shared, and a later file counts on what an earlier one left (the twenty-create test
keeps one sandbox per worker; the killed worker comes back before the E2B tests)::

    test_1_placement.py    hosts listed everywhere, spread, pinning, routing
    test_2_networks.py     private networks across hosts
    test_3_moves.py        fork children, named snapshots, pause/resume, drain, a kill
    test_4_e2b_labels.py   the E2B face through any worker, placement labels kept
    test_5_images.py       an imported image fetched from the bucket by another worker
    test_6_volumes.py      a volume's sandboxes and calls go to the worker holding it
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hutch.images.build import ImageArtifacts
from tests.e2e.cluster_lab import Worker, cluster_of
from tests.s3server import S3Server, running_s3

LABELS = {"w1": "zone=a", "w2": "zone=a", "w3": "zone=b"}


@pytest.fixture(scope="package")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the package (the cluster outlives a module)."""
    with running_s3(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="package")
def cluster(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
) -> Iterator[list[Worker]]:
    with cluster_of(
        tmp_path_factory.mktemp("cluster"),
        ("w1", "w2", "w3"),
        labels=LABELS,
        s3=s3_server,
        tunnel=True,
        e2b=True,
        # The workers share one images directory: their built-in images are one build,
        # nothing to converge (tests/e2e/test_builtin_images_cluster.py runs that).
        extra_env={"HUTCH_BLOB_BUILTIN_IMAGES": "0"},
    ) as workers:
        yield workers
