"""Errors an operation reports to the host, and the errno mapping."""

from __future__ import annotations

import errno


class AgentError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EEXIST: "exists",
    errno.ENOTDIR: "not_a_directory",
    errno.EISDIR: "is_a_directory",
    errno.ENOTEMPTY: "not_empty",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EINVAL: "invalid_argument",
    errno.ENAMETOOLONG: "invalid_argument",
    errno.ELOOP: "invalid_argument",
}


def os_error(exc: OSError) -> AgentError:
    where = f": {exc.filename!r}" if exc.filename else ""
    return AgentError(ERRNO_CODES.get(exc.errno or 0, "io_error"), f"{exc.strerror}{where}")
