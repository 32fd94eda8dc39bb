"""Scaling across ranks: process group, mesh and the hang watchdog (dist.py), layouts applied
to a model (parallelize.py; pipeline stages in pipeline.py), what a layout needs per rank
(plan.py, ``ember plan``), and the collectives' speed between ranks (comm.py,
``ember bench comm``)."""
