"""Running the host tools the builder needs, with errors that say what to install."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from hutch.errors import ImageBuildError

__all__ = ["TOOL_PACKAGES", "require_tools", "run"]

#: Host tool -> the Debian package that provides it (named in the error message).
TOOL_PACKAGES: dict[str, str] = {
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "lz4": "lz4",
    "busybox": "busybox-static",
    "dpkg-deb": "dpkg",
    "apt-get": "apt",
    "apt-cache": "apt",
    "depmod": "kmod",
}

_TAIL_CHARS = 3000


def require_tools(names: Sequence[str] = tuple(TOOL_PACKAGES)) -> dict[str, Path]:
    """Find every tool in ``names`` on PATH (also /usr/sbin, /sbin), or raise one error
    naming all missing tools and the apt packages that provide them."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    search = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    for name in names:
        path = shutil.which(name) or shutil.which(name, path=search)
        if path is None:
            missing.append(name)
        else:
            found[name] = Path(path)
    if missing:
        packages = sorted({TOOL_PACKAGES.get(m, m) for m in missing})
        raise ImageBuildError(
            f"image build needs {', '.join(missing)} on the host; install them with: "
            f"apt-get install {' '.join(packages)}"
        )
    return found


def run(
    argv: Sequence[str | Path],
    *,
    what: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Path | None = None,
    timeout: float | None = None,
) -> str:
    """Run ``argv``; return its stdout (unless sent to the file ``stdout``).

    Stderr goes to a temporary file (mmdebstrap can print megabytes) and its tail is in
    the ``ImageBuildError`` raised when the command fails, times out or cannot start.
    """
    args = [str(a) for a in argv]
    with tempfile.TemporaryFile() as err:
        try:
            if stdout is not None:
                with stdout.open("wb") as out:
                    proc = subprocess.run(
                        args,
                        stdout=out,
                        stderr=err,
                        cwd=cwd,
                        env=env,
                        timeout=timeout,
                        check=False,
                        stdin=subprocess.DEVNULL,
                    )
                output = ""
            else:
                proc = subprocess.run(
                    args,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    cwd=cwd,
                    env=env,
                    timeout=timeout,
                    check=False,
                    stdin=subprocess.DEVNULL,
                )
                output = proc.stdout.decode(errors="replace")
        except FileNotFoundError as exc:
            raise ImageBuildError(f"{what}: {args[0]} not found; is it installed?") from exc
        except subprocess.TimeoutExpired as exc:
            raise ImageBuildError(f"{what}: {' '.join(args)} ran past {timeout} s") from exc
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-_TAIL_CHARS:]
            if stdout is None and not tail.strip():
                tail = output[-_TAIL_CHARS:]
            raise ImageBuildError(
                f"{what} failed (exit {proc.returncode}): {' '.join(args)}\n"
                f"stderr tail:\n{tail.strip()}"
            )
    return output
