"""GPU path: megatron-core's DistributedDataParallel and (distributed) optimizer.

Only used when CUDA is present; the CPU path is :class:`h3t_training.loop.optimizer.DataParallelAdamW`.
No machine of this project has a GPU, so this module is not exercised by the test suite.
"""
from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from h3t_training.config.megatron_fields import ddp_fields
from h3t_training.loop.optimizer import MegatronOptimizerAdapter


def wrap_for_gpu(args, chunks):
    """Wrap each chunk in megatron-core DDP (or, with --use-torch-fsdp2, its TorchFullyShardedDataParallel) and
    build megatron-core's optimizer over them."""
    config = chunks[0].config
    if args.use_torch_fsdp2:
        from h3t_training.loop.fsdp import wrap_chunks
        wrapped = wrap_chunks(args, chunks, on_gpu=True)
        config.no_sync_func = wrapped[0].no_sync  # FSDP2 reduce-scatters in backward; megatron-core's no-op
        config.finalize_model_grads_func = finalize_model_grads
        return wrapped, MegatronOptimizerAdapter(wrapped, args, config)
    ddp_config = DistributedDataParallelConfig(**ddp_fields(args), overlap_grad_reduce=args.overlap_grad_reduce,
                                               overlap_param_gather=args.overlap_param_gather,
                                               check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                       disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped, MegatronOptimizerAdapter(wrapped, args, config)
