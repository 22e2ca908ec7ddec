"""h3t-ext: activation rematerialization, fractional offload and an analytic planner for Megatron-LM."""
