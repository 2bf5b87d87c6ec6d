"""The machine of one sandbox: the backend protocol (:mod:`hutch.runtime.backend`) and
its QEMU implementation (:mod:`hutch.runtime.qemu`). A driver layer: it never imports
the services that use it."""
