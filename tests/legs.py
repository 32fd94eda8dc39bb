"""Several runs in one ``torchrun`` launch (a launch costs seconds of start-up; a tiny run,
less): ``python -m torch.distributed.run --nproc-per-node N tests/legs.py LEGS.json``. The file
maps names to the overrides of the ``tiny`` preset (a training run each), to ``{"config": ...,
"overrides": [...]}`` (a training run of another preset), or to ``{"config": ..., "overrides":
[...], "plan": OUT}``: ``ember plan``'s prediction and its measurement of a few steps, which
rank 0 writes to OUT as JSON. Each run builds its own mesh in
the one process group; a run that fails stops the launch."""

from __future__ import annotations

import json
import os
import sys

from ember.config import load_config
from ember.parallel.dist import barrier, destroy_distributed, get_rank
from ember.train.trainer import Trainer

if __name__ == "__main__":
    legs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    try:
        for leg in legs.values():
            if isinstance(leg, list):
                Trainer(load_config("tiny", ["train.report=false", *leg])).run()
            elif "plan" not in leg:
                Trainer(load_config(leg["config"], leg["overrides"])).run()
            else:
                from ember.analysis import plan

                cfg = load_config(leg["config"], leg["overrides"])
                world = int(os.environ.get("WORLD_SIZE", "1"))
                predicted = plan.predict(cfg, plan.model_config_for(cfg), world)
                measured = plan.measure_config(cfg, steps=5)  # the lowest of 3 tracked steps
                if get_rank() == 0:
                    with open(leg["plan"], "w", encoding="utf-8") as f:
                        json.dump({"predicted": predicted, "measured": measured}, f)
            barrier()
    finally:
        destroy_distributed()
