"""Kernels on Hopper's own instructions (sm_90a: ``wgmma``), issue 18; see ``wgmma.py``."""
