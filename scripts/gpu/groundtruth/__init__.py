"""The ground-truth measurements of the cost model's terms on one GPU (``scripts/gpu/ground_truth.py``)."""
