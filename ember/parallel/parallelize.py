"""Layouts applied to a single-device model, from outside, in one fixed order.

    model = parallelize(model, env, cfg)

Order (each step needs the one before it):

0. pipeline parallel         — ``parallel.pp`` > 1: the blocks cut into stages, this rank's kept
                               (ember/parallel/pipeline.py), and steps 1-4 applied to each stage;
1. tensor parallel           — ``parallel.tp`` ranks split every block's matrices by a plan
                               (``apply_tp``), on the mesh's "tp" dimension; or expert parallel,
                               ``parallel.ep`` ranks split each MoE layer's experts
                               (ember/parallel/expert.py), which step 4 then leaves alone;
2. activation checkpointing  — wrap each block, so backward recomputes its activations;
3. compile                   — ``torch.compile`` per block (the blocks are identical, so one
                               graph is reused; a whole-model compile would retrace more);
4. data parallel             — FSDP2 ``fully_shard`` on every block then the root, with a
                               mixed-precision policy when not fp32, on the "dp" dimension
                               (with tensor parallel: 2-D, FSDP over TP's DTensors; with
                               ``parallel.dp_replicate`` > 1 a 2-D data mesh, HSDP: sharded
                               within a group, replicated across groups); or DDP on the whole.

The model keeps its parameter names through all of it (the checkpoint wrapper and compile
strip their prefixes from state dicts), so checkpoints move between layouts.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from ember.parallel.expert import apply_ep, expert_params
from ember.parallel.pipeline import pipeline_parallelize

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def apply_tp(model: torch.nn.Module, mesh, sequence_parallel: bool = False, loss_parallel: bool = False):
    """Tensor parallel (Megatron-LM, Shoeybi et al. 2019) by a plan over the model's own module
    names: in each block q, k, v and the MLP's up (and gate) projections are split by output
    columns (``ColwiseParallel``: each rank computes n_head / tp heads, or hidden / tp units,
    locally), the attention output and the MLP's down projection by input rows
    (``RowwiseParallel``: partial sums, one all-reduce), so a block costs two all-reduces
    forward and two backward. The embedding is split by vocabulary rows (each rank looks up its
    range, one all-reduce) and the head by vocabulary columns (logits all-gathered). Norms,
    positions and everything else stay whole on every rank, computed identically. Activations
    between modules are plain tensors (``use_local_output``), so the model's code, which reads
    heads as ``-1`` from the shapes, runs unchanged. A tied head shares the embedding's
    row-split weight (the same placement) and is tied again after the split.

    ``sequence_parallel`` (Korthikanti et al. 2022): between the blocks' matrices the residual
    stream is split by sequence position instead of copied, so each rank holds and normalises
    T / tp positions; each all-reduce becomes a reduce-scatter (after the row-split linears)
    and an all-gather (before the column-split ones): the same traffic, 1/tp of the activation
    memory outside the matrices. RoPE only: learned positions are added to the whole sequence.

    ``loss_parallel``: the head's logits stay split by vocabulary (a DTensor) instead of being
    gathered, and the cross-entropy is computed on the shards (``loss_parallel``: each rank's
    max, sum of exponentials and target logit, combined by small all-reduces), so no rank ever
    holds the (tokens × vocabulary) logits whole — the largest activation of a small model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    ends = (model.tok_embeddings, model.output)  # a pipeline stage lacks one or both (None)
    tied = None not in ends and getattr(model.output, "weight", None) is model.tok_embeddings.weight
    stream = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    plan = {name: how for name, how in plan.items() if getattr(model, name) is not None}  # (a pipeline stage)
    parallelize_module(model, mesh, plan)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        names = {name for name, _ in block.named_modules()}
        block_plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        block_plan["attention.wo"] = RowwiseParallel(output_layouts=stream)
        block_plan |= {f"mlp.{w}": ColwiseParallel() for w in ("w1", "w3") if f"mlp.{w}" in names}
        block_plan["mlp.w2"] = RowwiseParallel(output_layouts=stream)
        if sp:  # norms on the positions a rank holds; the whole sequence gathered before q/k/v, the MLP
            block_plan |= {"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}
            block_plan["attention"] = PrepareModuleInput(  # (x, rope, cache): only x is a DTensor
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            )
            block_plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        parallelize_module(block, mesh, block_plan)


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)


def compile_mode(mode: str) -> str | None:
    """``train.compile_mode`` as ``torch.compile`` takes it."""
    return None if mode == "default" else mode


def apply_compile(model: torch.nn.Module, mode: str = "default") -> None:
    """Each block under ``torch.compile`` for training's forward and backward (fixed shapes, no
    cache; ``train.compile_scope=model`` compiles the trainer's whole step instead). A forward
    with a KV cache (GRPO's rollouts, the shared prefix, evaluation by generation) runs the blocks
    eagerly (``GPT.forward``): its shapes and the cache's state change every call, and each would
    be a recompilation, past dynamo's limit within one rollout."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True, mode=compile_mode(mode))
    model.compiled_blocks = True


def apply_fsdp(model: torch.nn.Module, mesh, precision: str) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "ignored_params": expert_params(model) or None}  # parallel.ep's own
    if precision in PARAM_DTYPES:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32
        )
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: torch.nn.Module, device: torch.device, mesh) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ignored = {id(p) for p in expert_params(model)}  # parallel.ep's own
    names = [name for name, p in model.named_parameters() if id(p) in ignored]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return DistributedDataParallel(model, device_ids=ids, process_group=mesh.get_group())


def parallelize(model: torch.nn.Module, env, cfg) -> torch.nn.Module:
    if env.pp > 1:  # first the cut into stages; each stage then gets apply_layout
        return pipeline_parallelize(model, env, cfg, apply_layout)
    return apply_layout(model, env, cfg)


def apply_layout(model: torch.nn.Module, env, cfg) -> torch.nn.Module:
    """Steps 1-4 of the order above on a whole model or on one pipeline stage."""
    if env.tp > 1:
        apply_tp(model, env.mesh["tp"], cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel)
    if cfg.parallel.ep > 1:  # ep is the whole (1-D) data-parallel group: ember/train/layout.py
        apply_ep(model, env.dp_mesh)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile and not cfg.train.compiles_step:
        apply_compile(model, cfg.train.compile_mode)
        if env.tp > 1 and getattr(model, "tok_embeddings", None) is not None:  # (not a later stage)
            # the blocks get a copy, not the DTensor's own local tensor: a compiled block whose input
            # is that alias hands its gradient back to the redistribution behind it as a plain
            # tensor (torch 2.13; with RoPE, where nothing is added to the embedding's output)
            model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    if env.dp_size > 1:
        if cfg.parallel.data == "fsdp":
            return apply_fsdp(model, env.dp_mesh, cfg.train.precision)  # a 2-D dp_mesh: HSDP
        return apply_ddp(model, env.device, env.dp_mesh)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if hasattr(model, "module") and not hasattr(model, "layers") else model
