"""Where creates and the warm pool get the template of an (image, shape)
(:class:`TemplateService`): this host's, else the blob store's (fetched, checked and
installed: ``services/template_blobs.py``), else none, and then one is made in the
background: fetched if it can be, else built by one cold boot, then uploaded.

```
create (no pool VM, no snapshot, no volumes) ─► for_create(image, shape)
   here (key matches)? ─► clone it
   a build of it under way here? ─► None: cold boot (waiting for a ~10 s build would
                                    be slower than booting)
   upload recorded in the database? ─► fetch (one per key; create waits) ─► clone it
   else / fetch failed (logged) ─► None: cold boot ─► schedule(image, shape)
schedule ─► background, one build at a time (boots compete for CPU), one per key:
   fetch again (another host's upload may have completed) ─► else build (cold boot,
   settle, freeze) ─► upload in the background ─► on_ready(image): the pool refills
warm pool refill ─► for_pool = for_create (a fetch, never a build)
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from hutch.images.build import ImageArtifacts
from hutch.models import Shape
from hutch.runtime.backend import Templates
from hutch.services.blob_cache import using_image
from hutch.services.template_blobs import TemplateBlobs

__all__ = ["TemplateService"]

log = logging.getLogger("hutch.services.sandboxes")

_Key = tuple[str, str, Shape]


class TemplateService:
    """See the module docstring. ``blobs``: the blob store side (disabled: each host
    builds its own); ``images_dir``: where imported content is held from the blob cache
    while a template is built on it."""

    def __init__(
        self,
        templates: Templates,
        blobs: TemplateBlobs,
        images_dir: Path,
        *,
        hold_builtin: bool = False,
    ) -> None:
        self.templates = templates
        self.blobs = blobs
        self.images_dir = images_dir
        #: Built-in images may be replaced by their upload here (``builtin_blobs``):
        #: a template made on one holds its directory from an adoption meanwhile.
        self.hold_builtin = hold_builtin
        #: Called once a template is ready here (built or fetched in the background).
        self.on_ready: Callable[[ImageArtifacts], None] = lambda _image: None
        # One build at a time: each boots a VM, and boots compete for CPU.
        self._gate = asyncio.Lock()
        self._tasks: dict[_Key, asyncio.Task[None]] = {}

    def start(self) -> None:
        """On the event loop: uploads a stopped daemon left continue (background)."""
        self.blobs.start()

    async def close(self) -> None:
        """Stop the builds and uploads under way."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.blobs.close()

    async def find(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        """This host's template (key checked; hashing image files once, off the loop)."""
        return await asyncio.to_thread(self.templates.find, image, shape)

    def building(self, image: ImageArtifacts, shape: Shape) -> bool:
        task = self._tasks.get((image.name, image.digest, shape))
        return task is not None and not task.done()

    async def for_create(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        """The template a create (or the warm pool) restores from: here, or fetched now
        from the blob store; None: cold-boot (and :meth:`schedule`)."""
        found = await self.find(image, shape)
        if found is not None or self.building(image, shape):
            return found
        return await self.blobs.fetch(image, shape)

    def schedule(self, image: ImageArtifacts, shape: Shape) -> None:
        """Make the template of (image, shape) in the background, once: fetched if the
        blob store has it, else built; uploaded after a build."""
        key = (image.name, image.digest, shape)
        if key in self._tasks:
            return

        async def make() -> None:
            async with self._gate:
                try:
                    # An imported image's content stays while its template is made
                    # (the blob cache; once made, the template keeps it), and a
                    # built-in one's bytes too (no adoption under the build).
                    with using_image(self.images_dir, image, builtin=self.hold_builtin):
                        where = await self.blobs.fetch(image, shape)
                        if where is None:
                            where = await self.templates.build(image, shape)
                            self.blobs.schedule(
                                await asyncio.to_thread(self.templates.describe, image, shape)
                            )
                    log.info("template ready for %s at %s: %s", image.name, shape, where)
                    self.on_ready(image)
                except Exception as exc:
                    log.warning(
                        "could not build the template for %s %s: %s", image.name, shape, exc
                    )
                    self._tasks.pop(key, None)

        self._tasks[key] = asyncio.create_task(make(), name=f"hutch-template-{key}")
