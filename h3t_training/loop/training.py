"""The training loop: the forward-backward function of the h3t-ext runtime it holds (``H3TSchedules``; the one
megatron-core's ``get_forward_backward_func()`` would hand out for the layout, called directly, nothing installed).

``pretrain`` reads (and checks) any checkpoint before the process groups exist, builds the model
chunks, builds the h3t-ext runtime with ``--ckpt`` / ``--offload-alpha``, and trains
``--train-iters`` iterations. The loss of an iteration is the token-weighted mean over its
microbatches and data-parallel replicas (context-parallel ranks included: their loss sums and token
counts add up to the full sequence's), computed on the last pipeline stage.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Optional
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from h3t_ext.runtime.config import H3TConfig
from h3t_ext.runtime.pipeline.schedules import H3TSchedules
from h3t_training.loop import checkpointing as ckpt_io
from h3t_training.data.batch_schedule import schedule_of
from h3t_training.data.datasets import build_data_iterators, build_datasets
from h3t_training.loop.evaluation import Evaluator
from h3t_training.launch.failures import Interrupted, RunProgress
from h3t_training.loop.exit_conditions import ExitConditions, ExitSignalHandler
from h3t_training.loop.heartbeat import start_heartbeat
from h3t_training.config.feature_checks import uses_gpu
from h3t_training.config.memory_hygiene import MemoryHygiene
from h3t_training.loop.initialize import initialize_distributed, shutdown
from h3t_training.telemetry.loggers import build_writer, writers_requested
from h3t_training.loop.model_provider import build_model_chunks, num_parameters
from h3t_training.loop.optimizer import NonFiniteError
from h3t_training.loop.optimizer_offload import cpu_notes
from h3t_training.loop.param_schedule import increment, resumed_steps, steps_before
from h3t_training.loop.param_stats import params_l2_norm
from h3t_training.telemetry.prediction import predicted_scalars
from h3t_training.launch.run_guard import RunLock
from h3t_training.telemetry.scalars import TrainingScalars
from h3t_training.loop.sdc_guards import check_weight_hashes
from h3t_training.telemetry.state_bytes import rank_state_bytes
from h3t_training.data.tokenizer import run_padded_vocab_size, tokenizer_from_args
from h3t_training.telemetry.training_log import IterationLogger, write_metrics_json
from h3t_training.loop.collectives import all_reduce_host


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple: summed loss, token count, and the pair reported for logging."""
    dtype = torch.promote_types(output_tensor.dtype, torch.float32)  # float32, or float64 with --h3t-float64
    losses = output_tensor.to(dtype).reshape(-1)
    mask = loss_mask.reshape(-1).to(dtype)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}


def forward_step(data_iterator, model):
    """One microbatch through one model chunk (later stages read their input from the pipeline)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _cpu_optimizer(args, chunks, *, fsdp: bool):
    from h3t_training.loop.optimizer import DataParallelAdamW
    return DataParallelAdamW(
        chunks, args, dp_group=ps.get_data_parallel_group(with_context_parallel=True),
        model_parallel_group=ps.get_model_parallel_group(), tp_rank=ps.get_tensor_model_parallel_rank(),
        distributed=args.use_distributed_optimizer, tp_group=ps.get_tensor_model_parallel_group(), fsdp=fsdp,
        embedding_group=ps.get_embedding_group(check_initialized=False),
        pipeline_group=ps.get_pipeline_model_parallel_group())


def _build_optimizer(args, chunks, on_gpu: bool):
    if on_gpu:
        from h3t_training.loop.gpu_wrap import wrap_for_gpu
        return wrap_for_gpu(args, chunks)
    if args.use_torch_fsdp2:
        from h3t_training.loop.fsdp import wrap_chunks
        chunks = wrap_chunks(args, chunks, on_gpu=False)
        return chunks, _cpu_optimizer(args, chunks, fsdp=True)
    return chunks, _cpu_optimizer(args, chunks, fsdp=False)


def _build_and_load(args, chunks, found, on_gpu: bool):
    """The wrapped chunks, the optimizer, the start iteration and the load notices. With --use-torch-fsdp2 on CPU
    the checkpoint is read after the wrap, each rank reading only its rows of every parameter and Adam moment into
    its shards (h3t_training.loop.fsdp.load_state). On a GPU (model only: --no-load-optim or --finetune, checked
    with the flags) it is read whole before the wrap, which shards it: the GPU wrap records no row layout."""
    if not (args.use_torch_fsdp2 and found is not None and on_gpu):
        chunks, optimizer = _build_optimizer(args, chunks, on_gpu)
        start, notes = ckpt_io.load_checkpoint(found, args, chunks, optimizer) if found is not None else (0, [])
        return chunks, optimizer, start, notes
    start, notes = ckpt_io.load_checkpoint(found, args, chunks, _cpu_optimizer(args, chunks, fsdp=False))
    chunks, optimizer = _build_optimizer(args, chunks, on_gpu)
    return chunks, optimizer, start, notes


def _loss_sums(losses: list) -> torch.Tensor:
    """This rank's microbatches' summed loss and loss tokens (float64; zeros off the last pipeline stage)."""
    total = torch.zeros(2, dtype=torch.float64)
    for d in losses:
        total += d["lm loss"].detach().double().cpu()
    return total


def _iteration_loss(losses: list) -> float:
    """Token-weighted mean loss over microbatches and data-parallel replicas (last stage only)."""
    total = _loss_sums(losses)
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(dp) > 1:
        total = all_reduce_host(total, group=dp)
    return float(total[0] / total[1].clamp(min=1))


def _iteration_tokens(losses: list) -> int:
    """The loss tokens of this data-parallel rank's microbatches (counted on the last pipeline stage, sent to the
    others as megatron-core's ``finalize_model_grads`` broadcasts them)."""
    count = _loss_sums(losses)[1:]
    pp = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1:  # the other stages hold none: a sum is the last stage's
        count = all_reduce_host(count, group=pp)
    return int(count.item())


def _check_loss(loss: float, iteration: int) -> None:
    """Every rank stops at a non-finite loss (known on the last pipeline stage), naming its value."""
    code = 0 if math.isfinite(loss) else 1 if math.isnan(loss) else 2 if loss > 0 else 3
    flag = all_reduce_host(torch.tensor([code]), op=dist.ReduceOp.MAX)
    if flag.item():
        value = ("nan", "inf", "-inf")[flag.item() - 1]
        raise NonFiniteError(f"iteration {iteration}: the loss is {value}; stopped "
                             f"(--no-check-for-nan-in-loss-and-grad goes on)")


def _save(args, iteration: int, chunks, optimizer, on_gpu: bool, schedule_steps: int,
          skipped_samples: int) -> None:
    ckpt_io.save_checkpoint(args, iteration, chunks, optimizer, on_gpu=on_gpu, schedule_steps=schedule_steps,
                            skipped_samples=skipped_samples)
    if dist.get_rank() == 0:
        print(f"saved checkpoint at iteration {iteration} to {args.save}", flush=True)


def _measuring_manager_factory(config, pipeline_rank: int, pipeline_size: int, device):
    """Every stage gets an activation manager (also at alpha 0, ckpt no) so its bytes are measured."""
    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.memory.device import make_device_layer
    layer = make_device_layer(config.device_mode, torch.device(device))
    return ActivationManager(config.stage_alpha(pipeline_rank, pipeline_size), layer,
                             min_offload_bytes=config.min_offload_bytes)


def _stage_manager(runtime, chunks):
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    return runtime.preparer.manager(pp_rank, pp_size, next(chunks[0].parameters()).device)


def _stage_stats(runtime, chunks) -> dict:
    """This pipeline stage's saved-activation peak and offloaded bytes over the last iteration, and the
    (1-based, megatron-core's ``layer_number``) transformer layers each of its model chunks built."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    stats = _stage_manager(runtime, chunks).stats
    layers = [[m.layer_number for m in c.modules() if isinstance(m, TransformerLayer)] for c in chunks]
    return {"pipeline_rank": ps.get_pipeline_model_parallel_rank(),
            "peak_activation_bytes": int(stats.peak_resident_bytes), "offloaded_bytes": int(stats.offloaded_bytes),
            "layer_numbers": layers}


def _gather_stage_stats(runtime, chunks) -> list[dict]:
    mine = _stage_stats(runtime, chunks)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_stage = {}
    for s in everyone:
        by_stage.setdefault(s["pipeline_rank"], s)
    return [by_stage[r] for r in sorted(by_stage)]


def _gather_state_bytes(chunks, optimizer, on_gpu: bool) -> list[dict]:
    """Every rank's measured state bytes after the last step (h3t_training.telemetry.state_bytes), by global rank."""
    mine = {"rank": dist.get_rank(), "pipeline_rank": ps.get_pipeline_model_parallel_rank(),
            "tensor_rank": ps.get_tensor_model_parallel_rank(), "context_rank": ps.get_context_parallel_rank(),
            "data_parallel_rank": ps.get_data_parallel_rank(),
            **rank_state_bytes(chunks, optimizer, on_gpu=on_gpu).as_dict()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _notes(args, on_gpu: bool, found, config: H3TConfig) -> None:
    for line in args.flag_notices:  # the flag table's, --auto-plan's and --offload-alpha auto's notices, once
        print(line, flush=True)
    if config.offloads:
        from h3t_ext import kernels  # noqa: PLC0415  (only needed for this note)

        print(f"note: activation offload copies use {kernels.describe('cuda' if on_gpu else 'cpu')}", flush=True)
    if config.strict_p2p:
        effect = "no effect: NCCL is strict already" if "nccl" in str(dist.get_backend()).lower() else \
            f"pipeline transfers follow NCCL's ordering ({config.strict_p2p_comm} communicators)"
        print(f"note: --strict-p2p: {effect}", flush=True)
    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16)):
        if on and not on_gpu:
            print(f"note: {flag}: no effect on CPU; training in float32", flush=True)
    overlaps = [f for f, on in (("--overlap-grad-reduce", args.overlap_grad_reduce),
                                ("--overlap-param-gather", args.overlap_param_gather)) if on]
    if overlaps and not on_gpu:
        print(f"note: {' and '.join(overlaps)} apply to megatron-core's DDP on GPU; the CPU optimizer reduces "
              "gradients in one call after the backward", flush=True)
    if not on_gpu:
        for line in cpu_notes(args):
            print(line, flush=True)
    for line in found.notices if found is not None else ():
        print(line, flush=True)
    if args.load and found is None:
        print(f"note: no checkpoint in --load {args.load}; training from scratch", flush=True)
    if found is not None and found.named_by == "--pretrained-checkpoint":
        print(f"note: no checkpoint in --load {args.load}; finetuning from --pretrained-checkpoint "
              f"{args.pretrained_checkpoint} (its weights, iteration 0, as --finetune)", flush=True)
    if args.async_save:
        print("note: --async-save: checkpoints are written synchronously by this driver", flush=True)


def _write_scalars(args, scalars: TrainingScalars, rec: dict, optimizer, runtime, chunks, config) -> None:
    """TensorBoard/wandb scalars of one iteration; the stage statistics are gathered on every rank."""
    if not writers_requested(args):
        return
    scalars.iteration(rec, loss_scale=rec["loss_scale"])
    if scalars.tensorboard_due(rec["iteration"]):
        p = args.pipeline_model_parallel_size
        scalars.stages(rec["iteration"], _gather_stage_stats(runtime, chunks),
                       [config.stage_alpha(r, p) for r in range(p)])


def train(args, chunks, optimizer, runtime, start_iteration: int, logger: IterationLogger, data_iterators,
          on_gpu: bool, evaluator: Evaluator, scalars: TrainingScalars, config: H3TConfig,
          exits: Optional[ExitConditions] = None, progress: Optional[RunProgress] = None,
          hygiene: MemoryHygiene = MemoryHygiene(), schedule_steps: Optional[int] = None) -> tuple[int, bool]:
    """Run iterations ``start_iteration .. --train-iters`` (evaluating, saving and exiting as asked:
    --exit-interval, --exit-duration-in-mins, --exit-signal-handler); returns the last iteration done
    and whether the run exited early. ``progress.iteration`` follows the iterations done; ``hygiene``: Megatron's
    --manual-gc and --empty-unused-memory-level at the points of Megatron-LM's loop (the caller holds
    ``hygiene.training()`` around the call, as Megatron's ``train`` switches the collector off). ``schedule_steps``:
    the learning-rate schedule's ``num_steps`` at the start (a checkpoint's; default: the samples before
    ``start_iteration``), advanced after every update that was not skipped, as Megatron-LM steps its scheduler."""
    progress = progress or RunProgress()
    fb = runtime.forward_backward_func(args.pipeline_model_parallel_size, len(chunks))
    batches, shard = schedule_of(args), args.micro_batch_size * args.data_parallel_size
    is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    done = start_iteration
    steps = steps_before(args, start_iteration) if schedule_steps is None else schedule_steps
    for it in range(start_iteration, args.train_iters):
        if it + 1 in args.skipped_iterations:  # Megatron-LM: read past its batches, and nothing else at all
            for data_iterator in data_iterators:
                data_iterator.skip_iteration()
            logger.skipped_samples += batches.batch_size(it)
            done = progress.iteration = it + 1
            continue
        t0 = time.perf_counter()
        _stage_manager(runtime, chunks).reset_stats()
        optimizer.zero_grad()
        losses = fb(forward_step_func=forward_step, data_iterator=data_iterators, model=chunks,
                    num_microbatches=batches.batch_size(it) // shard, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=False)
        hygiene.after_forward_backward()
        # the CPU optimizer scales by the batch's tokens itself; on a GPU finalize_model_grads has
        tokens = _iteration_tokens(losses) if args.calculate_per_token_loss and not on_gpu else 0
        _, norm = optimizer.step(it, steps, tokens)
        if not optimizer.skipped:
            steps += increment(args, it)
        lr = optimizer.schedule.lr(steps)  # what Megatron-LM logs: its scheduler has stepped by then
        hygiene.after_optimizer_step()
        progress.iteration = it + 1  # complete on this rank once its step is applied (before any rank logs it)
        loss = _iteration_loss(losses) if is_last_stage else float("nan")
        if args.check_for_nan_in_loss_and_grad:
            _check_loss(loss if is_last_stage else 0.0, it + 1)
        elapsed = time.perf_counter() - t0
        logger.skipped_samples += args.samples_left_out_per_iteration  # Megatron-LM: requested minus running batch
        rec = logger.record(it + 1, loss, elapsed, lr, norm, loss_scale=optimizer.get_loss_scale(),
                            skipped=optimizer.skipped, num_zeros=optimizer.num_zeros_in_grad,
                            params_norm=_params_norm(args, chunks, on_gpu) if args.log_params_norm else None)
        done = it + 1
        _write_scalars(args, scalars, rec, optimizer, runtime, chunks, config)
        hygiene.after_iteration(done)
        if evaluator.due(done):
            with hygiene.evaluation():
                result = evaluator.evaluate(done, "valid")
            if result is not None:
                scalars.evaluation(done, "valid", result.loss, result.ppl)
        interval = args.check_weight_hash_across_dp_replicas_interval
        if interval and done % interval == 0:  # as Megatron-LM: after the step and its log line, before any save
            check_weight_hashes(args, chunks, done)
        leave = exits is not None and done < args.train_iters and exits.should_exit()
        if args.save and ((args.save_interval and done % args.save_interval == 0) or done == args.train_iters
                          or (args.exit_interval and done % args.exit_interval == 0) or leave):
            _save(args, done, chunks, optimizer, on_gpu, steps, logger.skipped_samples)
        if leave and dist.get_rank() == 0:
            print(f"exiting program at iteration {done}: {exits.reason}", flush=True)
        if leave or (args.exit_interval and done % args.exit_interval == 0):
            return done, True
    if (args.save and done == args.train_iters > start_iteration and done in args.skipped_iterations
            and not (args.save_interval and done % args.save_interval == 0)):
        _save(args, done, chunks, optimizer, on_gpu, steps, logger.skipped_samples)  # Megatron-LM's save after train
    return done, False


def _params_norm(args, chunks, on_gpu: bool) -> float:
    """--log-params-norm: the parameters' L2 norm after the step, as Megatron-LM's ``calc_params_l2_norm`` (on a GPU with
    --bf16, of the optimizer's fp32 main parameters)."""
    return params_l2_norm([p for c in chunks for p in c.parameters()], tp_rank=ps.get_tensor_model_parallel_rank(),
                          model_parallel_group=ps.get_model_parallel_group(),
                          shard_group=ps.get_data_parallel_group(with_context_parallel=True), bf16=on_gpu and args.bf16)


def _final_evaluations(args, evaluator: Evaluator, scalars: TrainingScalars, iteration: int) -> None:
    """Megatron's end of training: the validation split, then the test split (no scalars with --skip-train)."""
    for split, on in (("valid", evaluator.do_valid), ("test", evaluator.do_test)):
        if on:
            result = evaluator.evaluate(iteration, split, at_end=True)
            if result is not None and not args.skip_train:
                scalars.evaluation(iteration, split, result.loss, result.ppl)


def _rank0_printer():
    """``print`` on rank 0 of the job's process group, a no-op elsewhere."""
    return (lambda line: print(line, flush=True)) if dist.get_rank() == 0 else (lambda line: None)


def pretrain(args, *, rank: int, progress: Optional[RunProgress] = None, progress_bar: bool = False) -> int:
    """Everything after argument parsing (``rank``: this process's rank, from its launcher); returns the
    process exit status. ``progress`` (:mod:`h3t_training.launch.failures`) follows the iterations done; raises
    :class:`~h3t_training.launch.failures.Interrupted` after a clean stop on SIGINT under --exit-signal-handler.
    ``progress_bar``: stdout is a terminal a person watches (the entry point's
    :meth:`~h3t_training.launch.launch_env.LaunchEnv.watched_terminal`); ``--no-progress-bar`` turns it off."""
    progress = progress or RunProgress()
    start_time = time.time()
    # before any process group: a bad checkpoint stops all ranks; --pretrained-checkpoint where --load holds none
    args, found = ckpt_io.find_load(args, rank=rank)
    if found is None and args.load and args.exit_on_missing_checkpoint:  # every rank reads the same --load
        if rank == 0:
            print(f"note: no checkpoint in --load {args.load}; --exit-on-missing-checkpoint: exiting", flush=True)
        return 0
    if found is not None and found.adopted:  # the checkpoint's LR schedule, vocabulary padding
        args = args.replace(**found.adopted)
    lock = RunLock(args.save).acquire() if args.save and rank == 0 else None
    try:
        return _pretrain(args, found, start_time, progress, progress_bar)
    finally:
        if lock is not None:
            lock.release()


def _pretrain(args, found, start_time: float, progress: RunProgress, progress_bar: bool) -> int:
    initialize_distributed(args)
    heartbeat = start_heartbeat(args.distributed_timeout_minutes)  # a frozen peer ends the run in one line
    on_gpu = uses_gpu(args)
    tokenizer = tokenizer_from_args(args)
    chunks = build_model_chunks(args, on_gpu=on_gpu, vocab_size=tokenizer.vocab_size)
    n_params = num_parameters(chunks)
    config = H3TConfig(ckpt=args.ckpt, offload_alpha=args.offload_alpha, strict_p2p=args.strict_p2p,
                       strict_p2p_comm=args.strict_p2p_comm, p2p_timeout_s=args.distributed_timeout_minutes * 60)
    runtime = H3TSchedules(config, manager_factory=_measuring_manager_factory)  # held and called, not installed
    chunks, optimizer, start, load_notes = _build_and_load(args, chunks, found, on_gpu)
    progress.iteration = start
    train_ds, valid_ds, test_ds = build_datasets(args, tokenizer, notify=_rank0_printer())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    iters = None if args.skip_train else build_data_iterators(
        args, train_ds, start_iteration=start, num_chunks=len(chunks), data_parallel_rank=ps.get_data_parallel_rank(),
        device=device, cp_group=ps.get_context_parallel_group())
    is_logging_rank = dist.get_rank() == dist.get_world_size() - 1
    if dist.get_rank() == 0:
        _notes(args, on_gpu, found, config)
        for note in load_notes:
            print(f"note: {note}", flush=True)
    logger = IterationLogger(args, vocab_size=tokenizer.vocab_size, on_gpu=on_gpu, is_logging_rank=is_logging_rank,
                             progress_bar=progress_bar and not args.no_progress_bar)
    logger.header(start, n_params)
    if found is not None and not args.finetune:  # Megatron-LM keeps counting from the checkpoint's
        logger.skipped_samples = int(found.common.get("skipped_train_samples", 0) or 0)
    hygiene = MemoryHygiene.from_args(args, on_gpu=on_gpu)
    evaluator = Evaluator(args, chunks, forward_step, runtime, valid_dataset=valid_ds, test_dataset=test_ds,
                          start_iteration=start, device=device, print_fn=logger._print, is_logging_rank=is_logging_rank,
                          hygiene=hygiene)
    writer = build_writer(args, is_logging_rank)
    predicted = (predicted_scalars(args, vocab_size=run_padded_vocab_size(args), on_gpu=on_gpu)
                 if is_logging_rank and writers_requested(args) else {})
    scalars = TrainingScalars(args, writer, on_gpu=on_gpu, predicted=predicted)
    handler = ExitSignalHandler(args.exit_signal) if args.exit_signal_handler else None
    exits = ExitConditions(args, start_time, handler)
    schedule_steps = resumed_steps(args, found.common.get("opt_param_scheduler") if found else None, start)
    try:
        with handler or contextlib.nullcontext():
            if args.skip_train:
                iteration, exited = start, False
            else:
                with hygiene.training():
                    iteration, exited = train(args, chunks, optimizer, runtime, start, logger, iters, on_gpu,
                                              evaluator, scalars, config, exits=exits, progress=progress,
                                              hygiene=hygiene, schedule_steps=schedule_steps)
        stats = _gather_stage_stats(runtime, chunks)
        state_bytes = _gather_state_bytes(chunks, optimizer, on_gpu)
        if not exited:
            _final_evaluations(args, evaluator, scalars, iteration)
    finally:
        logger.close()
        writer.close()
    if is_logging_rank and args.metrics_json:
        write_metrics_json(args.metrics_json, args, logger.records, stats,
                           [r.as_dict() for r in evaluator.results], state_bytes=state_bytes)
    if heartbeat is not None:  # before the groups go: a rank that finished first is not "frozen"
        dist.barrier()
        heartbeat.stop()
    shutdown()
    if exits.interrupted:
        raise Interrupted(f"SIGINT: stopped after iteration {iteration}")
    return 0
