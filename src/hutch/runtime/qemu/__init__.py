"""The QEMU ``microvm`` backend, one module per job: ``backend`` (QemuBackend: start,
clone, resume, adopt, clean up), ``runtime`` (QemuRuntime: one live VM and its agent;
pause, freeze), ``boot`` (VM config, gated cold boot, restore, the agent's hello),
``templates`` (build, find, publish; finishing any freeze), ``snapshots`` (frozen
directories: recovery after a crash, collection), ``host`` (the on-host layout and
``vm.json``)."""
