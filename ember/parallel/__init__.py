"""Scaling across ranks: process group, mesh and the hang watchdog (dist.py), layouts applied
to a model (parallelize.py), and the collectives' speed between ranks (comm.py,
``ember bench comm``)."""
