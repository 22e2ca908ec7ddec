"""GPU path: megatron-core's DistributedDataParallel (or its FullyShardedDataParallel adapter of Megatron FSDP, or
torch FSDP2) and (distributed) optimizer, chosen as Megatron-LM's ``get_model`` chooses them.

Only used when CUDA is present; the CPU path is :class:`h3t_training.loop.optimizer.DataParallelAdamW`. The unit
tier checks the wrappers and configs this module hands megatron-core (``tests/unit/test_megatron_fsdp.py``, with
megatron-core's classes replaced); the GPU tier trains through it (``tests/gpu/test_gpu_driver.py``).
"""
from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from h3t_training.config.megatron_fields import ddp_fields
from h3t_training.loop.optimizer import MegatronOptimizerAdapter


def ddp_config_for(args) -> DistributedDataParallelConfig:
    """megatron-core's DDP config of the run: the table flags' fields (``megatron_fields.ddp_fields``), the
    overlap switches, the distributed optimizer and Megatron FSDP with its sharding strategy (Megatron-LM passes
    every ``DistributedDataParallelConfig`` field it has a flag for)."""
    return DistributedDataParallelConfig(**ddp_fields(args), overlap_grad_reduce=args.overlap_grad_reduce,
                                         overlap_param_gather=args.overlap_param_gather,
                                         check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
                                         use_distributed_optimizer=args.use_distributed_optimizer,
                                         use_megatron_fsdp=args.use_megatron_fsdp,
                                         data_parallel_sharding_strategy=args.data_parallel_sharding_strategy)


def data_parallel_wrapper(args):
    """The class Megatron-LM's ``get_model`` wraps each chunk in (torch FSDP2 aside): megatron-core's Megatron FSDP
    adapter with ``--use-megatron-fsdp``, else its DistributedDataParallel (imported only when asked for)."""
    if args.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
        return FullyShardedDataParallel
    return DistributedDataParallel


def wrap_for_gpu(args, chunks):
    """Wrap each chunk in megatron-core DDP (with --use-megatron-fsdp, its FullyShardedDataParallel adapter; with
    --use-torch-fsdp2, its TorchFullyShardedDataParallel) and build megatron-core's optimizer over them."""
    config = chunks[0].config
    if args.use_torch_fsdp2:
        from h3t_training.loop.fsdp import wrap_chunks
        wrapped = wrap_chunks(args, chunks, on_gpu=True)
        config.no_sync_func = wrapped[0].no_sync  # FSDP2 reduce-scatters in backward; megatron-core's no-op
        config.finalize_model_grads_func = finalize_model_grads
        return wrapped, _with_loss_scaling(config, MegatronOptimizerAdapter(wrapped, args, config))
    ddp_config = ddp_config_for(args)
    wrapper = data_parallel_wrapper(args)
    wrapped = [wrapper(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
               for i, c in enumerate(chunks)]
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped, _with_loss_scaling(config, MegatronOptimizerAdapter(wrapped, args, config))


def _with_loss_scaling(config, optimizer: MegatronOptimizerAdapter) -> MegatronOptimizerAdapter:
    """``config.grad_scale_func`` is the optimizer's ``scale_loss``, as Megatron-LM's ``train`` sets it: megatron-core's
    ``backward_step`` multiplies the last stage's loss by the loss scale (fp16: the dynamic scale, 2^32 at the start;
    1 for bf16) and the optimizer divides the gradients by it. Without it an fp16 run's gradients would be divided by
    a scale the loss never carried."""
    config.grad_scale_func = optimizer.opt.scale_loss
    return optimizer
