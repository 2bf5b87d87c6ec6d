"""Sandbox networking on the host, drivers only: addresses, taps, nftables, DNS, the
egress proxy, inbound port forwarding and the data path's thread that runs them
(:mod:`hutch.net.enforcer` drives them as one). Every control lives here, outside the
guest. The use case (leases, rules, networks, ports in the store) is
:mod:`hutch.services.network`: nothing here imports the store or the VM driver; what it
needs of them (the QEMU uid, the persisted rows) is handed in as plain values."""
