"""The role table: each role can do what the one below it can, and the read-only roles
cannot change anything."""

from __future__ import annotations

import itertools

from hutch.contract.auth import ROLE_PERMISSIONS, Permission, Principal, Role, allows

LADDER = [Role.VIEWER, Role.OPERATOR, Role.DEVELOPER, Role.OWNER, Role.ADMIN]


def test_each_role_can_do_what_the_one_below_can() -> None:
    for lower, higher in itertools.pairwise(LADDER):
        assert ROLE_PERMISSIONS[lower] < ROLE_PERMISSIONS[higher], (lower, higher)


def test_viewer_only_reads() -> None:
    assert all(p.value.endswith(".read") for p in ROLE_PERMISSIONS[Role.VIEWER])


def test_operator_uses_but_neither_creates_nor_deletes() -> None:
    assert allows(Role.OPERATOR, Permission.SANDBOX_USE)
    assert allows(Role.OPERATOR, Permission.SANDBOX_LIFECYCLE)
    for denied in (Permission.SANDBOX_CREATE, Permission.SANDBOX_DELETE, Permission.SANDBOX_FORK):
        assert not allows(Role.OPERATOR, denied)


def test_only_owner_and_admin_manage_keys_and_only_admin_projects() -> None:
    assert {r for r in Role if allows(r, Permission.KEY_MANAGE)} == {Role.OWNER, Role.ADMIN}
    assert {r for r in Role if allows(r, Permission.PROJECT_MANAGE)} == {Role.ADMIN}


def test_admin_principal() -> None:
    p = Principal.admin()
    assert (p.key_id, p.project, p.role) == ("admin", "default", Role.ADMIN)
    assert p.may(Permission.PROJECT_MANAGE)
