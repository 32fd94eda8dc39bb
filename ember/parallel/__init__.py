"""Scaling across ranks: process group, mesh and the hang watchdog (dist.py), layouts applied
to a model (parallelize.py; pipeline stages in pipeline.py), and the collectives' speed between
ranks (comm.py, ``ember bench comm``)."""
