from __future__ import annotations

import pytest

from hutch.errors import InvalidArgument
from hutch.models import SANDBOX_ID_RE, SandboxSpec, Shape, new_sandbox_id


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"vcpus": 0}, "vcpus=0 is out of range; accepted: 1-8"),
        ({"vcpus": 9}, "accepted: 1-8"),
        ({"memory_mib": 64}, "accepted: 128-16384 MiB"),
        ({"memory_mib": 16385}, "accepted: 128-16384 MiB"),
        ({"disk_gib": 61}, "accepted: 1-60 GiB"),
        ({"vcpus": True}, "vcpus=True"),
    ],
)
def test_shape_out_of_range(kw: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Shape(**kw)


def test_spec_validation() -> None:
    with pytest.raises(InvalidArgument, match="name="):
        SandboxSpec(image="base", name="Bad_Name")
    with pytest.raises(InvalidArgument, match="env name"):
        SandboxSpec(image="base", env={"1X": "y"})
    with pytest.raises(InvalidArgument, match="timeout_s"):
        SandboxSpec(image="base", timeout_s=0)
    SandboxSpec(image="base", name="web-1", env={"A_B": "c"}, timeout_s=5)


def test_ids() -> None:
    assert SANDBOX_ID_RE.match(new_sandbox_id())
    assert new_sandbox_id() != new_sandbox_id()
