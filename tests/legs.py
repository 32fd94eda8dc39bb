"""Several training runs in one ``torchrun`` launch (a launch costs seconds of start-up; a tiny
run, less): ``python -m torch.distributed.run --nproc-per-node N tests/legs.py LEGS.json``, the
file mapping run names to the overrides of the ``tiny`` preset. Each run builds its own mesh in
the one process group; a run that fails stops the launch."""

from __future__ import annotations

import json
import sys

from ember.config import load_config
from ember.parallel.dist import barrier, destroy_distributed
from ember.train.trainer import Trainer

if __name__ == "__main__":
    legs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    try:
        for overrides in legs.values():
            Trainer(load_config("tiny", overrides)).run()
            barrier()
    finally:
        destroy_distributed()
