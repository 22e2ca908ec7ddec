"""What a run reports: the training log, the writers (TensorBoard, W&B), the scalars, the cost model's
prediction of the run and the measured state bytes."""
