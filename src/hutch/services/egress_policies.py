"""Named egress policies, reusable per project (``/v1/egress-policies``).

A named policy is a policy document (:mod:`hutch.contract.egress_policy`) stored under
a name in a project. It is validated as a sandbox's policy is (and must be one this
daemon enforces), stored in canonical form, and *copied* into a sandbox when attached
(``egress_policy`` at create, ``{"policy": name}`` on PUT …/egress): editing or deleting
the named policy later changes no sandbox, so a sandbox's rules only change when its own
egress is set. The project is a service argument ('default' until projects exist).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hutch.contract.egress_policy_parse import parse_policy_document
from hutch.contract.names import NAME_RE
from hutch.errors import InvalidArgument, NotFound
from hutch.net.rules import EgressPolicy, lower_policy
from hutch.store.db import Store
from hutch.store.egress_policies import EgressPolicyRow, EgressPolicyStore

__all__ = ["DEFAULT_PROJECT", "EgressPolicyService", "NamedPolicyView"]

#: The project of every call until projects exist (the platform-auth branch adds them).
DEFAULT_PROJECT = "default"


@dataclass(frozen=True)
class NamedPolicyView:
    name: str
    project: str
    policy: dict[str, Any]
    created_at: float
    updated_at: float

    @classmethod
    def of(cls, row: EgressPolicyRow) -> NamedPolicyView:
        return cls(row.name, row.project, row.policy, row.created_at, row.updated_at)


def _check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise InvalidArgument(
            f"egress policy name {name!r} is invalid: 1-63 lower-case letters, digits and "
            "'-', starting and ending with a letter or digit"
        )


class EgressPolicyService:
    def __init__(self, store: Store) -> None:
        self.db = EgressPolicyStore(store)

    def put(
        self, name: str, document: object, project: str = DEFAULT_PROJECT
    ) -> tuple[NamedPolicyView, bool]:
        """Create or replace ``name``; returns it and whether it was created. Raises
        InvalidArgument naming the bad field (nothing is stored then)."""
        _check_name(name)
        policy = parse_policy_document(document)
        lower_policy(policy)  # refuse now what no sandbox could be given
        row, created = self.db.put(project, name, policy.document())
        return NamedPolicyView.of(row), created

    def get(self, name: str, project: str = DEFAULT_PROJECT) -> NamedPolicyView:
        row = self.db.get(project, name)
        if row is None:
            raise NotFound(
                f"egress policy {name!r} does not exist in project {project!r}; "
                "create it with PUT /v1/egress-policies/{name}"
            )
        return NamedPolicyView.of(row)

    def list(self, project: str = DEFAULT_PROJECT) -> list[NamedPolicyView]:
        return [NamedPolicyView.of(r) for r in self.db.list(project)]

    def delete(self, name: str, project: str = DEFAULT_PROJECT) -> None:
        """Sandboxes that got a copy keep it."""
        if not self.db.delete(project, name):
            self.get(name, project)  # raises NotFound

    def resolve(self, name: str, project: str = DEFAULT_PROJECT) -> EgressPolicy:
        """The enforcement form of the named policy (a copy for one sandbox)."""
        return lower_policy(parse_policy_document(self.get(name, project).policy))
