"""``GET /v1/whoami``: who the request's key is (key id, project, role) and what that role
may do, so a client (the web console) can show only what the caller may do. The API
still checks every request itself; this answer is a courtesy, never the guard.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from hutch.api.deps import Caller
from hutch.contract.auth import ROLE_PERMISSIONS, Role

__all__ = ["Whoami", "router"]

router = APIRouter(prefix="/v1", tags=["meta"])


class Whoami(BaseModel):
    key_id: str = Field(description="The key's id (`admin` for the instance key).")
    project: str = Field(
        description="The project this request acts in (an admin key: `Hutch-Project` or "
        "`default`; a project key: its own)."
    )
    role: Role
    permissions: list[str] = Field(
        description="Every permission the role has, sorted (see contract/auth.py)."
    )


@router.get("/whoami", response_model=Whoami)
async def whoami(who: Caller) -> Whoami:
    return Whoami(
        key_id=who.key_id,
        project=who.project,
        role=who.role,
        permissions=sorted(ROLE_PERMISSIONS[who.role]),
    )
