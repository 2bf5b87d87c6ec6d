"""The code-interpreter kernel: one long-lived ``python3 -I kernel.py`` per context.

Standalone on purpose (run as a script, imports nothing from the agent): the agent
starts it as ``kernel.py REQUESTS_FD MESSAGES_FD``, two pipes of JSON lines, while
fd 1 and 2 are pipes the agent forwards as stdout and stderr (so output of C code and
child processes is caught too).

Request ``{"id": n, "code": str}``. Messages, each with the request's ``id``::

    {"type": "display", "data": {mime: value}}    display(), plt.show(), open figures
    {"type": "result", "data": {mime: value}}     the value of the last expression
    {"type": "error", "ename", "evalue", "traceback": [str]}
    {"type": "done"}                              stdout/stderr are flushed before this

Binary mime values (image/png, image/jpeg) are base64. SIGINT raises KeyboardInterrupt
only while code runs; between runs it is ignored, so a late interrupt cannot kill the
kernel.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import linecache
import os
import signal
import sys
import traceback
import types
from collections.abc import Sequence
from typing import Any

_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
)
_BINARY = ("image/png", "image/jpeg")
_THIS_FILE = os.path.abspath(__file__)


class Kernel:
    def __init__(self, requests_fd: int, messages_fd: int) -> None:
        self.messages = os.fdopen(messages_fd, "w", encoding="utf-8", buffering=1)
        self.requests = os.fdopen(requests_fd, "r", encoding="utf-8")
        self.current: int | None = None
        self.executing = False
        self.cell = 0
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        builtins.display = self.display  # type: ignore[attr-defined]
        signal.signal(signal.SIGINT, self.on_sigint)
        sys.meta_path.insert(0, _PyplotHook(self))

    # -- messages ---------------------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        msg["id"] = self.current
        self.messages.write(json.dumps(msg, default=repr) + "\n")

    def on_sigint(self, signum: int, frame: types.FrameType | None) -> None:
        if self.executing:
            raise KeyboardInterrupt()

    # -- rich output ------------------------------------------------------------------
    def bundle(self, obj: Any) -> dict[str, Any]:
        data: dict[str, Any] = {"text/plain": _safe_repr(obj)}
        if _is_figure(obj):
            png = _figure_png(obj)
            if png is not None:
                data["image/png"] = png
            return data
        if isinstance(obj, type):
            return data  # a class's _repr_html_ is an unbound function
        for mime, method in _REPR_METHODS:
            fn = getattr(obj, method, None)
            if not callable(fn):
                continue
            try:
                value = fn()
            except Exception:
                continue
            if isinstance(value, tuple) and value:
                value = value[0]  # (data, metadata) form
            if value is None:
                continue
            if mime in _BINARY:
                if isinstance(value, bytes | bytearray):
                    value = base64.b64encode(bytes(value)).decode()
                elif not isinstance(value, str):
                    continue
            data[mime] = value
        return data

    def display(self, *objs: Any) -> None:
        """Show objects as rich output (HTML, images, ...), as in Jupyter."""
        for obj in objs:
            self.send({"type": "display", "data": self.bundle(obj)})
            if _is_figure(obj):
                _close_figure(obj)

    def show_figures(self) -> None:
        """Send every open matplotlib figure as a PNG and close it."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in list(plt.get_fignums()):
            fig = plt.figure(num)
            self.display(fig)

    # -- running ----------------------------------------------------------------------
    def run(self, code: str) -> None:
        self.cell += 1
        filename = f"<cell-{self.cell}>"
        # linecache lets tracebacks show the cell's source lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
        except SyntaxError as exc:
            self.error(exc)
            return
        last: ast.expr | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = tree.body.pop().value  # type: ignore[attr-defined]
        try:
            self.executing = True
            try:
                exec(compile(tree, filename, "exec"), self.namespace)
                value = None
                if last is not None:
                    expr = ast.Expression(last)
                    value = eval(compile(expr, filename, "eval"), self.namespace)
            finally:
                self.executing = False
            self.flush()
            if value is not None:
                self.namespace["_"] = value
                self.send({"type": "result", "data": self.bundle(value)})
                if _is_figure(value):
                    _close_figure(value)
            self.show_figures()
        except BaseException as exc:  # user code may raise anything, SystemExit included
            self.executing = False
            self.flush()
            self.error(exc)

    def error(self, exc: BaseException) -> None:
        if isinstance(exc, SyntaxError):
            lines = traceback.format_exception_only(type(exc), exc)
        else:
            # Only the user's frames: the kernel's own (exec, the SIGINT handler) are noise.
            te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
            te.stack = traceback.StackSummary.from_list(
                [f for f in te.stack if f.filename != _THIS_FILE]
            )
            lines = list(te.format())
        self.send(
            {
                "type": "error",
                "ename": type(exc).__name__,
                "evalue": str(exc),
                "traceback": [line.rstrip("\n") for line in lines],
            }
        )

    @staticmethod
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    def serve(self) -> None:
        while True:
            try:
                line = self.requests.readline()
            except KeyboardInterrupt:
                continue
            if not line:
                return  # the agent went away or deleted the context
            try:
                request = json.loads(line)
                self.current = int(request["id"])
                code = str(request["code"])
            except (ValueError, KeyError, TypeError):
                continue
            try:
                self.run(code)
            except KeyboardInterrupt:
                self.executing = False  # a SIGINT landed between our own steps
            self.flush()
            self.send({"type": "done"})
            self.current = None


class _PyplotHook(importlib.abc.MetaPathFinder):
    """Makes ``plt.show()`` send the open figures, from the first import of pyplot on."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "matplotlib.pyplot":
            return None
        sys.meta_path.remove(self)  # find the real module, once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        kernel = self.kernel
        original = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original(module)

            def show(*args: Any, **kwargs: Any) -> None:
                kernel.show_figures()

            module.show = show  # type: ignore[attr-defined]

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _safe_repr(obj: Any) -> str:
    try:
        return repr(obj)
    except Exception as exc:
        return f"<repr failed: {exc!r}>"


def _is_figure(obj: Any) -> bool:
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(obj, figure.Figure)


def _figure_png(fig: Any) -> str | None:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", bbox_inches="tight")
    except Exception:
        return None
    return base64.b64encode(buf.getvalue()).decode()


def _close_figure(fig: Any) -> None:
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        with contextlib.suppress(Exception):
            plt.close(fig)


def main(argv: Sequence[str]) -> None:
    # Output streams as it is produced: line buffering is not enough for a progress bar.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=True, line_buffering=True)
    requests_fd, messages_fd = int(argv[1]), int(argv[2])
    sys.argv = [""]
    Kernel(requests_fd, messages_fd).serve()


if __name__ == "__main__":
    main(sys.argv)
