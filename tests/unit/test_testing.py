"""``hutch.testing``: the public home of the in-memory fake, and its old address."""

from __future__ import annotations

import importlib
import sys

import httpx
import pytest

import hutch.testing
from hutch.contract.http_errors import status_for
from hutch.errors import ALL_ERRORS, HutchError
from hutch.testing import FakeHutch


def test_hutch_sdk_testing_is_a_deprecated_alias_of_the_same_objects() -> None:
    sys.modules.pop("hutch.sdk.testing", None)
    with pytest.warns(DeprecationWarning, match="moved to hutch.testing"):
        old = importlib.import_module("hutch.sdk.testing")
    for name in hutch.testing.__all__:
        assert getattr(old, name) is getattr(hutch.testing, name), name


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_the_fake_answers_a_real_error_with_the_daemons_status_and_code(
    cls: type[HutchError], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeHutch()
    exc = cls.__new__(cls)
    HutchError.__init__(exc, "boom")

    def fail(request: httpx.Request) -> httpx.Response:
        raise exc

    monkeypatch.setattr(fake, "_route", fail)
    with httpx.Client(transport=fake.transport) as http:
        r = http.get("http://fake/v1/images")
    assert r.status_code == status_for(exc)
    assert r.json() == {"error": {"code": cls.code, "message": "boom"}}
