"""Model specifications (:class:`ModelSpec`) and the model zoo (``h3t_ext/data/models.json``); the system's are
:mod:`h3t_ext.costmodel.system_spec`'s, re-exported here with the data files' names."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Union

from h3t_ext.attention_window import SkipFreq, WindowFlagError, attended_pairs, check_window, windowed_layer_count
from h3t_ext.costmodel.data_files import DATA_DIR, REFERENCE_DIR, read_json, reference_json
from h3t_ext.costmodel.errors import UnknownNameError
from h3t_ext.costmodel.system_spec import (NCCL_COMMUNICATORS_IN_USE, SystemSpec, get_system, list_systems,
                                           load_system_file, memory_budget_from_first_principles, system_file_dict,
                                           system_from_dict)


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""Megatron's --normalization values."""
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
"""Megatron's --position-embedding-type values the cost model prices (its 'mrope' and 'relative' are not)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (Megatron's names)."""

    name: str
    """Short name, e.g. ``llama-65b``."""
    num_layers: int
    """Transformer layers L."""
    hidden_size: int
    """Hidden size h."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); equal to num_attention_heads without GQA."""
    ffn_hidden_size: int
    """MLP hidden size f."""
    vocab_size: int
    """Vocabulary size V before padding."""
    swiglu: bool = True
    """Gated SwiGLU MLP (FC1 is 2f wide); False means GeLU with an f-wide FC1."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output layer on the last stage (Llama); False ties it to the embedding (GPT-3)."""
    attention_dropout: float = 0.0
    """Dropout probability of the attention probabilities (Megatron's --attention-dropout; its default is 0.1,
    Llama-style recipes set 0). With flash attention the mask is drawn from a counter-based RNG in the
    forward and drawn again in the backward, never stored."""
    hidden_dropout: float = 0.0
    """Dropout probability after the attention projection and FC2 (--hidden-dropout; Megatron's default 0.1):
    the fused bias-dropout-add keeps a 1-byte mask per element for backward."""
    add_bias_linear: bool = False
    """Biases on QKV, the projection, FC1 and FC2 (Megatron's add_bias_linear: on by default there, off with
    --disable-bias-linear; GPT models keep them, Llama models have none). Megatron fuses FC1's bias into the
    activation (bias_activation_fusion, its default), and that fused function hands autograd a full-size
    gradient for the bias, which autograd reduces over the tokens: one more read of FC1's output gradient
    in the backward. The other biases cost nothing extra (cuBLAS epilogues, the compiled bias-dropout-add)."""
    normalization: Optional[str] = None
    """Megatron's --normalization: 'LayerNorm' (a weight and a bias per norm) or 'RMSNorm' (a weight). Both are one
    memory-bound pass reading x and writing y (TransformerEngine's fused norms; the saved mean is one float a token
    beside the rstd), so only their parameters differ. None: RMSNorm with SwiGLU (Llama), LayerNorm without (GPT)."""
    position_embedding_type: Optional[str] = None
    """Megatron's --position-embedding-type: 'rope' (q and k rotated in every layer: element-wise traffic, and the
    local spec's saved cos/sin), 'learned_absolute' (a max_position_embeddings x h table on the first pipeline
    stage, whole on every tensor-parallel rank, added to the word embedding) or 'none'. None: rope with SwiGLU,
    learned_absolute without."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table (Megatron's --max-position-embeddings); None: the run's sequence length
    (what Megatron-LM's scripts give it)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's --make-vocab-size-divisible-by: the embedding and output layer hold V padded to a multiple of it
    times the tensor-parallel size (:meth:`padded_vocab_size`)."""
    kv_channels: Optional[int] = None
    """Megatron's --kv-channels, the head dimension d: queries are heads x d wide (:attr:`query_hidden_size`), keys
    and values groups x d, whatever h is (Qwen3, Gemma: heads x d != h). None: h / heads, which h must then divide
    (Megatron's default)."""
    qk_layernorm: bool = False
    """Megatron's --qk-layernorm: a norm (of --normalization's kind) over each head's d channels of the queries and
    the keys after the QKV projection (OLMo 2, Qwen3, Gemma 3). One memory-bound pass over q and k each way; its
    input, the QKV projection's output, and its per-head rstd are saved for its backward; weights of d each."""
    window_size: Optional[int] = None
    """Megatron's --window-size LEFT,0 as LEFT: sliding-window attention, each token attending to the LEFT tokens
    before it and itself (Mistral, Gemma). Flash attention computes only the band's blocks
    (:func:`h3t_ext.attention_window.attended_pairs`); what it saves is the same as without a window. None: causal
    attention over the whole sequence."""
    window_attn_skip_freq: Optional[SkipFreq] = None
    """Megatron's --window-attn-skip-freq: which layers the window applies to (an int N: all but every N-th; a tuple:
    one 0/1 per layer); None: all of them (:func:`h3t_ext.attention_window.is_windowed`)."""
    num_experts: Optional[int] = None
    """Megatron's --num-experts E: every layer's MLP is a mixture of E experts behind a router (Mixtral, Qwen3-MoE;
    megatron-core's --moe-layer-freq 1); None: a dense MLP (:mod:`h3t_ext.costmodel.moe`)."""
    moe_router_topk: int = 2
    """Megatron's --moe-router-topk k: experts each token is routed to (its default 2)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Megatron's --moe-ffn-hidden-size: one expert's MLP width f_e (SwiGLU experts: FC1 2 f_e wide); None:
    ``ffn_hidden_size`` (Megatron's default)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Megatron's --moe-shared-expert-intermediate-size: width of the shared expert every token also passes (a
    dense MLP beside the routed experts, split over the tensor-parallel ranks); None: no shared expert."""
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    """Megatron's --moe-layer-freq: which layers are MoE layers (the others have the dense MLP of ``ffn_hidden_size``):
    an int N makes layer i (from 0) one when i mod N is 0; a tuple gives one 0/1 per layer (Megatron's list
    pattern, e.g. ``[0]*1+[1]*45`` for a first dense layer). 1: every layer."""

    def __post_init__(self) -> None:
        if self.normalization is None:
            object.__setattr__(self, "normalization", "RMSNorm" if self.swiglu else "LayerNorm")
        if self.position_embedding_type is None:
            object.__setattr__(self, "position_embedding_type", "rope" if self.swiglu else "learned_absolute")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization {self.normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not one of "
                             f"{', '.join(POSITION_EMBEDDING_TYPES)}")
        if int(self.make_vocab_size_divisible_by) < 1:
            raise ValueError(f"make_vocab_size_divisible_by must be >= 1, got {self.make_vocab_size_divisible_by}")
        if self.max_position_embeddings is not None and int(self.max_position_embeddings) < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        for f in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= float(getattr(self, f)) < 1.0:
                raise ValueError(f"{f} must be in [0, 1), got {getattr(self, f)}")
        if self.kv_channels is not None:
            if int(self.kv_channels) < 1:
                raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        elif self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads}); valid hidden_size: multiples of "
                             f"{self.num_attention_heads}, or give kv_channels")
        if isinstance(self.window_attn_skip_freq, list):
            object.__setattr__(self, "window_attn_skip_freq", tuple(self.window_attn_skip_freq))
        try:
            check_window(self.window_size, self.window_attn_skip_freq, self.num_layers)
        except WindowFlagError as e:
            raise ValueError(str(e).replace("--window-size", "window_size").replace(
                "--window-attn-skip-freq", "window_attn_skip_freq").replace("--num-layers", "num_layers")) from None
        self._check_moe()
        if self.num_attention_heads % self.num_query_groups:
            groups = ", ".join(str(g) for g in range(1, self.num_attention_heads + 1) if self.num_attention_heads % g == 0)
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.num_query_groups}); valid num_query_groups: {groups}")

    def _check_moe(self) -> None:
        """Megatron's rules on the MoE fields (one-line ValueErrors naming the field and its range)."""
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.num_experts is None:
            for f in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
                if getattr(self, f) is not None:
                    raise ValueError(f"{f} needs num_experts (a mixture-of-experts model); valid: leave it out")
            if self.moe_layer_freq != 1:
                raise ValueError("moe_layer_freq needs num_experts (a mixture-of-experts model); valid: leave it out")
            return
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq < 1:
                raise ValueError(f"moe_layer_freq {freq} is outside [1, inf) (N: every N-th layer is a MoE layer)")
        elif not isinstance(freq, tuple) or any(type(x) is not int or x not in (0, 1) for x in freq) or not any(freq):
            raise ValueError("moe_layer_freq: an integer N >= 1 or one 0/1 entry per layer (1: a MoE layer), at least "
                             "one 1")
        elif len(freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries for num_layers {self.num_layers}; valid: one per "
                             f"layer")
        if int(self.num_experts) < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= int(self.moe_router_topk) <= int(self.num_experts):
            raise ValueError(f"moe_router_topk must be in [1, num_experts={self.num_experts}], got "
                             f"{self.moe_router_topk}")
        for f in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, f) is not None and int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.add_bias_linear:
            raise ValueError("add_bias_linear with num_experts: the cost model prices experts without linear biases "
                             "(Mixtral, Qwen3-MoE); valid: add_bias_linear false")

    @property
    def is_moe(self) -> bool:
        """True when every layer's MLP is a mixture of experts (``num_experts``)."""
        return self.num_experts is not None

    @functools.cached_property
    def moe_layer_pattern(self) -> tuple[int, ...]:
        """One 0/1 per layer, 1 for a MoE layer (Megatron's rule of --moe-layer-freq); all 0 in a dense model.
        Kept on the instance (its fields are frozen; the search asks for it tens of thousands of times)."""
        if not self.is_moe:
            return (0,) * self.num_layers
        freq = self.moe_layer_freq
        return freq if isinstance(freq, tuple) else tuple(int(i % freq == 0) for i in range(self.num_layers))

    @functools.cached_property
    def moe_layers(self) -> int:
        """How many layers are MoE layers."""
        return sum(self.moe_layer_pattern)

    @functools.cached_property
    def mixed_moe(self) -> bool:
        """A MoE model with dense layers between its MoE layers: priced per layer kind (:meth:`dense_variant`,
        :meth:`moe_variant`)."""
        return self.is_moe and self.moe_layers < self.num_layers

    def dense_variant(self) -> "ModelSpec":
        """The same model with every layer dense (a mixed model's dense layers); one instance per model."""
        return self._variants[0]

    def moe_variant(self) -> "ModelSpec":
        """The same model with every layer a MoE layer (a mixed model's MoE layers); one instance per model."""
        return self._variants[1]

    @functools.cached_property
    def _variants(self) -> tuple["ModelSpec", "ModelSpec"]:
        return (dataclasses.replace(self, num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
                                    moe_shared_expert_intermediate_size=None, moe_layer_freq=1),
                dataclasses.replace(self, moe_layer_freq=1))

    @property
    def moe_layer_fraction(self) -> float:
        """The share of MoE layers (the weight of a mixed model's MoE layer in its average layer)."""
        return self.moe_layers / self.num_layers

    @property
    def expert_ffn_hidden_size(self) -> int:
        """f_e: one expert's MLP width (``moe_ffn_hidden_size``, else ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size

    @property
    def expert_fc1_width(self) -> int:
        """Output width of one expert's FC1: 2 f_e with SwiGLU, f_e with GeLU."""
        return (2 if self.swiglu else 1) * self.expert_ffn_hidden_size

    @property
    def dense_ffn_hidden_size(self) -> int:
        """Width of the MLP split over the tensor-parallel ranks like attention: ``ffn_hidden_size`` in a dense
        model, the shared expert's in a MoE model (0 without one)."""
        if not self.is_moe:
            return self.ffn_hidden_size
        return self.moe_shared_expert_intermediate_size or 0

    @property
    def attention_params_per_layer(self) -> int:
        """GEMM weights of one layer's attention: QKV (h x (q + 2 h_kv)) and the projection (q x h)."""
        h, q, hkv = self.hidden_size, self.query_hidden_size, self.kv_hidden_size
        return 2 * h * q + 2 * h * hkv

    @property
    def dense_mlp_params_per_layer(self) -> int:
        """GEMM weights of the tensor-parallel MLP of one layer (the dense MLP, or a MoE model's shared expert)."""
        return (3 if self.swiglu else 2) * self.hidden_size * self.dense_ffn_hidden_size

    @property
    def expert_params(self) -> int:
        """GEMM weights of one routed expert (FC1 and FC2)."""
        return (3 if self.swiglu else 2) * self.hidden_size * self.expert_ffn_hidden_size

    @property
    def router_params_per_layer(self) -> int:
        """The router's weight (E x h), whole on every rank (0 in a dense model)."""
        return self.num_experts * self.hidden_size if self.is_moe else 0

    @property
    def active_params_per_layer(self) -> int:
        """GEMM weights one token passes through in one layer: attention, the tensor-parallel MLP and k routed
        experts (Megatron-LM's FLOPs convention, ``num_floating_point_operations``: the router is not counted);
        :attr:`params_per_layer` in a dense model."""
        if self.mixed_moe:  # the average layer of the pattern
            phi = self.moe_layer_fraction
            return (1 - phi) * self.dense_variant().active_params_per_layer + phi * self.moe_variant().active_params_per_layer
        routed = self.moe_router_topk * self.expert_params if self.is_moe else 0
        return self.attention_params_per_layer + self.dense_mlp_params_per_layer + routed

    @property
    def head_dim(self) -> int:
        """The head dimension d: ``kv_channels``, else h / heads (left None, it follows h through
        ``dataclasses.replace``)."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def windowed_layers(self) -> int:
        """Layers that attend through the sliding window (0 without --window-size)."""
        return windowed_layer_count(self.window_size, self.window_attn_skip_freq, self.num_layers)

    def attended_pairs_per_layer(self, seq_length: int) -> float:
        """Score pairs of one head in an average layer: the windowed layers' band and the others' causal triangle,
        weighted by their counts (:func:`h3t_ext.attention_window.attended_pairs`)."""
        w = self.windowed_layers
        full = attended_pairs(seq_length)
        if w == 0:
            return full
        return (w * attended_pairs(seq_length, self.window_size) + (self.num_layers - w) * full) / self.num_layers

    @property
    def query_hidden_size(self) -> int:
        """Width of the queries and of the attention's output (the projection's input): heads x d (h by default)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_hidden_size(self) -> int:
        """h_kv = num_query_groups * d."""
        return self.num_query_groups * self.head_dim

    @property
    def fc1_width(self) -> int:
        """Output width of the tensor-parallel MLP's FC1: 2f with SwiGLU, f with GeLU (f the
        :attr:`dense_ffn_hidden_size`: a MoE model's shared expert)."""
        return (2 if self.swiglu else 1) * self.dense_ffn_hidden_size

    @property
    def params_per_layer(self) -> int:
        """GEMM weights one layer holds: QKV (h x (q + 2 h_kv)) + projection (q x h) + MLP (norm weights excluded;
        see layer_params); q = :attr:`query_hidden_size`. A MoE layer's MLP is its shared expert, its E experts
        and its router."""
        moe = self.num_experts * self.expert_params + self.router_params_per_layer if self.is_moe else 0
        return self.attention_params_per_layer + self.dense_mlp_params_per_layer + moe

    def bias_params_per_layer(self, tensor_model_parallel_size: int = 1) -> int:
        """Linear biases of one layer on one tensor-parallel rank: QKV's and FC1's are split with their
        columns, the projection's and FC2's (added after the row-parallel reduction) are whole on every rank."""
        if not self.add_bias_linear:
            return 0
        column = self.query_hidden_size + 2 * self.kv_hidden_size + self.fc1_width
        return column // tensor_model_parallel_size + 2 * self.hidden_size

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: its weight, and its bias with LayerNorm."""
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden_size

    @property
    def qk_norm_params(self) -> int:
        """Parameters of one layer's q and k norms (--qk-layernorm: d weights each, and d biases with LayerNorm;
        0 without)."""
        return 2 * (2 if self.normalization == "LayerNorm" else 1) * self.head_dim if self.qk_layernorm else 0

    @property
    def layer_norm_params(self) -> int:
        """Parameters of the norms of one layer: the two of the residual branches and the q and k norms."""
        return 2 * self.norm_params + self.qk_norm_params

    @property
    def rotates_qk(self) -> bool:
        """Whether every layer applies RoPE to q and k."""
        return self.position_embedding_type == "rope"

    def position_embedding_params(self, seq_length: int) -> int:
        """Parameters of the learned position table (0 without one): ``max_position_embeddings`` (default
        ``seq_length``) rows of h, whole on every tensor-parallel rank of the first stage."""
        if self.position_embedding_type != "learned_absolute":
            return 0
        return (self.max_position_embeddings or seq_length) * self.hidden_size

    def layer_params_per_rank(self, tensor_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None) -> int:
        """All parameters of one layer on one rank: :meth:`dense_layer_params_per_rank` and
        :meth:`expert_layer_params_per_rank`."""
        return self.dense_layer_params_per_rank(tensor_model_parallel_size) + self.expert_layer_params_per_rank(
            expert_model_parallel_size, tensor_model_parallel_size if expert_tensor_parallel_size is None
            else expert_tensor_parallel_size)

    def dense_layer_params_per_rank(self, tensor_model_parallel_size: int = 1) -> int:
        """Parameters of one layer on one tensor-parallel rank outside its routed experts: the shard of its
        attention's and tensor-parallel MLP's GEMM weights, its biases (:meth:`bias_params_per_layer`), its norms and
        a MoE layer's router (replicated). Their gradients are reduced over the data-parallel group."""
        t = tensor_model_parallel_size
        return ((self.attention_params_per_layer + self.dense_mlp_params_per_layer) // t
                + self.bias_params_per_layer(t) + self.layer_norm_params + self.router_params_per_layer)

    def expert_layer_params_per_rank(self, expert_model_parallel_size: int = 1,
                                     expert_tensor_parallel_size: int = 1) -> int:
        """Routed-expert parameters of one layer on one rank: E / ep experts, each split over the etp expert
        tensor-parallel ranks (0 in a dense model). Their gradients are reduced over the expert data-parallel group
        (:func:`h3t_ext.costmodel.moe.expert_data_parallel_size`)."""
        if not self.is_moe:
            return 0
        return self.num_experts // expert_model_parallel_size * self.expert_params // expert_tensor_parallel_size

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """V padded to a multiple of ``make_vocab_size_divisible_by`` x t (Megatron's rule)."""
        q = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // q) * q

    @property
    def num_parameters(self) -> int:
        """Total parameters (unpadded vocabulary)."""
        emb = self.vocab_size * self.hidden_size
        out = emb if self.untie_embeddings_and_output_weights else 0
        moe = self.moe_layers
        layers = (moe * self.moe_variant().layer_params_per_rank()
                  + (self.num_layers - moe) * self.dense_variant().layer_params_per_rank()) if self.mixed_moe \
            else self.num_layers * self.layer_params_per_rank()
        return layers + emb + out + self.norm_params \
            + self.position_embedding_params(self.max_position_embeddings or 0)


@functools.lru_cache(maxsize=1)
def _models() -> dict[str, dict]:
    return {k: v for k, v in read_json(DATA_DIR / "models.json")["models"].items()}


def list_models() -> list[str]:
    """Names of the models in ``models.json``."""
    return sorted(_models())


def get_model(name: str) -> ModelSpec:
    """The model ``name`` from the zoo; raises UnknownNameError listing valid names."""
    entry = _models().get(name.lower())
    if entry is None:
        raise UnknownNameError("model", name, list_models())
    fields = {k: v for k, v in entry.items() if k != "source"}
    return ModelSpec(name=name.lower(), **fields)




__all__ = ["DATA_DIR", "NCCL_COMMUNICATORS_IN_USE", "NORMALIZATIONS", "POSITION_EMBEDDING_TYPES", "REFERENCE_DIR",
           "ModelSpec", "SystemSpec", "get_model", "get_system", "list_models", "list_systems", "load_system_file",
           "memory_budget_from_first_principles", "read_json", "reference_json", "system_file_dict",
           "system_from_dict"]
