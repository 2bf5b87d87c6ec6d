"""Sandbox disks: qcow2 overlays on read-only images."""

from hutch.storage.overlay import create_overlay, overlay_info

__all__ = ["create_overlay", "overlay_info"]
