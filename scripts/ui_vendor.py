"""Copy the web console's npm dependencies from ``ui/node_modules`` (made by ``npm ci`` on
the committed ``ui/package-lock.json``) into ``src/hutch/ui/static/vendor`` and write
``manifest.json`` there: each copied file's package, version, source path and sha256.

Run by ``make ui-vendor``; the copies are committed, so the daemon never needs npm.
``--check`` compares the committed copies with a fresh ``npm ci`` instead of writing.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UI = REPO / "ui"
VENDOR = REPO / "src" / "hutch" / "ui" / "static" / "vendor"

#: destination (under vendor/) -> (package, path inside the package)
FILES: dict[str, tuple[str, str]] = {
    "xterm/xterm.mjs": ("@xterm/xterm", "lib/xterm.mjs"),
    "xterm/xterm.css": ("@xterm/xterm", "css/xterm.css"),
    "xterm/LICENSE.txt": ("@xterm/xterm", "LICENSE"),
    "xterm/addon-fit.mjs": ("@xterm/addon-fit", "lib/addon-fit.mjs"),
    "xterm/addon-fit.LICENSE.txt": ("@xterm/addon-fit", "LICENSE"),
}


def _strip_source_map(data: bytes) -> bytes:
    """The source maps are not shipped; drop the line pointing at them so a browser with
    its developer tools open does not ask for a file that is not there."""
    lines = data.split(b"\n")
    return b"\n".join(ln for ln in lines if not ln.startswith(b"//# sourceMappingURL="))


def build() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    manifest: dict[str, object] = {"generated_by": "make ui-vendor", "files": {}}
    files: dict[str, object] = {}
    for dest, (package, source) in FILES.items():
        root = UI / "node_modules" / package
        version = json.loads((root / "package.json").read_text())["version"]
        data = (root / source).read_bytes()
        if dest.endswith((".mjs", ".js")):
            data = _strip_source_map(data)
        out[dest] = data
        files[dest] = {
            "package": package,
            "version": version,
            "source": source,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    manifest["files"] = files
    out["manifest.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return out


def main(argv: list[str]) -> int:
    wanted = build()
    if "--check" in argv:
        stale = [
            n
            for n, d in wanted.items()
            if not (VENDOR / n).is_file() or (VENDOR / n).read_bytes() != d
        ]
        if stale:
            print(
                f"vendored console files differ from ui/node_modules: {stale}; "
                "run `make ui-vendor` and commit",
                file=sys.stderr,
            )
            return 1
        return 0
    for name, data in wanted.items():
        (VENDOR / name).parent.mkdir(parents=True, exist_ok=True)
        (VENDOR / name).write_bytes(data)
        print(f"vendored {name} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
