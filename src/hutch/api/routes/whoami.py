"""``GET /v1/whoami``: who the request's key is (key id, project, role) and what that role
may do, so a client (the web console) can show only what the caller may do. The API
still checks every request itself; this answer is a courtesy, never the guard.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from pydantic import BaseModel, Field

from hutch.contract.auth import DEFAULT_PROJECT, ROLE_PERMISSIONS, Principal, Role
from hutch.contract.names import NAME_RE
from hutch.errors import InvalidArgument

__all__ = ["Whoami", "router"]

router = APIRouter(prefix="/v1", tags=["meta"])


class Whoami(BaseModel):
    key_id: str = Field(description="The key's id (`admin` for the instance key).")
    project: str = Field(description="The project this request acts in.")
    role: Role
    permissions: list[str] = Field(
        description="Every permission the role has, sorted (see contract/auth.py)."
    )


def principal_of(hutch_project: str | None) -> Principal:
    """The caller, until the auth layer's principal dependency lands on main: the one
    instance key is the admin, acting in ``Hutch-Project`` or ``default``."""
    if hutch_project is None:
        return Principal.admin(DEFAULT_PROJECT)
    if not NAME_RE.match(hutch_project):
        raise InvalidArgument(
            f"Hutch-Project={hutch_project!r} is not a project name; use 1-63 lowercase "
            "letters, digits and '-', starting and ending with a letter or digit"
        )
    return Principal.admin(hutch_project)


@router.get("/whoami", response_model=Whoami)
async def whoami(
    hutch_project: Annotated[str | None, Header(alias="Hutch-Project")] = None,
) -> Whoami:
    who = principal_of(hutch_project)
    return Whoami(
        key_id=who.key_id,
        project=who.project,
        role=who.role,
        permissions=sorted(ROLE_PERMISSIONS[who.role]),
    )
