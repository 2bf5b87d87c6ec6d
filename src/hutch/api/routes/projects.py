"""Projects (admin) and their keys (the project's owner, or admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from hutch.api.deps import Caller, projects
from hutch.api.project_schemas import (
    CreatedKey,
    CreateKey,
    CreateProject,
    Key,
    KeyList,
    Project,
    ProjectList,
    UpdateProject,
)
from hutch.contract.auth import Role
from hutch.services.projects import ProjectService

router = APIRouter(prefix="/v1/projects", tags=["projects"])
Service = Annotated[ProjectService, Depends(projects)]


def _view(svc: ProjectService, name: str) -> Project:
    return Project.of(svc.get(name), svc.use(name))


@router.post("", status_code=201, response_model=Project)
async def create_project(body: CreateProject, svc: Service) -> Project:
    """A new project (admin key). 409 if the name is taken."""
    quotas = body.quotas.model_dump() if body.quotas else None
    return _view(svc, svc.create(body.name, quotas).name)


@router.get("", response_model=ProjectList)
async def list_projects(svc: Service, who: Caller) -> ProjectList:
    """Every project for the admin key; a project key sees its own."""
    names = [p.name for p in svc.all()] if who.role is Role.ADMIN else [who.project]
    return ProjectList(projects=[_view(svc, n) for n in names])


@router.get("/{project}", response_model=Project)
async def get_project(project: str, svc: Service) -> Project:
    return _view(svc, project)


@router.patch("/{project}", response_model=Project)
async def update_project(project: str, body: UpdateProject, svc: Service) -> Project:
    """Change the quotas named in the body (admin key); null lifts a quota."""
    svc.set_quotas(project, body.quotas.model_dump(exclude_unset=True))
    return _view(svc, project)


@router.delete("/{project}", status_code=204, response_class=Response)
async def delete_project(project: str, svc: Service) -> Response:
    """Refused (409, naming what it holds) while it holds sandboxes, snapshots, networks,
    images or unrevoked keys; `default` cannot be deleted."""
    svc.delete(project)
    return Response(status_code=204)


@router.post("/{project}/keys", status_code=201, response_model=CreatedKey)
async def create_key(project: str, body: CreateKey, svc: Service, who: Caller) -> CreatedKey:
    """A new key of the project; its `secret` is in this answer only."""
    created = svc.create_key(
        project,
        body.name,
        body.role,
        expires_at=body.expires_at.timestamp() if body.expires_at else None,
        ttl_s=body.ttl_s,
        created_by=who.key_id,
    )
    return CreatedKey(**Key.of(created.row).model_dump(), secret=created.secret)


@router.get("/{project}/keys", response_model=KeyList)
async def list_keys(project: str, svc: Service) -> KeyList:
    return KeyList(keys=[Key.of(k) for k in svc.keys(project)])


@router.delete("/{project}/keys/{key_id}", response_model=Key)
async def revoke_key(project: str, key_id: str, svc: Service) -> Key:
    """Revoke the key: refused from its next request on."""
    return Key.of(svc.revoke_key(project, key_id))
