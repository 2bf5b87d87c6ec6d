"""Print the OpenAPI spec generated from the code (``make openapi`` commits it)."""

from __future__ import annotations

import json
from typing import Any, cast

from hutch.api.app import create_app
from hutch.services.composed import Services


def generate() -> dict[str, Any]:
    # The spec depends only on the routes; no service is started to produce it.
    app = create_app(cast(Services, None), api_key="unused", manage_service=False)
    return app.openapi()


def main() -> None:
    print(json.dumps(generate(), indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
