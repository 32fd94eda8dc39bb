"""Scaling across ranks: process group and mesh (dist.py), layouts applied to a model
(parallelize.py), and the collectives' speed between ranks (comm.py, ``ember bench comm``)."""
