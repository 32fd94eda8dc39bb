"""Pipeline parallel: the blocks cut into stages, each on its own ranks, micro-batches flowing
through them by a schedule of ``torch.distributed.pipelining``.

    model = pipeline_parallelize(model, env, cfg)   # this rank's share, as a PipelineGPT
    loss = model.train_step(x, y)                    # forward + backward of every micro-batch
    logits = model(x)                                # evaluation: logits on the last stage, else None

Schedules (``parallel.pp_schedule``): ``gpipe`` (Huang et al. 2019), ``1f1b`` (Narayanan et al.
2019, PipeDream-Flush), ``interleaved-1f1b`` (Narayanan et al. 2021); docs/parallel.md
("Pipeline parallel") has their bubbles, memory and the micro-batch arithmetic.

Design choices:

- Each stage is a GPT that lacks what it does not run (``None`` in place of the embedding or
  the head: the model's own forward then takes or returns the residual stream), so each is
  parallelized like a whole model (tensor parallel → checkpointing → compile → FSDP/DDP on the
  stage's "dp" ranks).
- The rank's ``PipelineGPT`` holds its stages' modules under their original names
  (``layers.5...``): optimizer, checkpoints (DCP: each stage saves and loads its own keys, so
  any layout's checkpoint loads in any other) and the exported weights see one model.
- Micro-batches are gradient accumulation: each micro-batch's loss is its mean and the schedule
  divides the summed gradients by M, so the update equals one process's; the clipping norm is
  summed over the stages (``pipeline_grad_norm``).
- A tied embedding and head would live on the first and the last stage and need their gradients
  summed between them (Megatron's embedding group); ember refuses ``model.tie_embeddings`` with
  ``parallel.pp`` instead, as torchtitan does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ember.errors import ConfigError
from ember.model.gpt import GPT

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the stream sent between stages


def virtual_stages(parallel_cfg) -> int:
    v = parallel_cfg.pp_virtual_stages
    return v or (2 if parallel_cfg.pp_schedule == "interleaved-1f1b" else 1)


def microbatches(cfg, dp_size: int) -> int:
    """Micro-batches per step of a pipeline (``parallel.pp_microbatches``, 0: rows per rank over
    ``train.micro_batch``)."""
    rows = cfg.train.batch_tokens // cfg.train.seq_len // dp_size
    return cfg.parallel.pp_microbatches or max(rows // cfg.train.micro_batch, 1)


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous block ranges, the first ``n_layer % n_stages`` stages one block longer."""
    size, extra = divmod(n_layer, n_stages)
    starts = [i * size + min(i, extra) for i in range(n_stages + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]


def stage_model(model: GPT, layers, first: bool, last: bool, cls=GPT) -> GPT:
    """A GPT holding ``model``'s blocks ``layers`` (the same modules), with the embedding when
    ``first`` and the norm and head when ``last``; ``None`` stands for what it lacks."""
    part = cls.__new__(cls)
    nn.Module.__init__(part)
    part.cfg = model.cfg
    part.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    rope = model.cfg.pos == "rope"  # every stage rotates q and k; learned positions are added once
    keep = {"tok_embeddings": first, "pos": first or rope, "dropout": first, "embed_norm": first,
            "norm": last, "transform": last, "output": last, "softcap": last}  # fmt: skip
    for name, kept in keep.items():
        setattr(part, name, getattr(model, name) if kept else None)
    return part


class PipelineGPT(GPT):
    """One rank's share of a pipelined GPT: its stages' modules under the whole model's names
    (for the optimizer, checkpoints and export), the schedule that trains them, and a forward
    for evaluation that passes the stream from stage to stage (logits on the last, None else)."""

    def setup(self, stages: list, modules: list, schedule, group, n_stages: int) -> PipelineGPT:
        self.__dict__.update(stages=stages, modules_=modules, schedule=schedule, group=group)
        self.n_stages, self.ids = n_stages, [s.stage_index for s in stages]
        self.has_first, self.has_last = 0 in self.ids, n_stages - 1 in self.ids
        return self

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch (gradients summed, divided by their count);
        the mean loss on the ranks of the last stage, 0 on the others."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        self.schedule.step(*args, target=y if self.has_last else None, losses=losses, return_outputs=False)
        if not self.has_last:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def forward(self, idx: torch.Tensor, cache=None, keep=None):
        if cache is not None or keep is not None:
            raise ConfigError("a pipelined model runs whole sequences: load the run's weights to generate")
        out = None
        group_rank = dist.get_rank(self.group)
        size = dist.get_world_size(self.group)
        for i, s in enumerate(self.ids):  # stage s runs on pipeline rank s % size, in stage order
            if s == 0:
                x = idx
            else:  # the stream from the rank before: its shape and dtype, then the tensor
                src = dist.get_global_rank(self.group, (group_rank - 1) % size)
                head = torch.empty(4, dtype=torch.long, device=idx.device)
                dist.recv(head, src, group=self.group)
                x = torch.empty(*head[:3].tolist(), dtype=DTYPES[int(head[3])], device=idx.device)
                dist.recv(x, src, group=self.group)
            out = self.modules_[i](x)
            if s < self.n_stages - 1:
                dst = dist.get_global_rank(self.group, (group_rank + 1) % size)
                head = torch.tensor([*out.shape, DTYPES.index(out.dtype)], device=idx.device)
                dist.send(head, dst, group=self.group)
                dist.send(out.contiguous(), dst, group=self.group)
        return out if self.has_last else None


def pipeline_grad_norm(params, group) -> torch.Tensor:
    """The L2 norm of every stage's gradients: each rank's sum of squares (a DTensor's reduced
    over its own mesh first), summed over the pipeline ranks."""
    squares = [p.grad.float().pow(2).sum() for p in params if p.grad is not None]
    squares = [s.full_tensor() if hasattr(s, "full_tensor") else s for s in squares]
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    dist.all_reduce(total, group=group)
    return total.sqrt()


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def pipeline_parallelize(model: GPT, env, cfg, apply_layout) -> PipelineGPT:
    """Cut ``model`` into stages, keep this rank's (stages pp_rank, pp_rank + pp, ...), apply
    the rest of the layout to each (``apply_layout(stage, env, cfg)``, parallelize's), and
    build the schedule."""
    from torch.distributed import pipelining

    p = cfg.parallel
    n_stages = p.pp * virtual_stages(p)
    ranges = stage_layers(model.cfg.n_layer, n_stages)
    ids = list(range(env.pp_rank, n_stages, p.pp))
    group = env.mesh["pp"].get_group()
    modules, stages = [], []
    for s in ids:
        part = stage_model(model, ranges[s], s == 0, s == n_stages - 1)
        part.stream_shards = env.tp if p.sequence_parallel else 1
        part = apply_layout(part, env, cfg)
        modules.append(part)
        stages.append(pipelining.PipelineStage(part, s, n_stages, env.device, group=group))
    layers = [i for s in ids for i in ranges[s]]
    rank_model = stage_model(model, layers, 0 in ids, n_stages - 1 in ids, cls=PipelineGPT)
    m = microbatches(cfg, env.dp_size)
    if p.pp_schedule == "interleaved-1f1b":
        schedule = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=_loss)
    else:
        cls = pipelining.ScheduleGPipe if p.pp_schedule == "gpipe" else pipelining.Schedule1F1B
        schedule = cls(stages[0], n_microbatches=m, loss_fn=_loss)
    return rank_model.setup(stages, modules, schedule, group, n_stages)
