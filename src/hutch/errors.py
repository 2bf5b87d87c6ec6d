"""The one error hierarchy of hutch.

Every error hutch raises on purpose derives from :class:`HutchError`. Callers catch by
what they can do about it::

    HutchError
    ├── InvalidArgument      bad input; change the request          (400 invalid_argument)
    │   ├── UnknownImage     no such image                          (400 unknown_image)
    │   ├── InvalidImage     an OCI image or archive is unusable    (400 invalid_image)
    │   ├── InvalidDockerfile  a Dockerfile hutch cannot build (names the line)
    │   │                                                           (400 invalid_dockerfile)
    │   └── BuildFailed      a build step (RUN, COPY) failed: its output and exit
    │                                                               (422 build_failed)
    ├── Unauthorized         missing, wrong, revoked or expired key (401 unauthorized)
    ├── Forbidden            the key's role lacks the permission    (403 forbidden)
    ├── NotFound             no such sandbox, file, ...             (404 not_found)
    ├── Conflict             the resource is in the wrong state     (409 conflict)
    │   ├── StateError       ... with the state it is in and the states required
    │   ├── Busy             calls in flight kept a pause/snapshot/fork waiting (409 busy)
    │   ├── ImageMissing     an image's content is on no host: not here and not in
    │   │                    the blob store (or its upload is not complete) (409 image_missing)
    │   └── ImageMismatch    a frozen state (pause, snapshot, fork) was taken over other
    │                        bytes of its image than this host holds       (409 image_mismatch)
    ├── Capacity             the host is full                       (429/507 capacity)
    │   └── QuotaExceeded    a project's quota would be exceeded    (429 quota_exceeded)
    ├── Unavailable          not ready yet; retry after a moment    (503 unavailable)
    ├── Timeout              an operation ran out of time           (504 timeout)
    ├── VmError              QEMU failed (carries argv and stderr)  (500 vm_error)
    ├── GuestError           the guest agent failed or refused      (502 guest_error)
    │   └── AgentVersionMismatch                                    (502 agent_version)
    ├── ImageBuildError      an image cannot be built               (500 image_build)
    ├── RegistryError        a registry failed or cannot be reached (502 registry_error)
    ├── NetworkError         taps, nftables, DNS                    (500 network_error)
    ├── SnapshotError        snapshot files missing or corrupt      (500 snapshot_error)
    │   └── BlobError        the blob store (a directory, S3) failed, or a blob is
    │                        missing, truncated or corrupt          (500 blob_error)
    ├── SecretError          the secrets key file is missing or wrong, or a stored
    │                        secret fails authentication            (500 secret_error)
    └── StoreError           the database failed                    (500 store_error)

The REST layer maps each class to a status and a stable ``code`` in one table
(``hutch.contract.http_errors``); the SDK maps the codes back to these classes with it.
"""

from __future__ import annotations

from collections.abc import Iterable


class HutchError(Exception):
    """Root of every error hutch raises on purpose."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(HutchError):
    code = "invalid_argument"


class UnknownImage(InvalidArgument):
    code = "unknown_image"


class InvalidImage(InvalidArgument):
    """An OCI image, archive or layer that hutch refuses: a digest that does not match,
    another architecture, a path escaping the root, a truncated archive, ..."""

    code = "invalid_image"


class InvalidDockerfile(InvalidArgument):
    """A Dockerfile that hutch refuses before building anything: a syntax error, an
    unsupported instruction or flag, a COPY source that is not in the context, ...; the
    message names the line."""

    code = "invalid_dockerfile"


class BuildFailed(InvalidArgument):
    """A build step ran and failed (a RUN exited non-zero, a COPY could not be written
    in the guest); the message carries the step, the exit code and the output's tail.
    Nothing was built (the steps before it stay cached)."""

    code = "build_failed"

    def __init__(
        self, message: str, *, step: int | None = None, exit_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.step = step
        self.exit_code = exit_code


class Unauthorized(HutchError):
    code = "unauthorized"


class Forbidden(HutchError):
    """The key is valid but its role may not do this; the message names the role and
    the permission. A resource of another project is NotFound, never Forbidden."""

    code = "forbidden"


class NotFound(HutchError):
    code = "not_found"


class Conflict(HutchError):
    code = "conflict"


class ImageMissing(Conflict):
    """An image is recorded (its name and digest) but its content is neither on this
    host nor (completely uploaded) in the blob store: import it again, or wait for the
    upload from the host that imported it."""

    code = "image_missing"


class ImageMismatch(Conflict):
    """A frozen VM state (a pause, a named snapshot, a fork's parent) fetched from the
    blob store was taken over other bytes of its image (its ``rootfs.ext4``, or the
    agent runtime disk) than this host holds under the same name: opened here its disk
    would be silently corrupt, so it is refused and nothing is changed. The message
    names the image, both identities' prefixes and what to do (the same image bytes on
    every host: import it from the blob store)."""

    code = "image_mismatch"


class StateError(Conflict):
    """An operation needs the resource in another state."""

    code = "invalid_state"

    def __init__(self, what: str, state: str, required: Iterable[str], hint: str = "") -> None:
        self.state = state
        self.required = tuple(required)
        message = f"{what} is {state}; this needs it to be {' or '.join(self.required)}"
        super().__init__(f"{message} ({hint})" if hint else message)


class Busy(Conflict):
    """A pause, snapshot or fork waited its bound for calls in flight in the sandbox
    (execs, transfers, code runs) and they still run; the message names them."""

    code = "busy"


class Capacity(HutchError):
    code = "capacity"


class QuotaExceeded(Capacity):
    """A project's quota would be exceeded; the message names the quota, the use and
    the limit."""

    code = "quota_exceeded"


class Unavailable(HutchError):
    """Not ready yet (a sandbox still being checked after a daemon restart); the same
    request succeeds after ``retry_after_s`` seconds or so (HTTP ``Retry-After``)."""

    code = "unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Timeout(HutchError):
    code = "timeout"


class VmError(HutchError):
    """QEMU failed. Carries the command line and stderr when QEMU would not start."""

    code = "vm_error"

    def __init__(self, message: str, argv: list[str] | None = None, stderr: str = "") -> None:
        self.argv = list(argv or [])
        self.stderr = stderr
        detail = message
        if argv:
            detail += "\ncommand: " + " ".join(self.argv)
        if stderr:
            detail += "\nstderr:\n" + stderr.strip()
        super().__init__(detail)


class GuestError(HutchError):
    code = "guest_error"


class AgentVersionMismatch(GuestError):
    code = "agent_version"


class ImageBuildError(HutchError):
    code = "image_build"


class RegistryError(HutchError):
    """A registry answered with an error hutch cannot act on, or cannot be reached."""

    code = "registry_error"


class NetworkError(HutchError):
    code = "network_error"


class SnapshotError(HutchError):
    code = "snapshot_error"


class BlobError(SnapshotError):
    """The blob store (``HUTCH_BLOB_URL``: a directory or an S3 bucket) cannot be
    reached or refused a call, or a blob is missing, truncated or fails its checksum.
    The message names the blob (its key and URL) and the cause; nothing corrupt is ever
    handed on."""

    code = "blob_error"


class SecretError(HutchError):
    """A stored secret cannot be decrypted: the key file ``<state>/secrets.key`` is
    missing, unreadable, too open or another key than the one the secret was sealed
    with, or the stored ciphertext fails authentication (altered or swapped rows). The
    message names the file or the secret and what to do; it never carries a value."""

    code = "secret_error"


class StoreError(HutchError):
    code = "store_error"


ALL_ERRORS: tuple[type[HutchError], ...] = (
    HutchError,
    InvalidArgument,
    UnknownImage,
    InvalidImage,
    InvalidDockerfile,
    BuildFailed,
    Unauthorized,
    Forbidden,
    NotFound,
    Conflict,
    StateError,
    Busy,
    ImageMissing,
    ImageMismatch,
    Capacity,
    QuotaExceeded,
    Unavailable,
    Timeout,
    VmError,
    GuestError,
    AgentVersionMismatch,
    ImageBuildError,
    RegistryError,
    NetworkError,
    SnapshotError,
    BlobError,
    SecretError,
    StoreError,
)
