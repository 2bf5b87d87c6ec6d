"""Templates of a built-in image taken out of use before its bytes are replaced
(``QemuTemplates.retire``: services/builtin_blobs.py adopts the blob store's copy): only
that image at that digest, never a build under way; a retire a crash cut short (the
aside left) is removed at the next start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

from hutch.config import Settings
from hutch.runtime.qemu.boot import Booter
from hutch.runtime.qemu.host import HostLayout
from hutch.runtime.qemu.templates import QemuTemplates

D1, D2 = "0123456789abcdef", "fedcba9876543210"


def test_only_that_image_and_digest_is_retired_and_a_cut_retire_is_cleaned(
    tmp_path: Path,
) -> None:
    layout = HostLayout(Settings(state_dir=tmp_path / "state"))
    cgroups = SimpleNamespace(reclaim=lambda _which: None)
    templates = QemuTemplates(layout, cast(Booter, SimpleNamespace(cgroups=cgroups)))
    root = layout.templates_root
    names = [
        f"base-{D1}-1c-128m-1g-n1",
        f"base-{D1}-2c-256m-1g-n1",
        f"base-{D1}-1c-512m-1g-n1.build",  # a build under way: its own lock keeps it
        f"base-{D2}-1c-128m-1g-n1",
        f"devbox-{D1}-1c-128m-1g-n1",
    ]
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "vm.json").write_text("{}")
    assert templates.retire("base", D1) == names[:2]
    assert sorted(p.name for p in root.iterdir()) == sorted(names[2:])

    (root / f".base-{D1}-1c-128m-1g-n1.retired").mkdir()  # a crash mid-retire
    templates.discard_unfinished()  # the next start (a build it cut short goes too)
    assert sorted(p.name for p in root.iterdir()) == sorted(names[3:])
