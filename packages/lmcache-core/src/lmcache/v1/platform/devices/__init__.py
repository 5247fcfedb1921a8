"""Devices built into core. Only the CPU device lives here; accelerators ship as wheels."""
