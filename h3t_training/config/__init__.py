"""The driver's configuration: Megatron's flags and h3t-ext's, their table, the typed frozen sections
built from them once (``sections.TrainConfig``), and their checks."""
