"""REST API /v1: a thin adapter over the services."""

from hutch.api.app import create_app

__all__ = ["create_app"]
