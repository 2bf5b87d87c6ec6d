"""The nftables dataplane, proven with real packets between scratch network namespaces.

Each test renders hutch's table with :mod:`hutch.net.nft`, applies it with
:mod:`hutch.net.nft_apply` inside the lab's host namespace, and sends real TCP/UDP from
the guest namespaces (see ``tests/privileged/conftest.py`` for the picture). The lab and
the guests are shared by the whole package (``conftest.py``); what the tests share
besides is in ``tables.py``.
"""
