"""The h3t-ext flags, defined once: the driver's parser (``pretrain_*.py``) and Megatron's own loop
(``extra_args_provider``, :mod:`h3t_training.loop.megatron_native`) both add them from here, so they take the same
names, values and help. Their values are parsed by the library's one types (:class:`h3t_ext.ckpt.Ckpt`,
:class:`h3t_ext.offload_alpha.OffloadAlpha`) when the configuration is resolved."""
from __future__ import annotations

from h3t_ext.ckpt import CKPT_CHOICES


def add_h3t_flags(group) -> None:
    """``--ckpt``, ``--offload-alpha`` and Megatron-Kwai's names for them, on an argparse parser or group."""
    group.add_argument("--ckpt", choices=CKPT_CHOICES, default=None,
                       help="activation recompute: no, full (each layer from its input), ours (keep GEMM outputs, "
                            "recompute the norms and the MLP activation in backward)")
    group.add_argument("--offload-alpha", default=None, metavar="{FLOAT,auto,balanced}",
                       help="fraction of saved activations sent to host memory (one value or one per stage, "
                            "comma-separated; auto/balanced: the cost model's smallest that fits); at "
                            "--pipeline-model-parallel-size 1 layer by layer, never the last layer")
    group.add_argument("--kaimm-offload-activation-ratio", "--pipeline-parallel-aware-offloading-ratio",
                       dest="kaimm_offload_ratio", default=None, help="Megatron-Kwai's name for --offload-alpha")
    group.add_argument("--kaimm-recompute-norm", action="store_true",
                       help="Megatron-Kwai: recompute the norms (with --kaimm-recompute-mlp-activation-func: "
                            "--ckpt ours)")
    group.add_argument("--kaimm-recompute-mlp-activation-func", action="store_true",
                       help="Megatron-Kwai: recompute the MLP activation (with --kaimm-recompute-norm: --ckpt ours)")


__all__ = ["add_h3t_flags"]
