"""How much GPU and host memory a fastalign training run needs, term by term, and what to change to fit.

Everything is derived from the model's shapes and from what the engine actually keeps (read from
``fastalign/train``), per GPU, in bytes. Notation: P parameters, L decoder layers, h hidden size,
i intermediate size, q = heads·head_dim, kv = kv_heads·head_dim, V vocabulary, T = batch_size·seq_len
tokens per GPU, N GPUs, r the LoRA rank.

What the engine keeps (``fastalign.train.loading`` / ``policy`` / ``run`` / ``distributed``):

* **Weights.** Models are loaded in fp32 (TRL's default, ``base_dtype='fp32'``) and stay fp32 — full
  fine-tuning *and* the frozen base of LoRA: 4·P. There is no separate fp32 master copy: the fp32
  parameters are the master weights. Loaded in bf16 (``TrainConfig.dtype: bfloat16``,
  ``base_dtype='bf16'``): 2·P, a bf16 residual stream, no weight casts; full fine-tuning then keeps bf16
  gradients and AdamW state.
  Single process + bf16: ``torch.autocast`` over the fp32 weights. FSDP2 (N > 1): fp32 *sharded*
  parameters, bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).
  QLoRA: decoder-layer linear weights in NF4, 4 bits + absmax overhead (blocksize 64: fp32 absmax is
  32/64 = 0.5 bit/param; double quantization stores it in 8 bits plus one fp32 per 256 blocks:
  8/64 + 32/(64·256) = 0.127 bit/param); embeddings, ``lm_head`` and norms stay bf16 (bitsandbytes
  skips the head); adapters fp32.
* **LoRA** on every linear layer of the decoder layers (peft's 'all-linear'): r·(in + out) per layer,
  fp32, trained with AdamW.
* **Gradients** fp32 for the trainable parameters (4 B each); **AdamW** keeps fp32 m and v (8 B each).
* **Sharding** (N > 1, FSDP2 per layer + root): weights, LoRA parameters, gradients and optimizer state
  are divided by N. Not sharded: activations (data parallel: every GPU has its own T tokens), the loss
  head, the working copies below, the CUDA context.
* **Working copies** (``weight_copies``). Single-process bf16 with fastalign's kernels (the default):
  each linear layer casts its weight to bf16 in forward and again in backward
  (``fastalign.ops.autocast_linear``), so one layer's cast is alive at a time, plus the head's bf16
  cast and, for LoRA, the adapters' casts. Without them (``fused_loss_head=False``, SFT without
  ``use_liger_kernel``), full: autocast caches a bf16 copy of every trainable weight it casts for the
  whole forward (2 B × the layers' linear weights) plus the head's bf16 cast; LoRA: the bf16 casts of
  the frozen weights are saved for backward (all layers; one layer under checkpointing) plus the
  adapters' cached casts. QLoRA: one linear weight dequantized to bf16
  at a time, plus the adapters' casts. FSDP2: the root unit (embeddings, final norm, head) stays gathered
  in bf16 through forward and backward; up to two layer units are gathered at a time (computing +
  prefetching), each with, for trainable weights, its unsharded bf16 gradient and the fp32 copy that
  is reduce-scattered.

Activations saved by one Llama-style decoder layer, per token (SDPA / flash attention: no [s, s]
scores; native grouped-query attention: k and v of width kv). ``a`` is the compute dtype's bytes
(2 in bf16), ``x`` the residual stream's (4 with fp32 weights under autocast, 2 with bf16 weights,
i.e. FSDP2, QLoRA or a bf16 base), ``c`` = 1 when each linear casts its fp32 input to bf16 itself
(autocast over an fp32 residual stream, the model's own code), else 0. Patched (fastalign's kernels,
``fused_loss_head=True``, as the engine runs with ``use_liger_kernel``, its default) or the model's own
code (``fused_loss_head=False``; a preference objective without ``use_liger_kernel`` patches only the
head, and saves as the model's own code does)::

    norm (each of 2)  patched: x·h + 4    its input + 1/rms (on CPU 1/rms is recomputed: x·h)
                      own: 4h + 4         fp32 upcast of its input + 1/rms
                      + x·h               (trainable norm weight: the normalized input)
    attention         a·(2q + 2kv) + 4·heads     q, k, v after RoPE, the output; fp32 logsumexp
    MLP               patched: 2·a·i     gate and up outputs (SiLU and the product recomputed)
                      own, full: 4·a·i   gate output (SiLU input), SiLU output, up output, down input
                      own, LoRA: 3·a·i   (the frozen down_proj does not save its input)
    linear inputs     full: a·h·(5 if c else 2)   q/k/v and gate/up inputs (o_proj reads the attention
                                                  output, down_proj the MLP product: counted above;
                                                  patched: q/k/v, gate/up share one cast: a·2h)
                      LoRA: per adapter, its input again as lora_A saves it — the dropout output or
                      autocast's cast: Σ_in·(a' + m) + 7·r·a', m the dropout mask (1 B bool on CUDA, the
                      input's dtype on CPU, 0 without dropout); without dropout and casts the adapters
                      share the layer's tensors: a·(2h + i) + 7·r·a

e.g. bf16 full fine-tuning under FSDP2, patched: 8h + 8 + 2·(2q + 2kv) + 4·heads + 4i bytes/token/layer.
Tests check this against the tensors autograd saves in a tiny Llama layer, for full/LoRA, fp32,
autocast and bf16 weights, patched and not, and the totals against H100 measurements. Once per model:
RoPE's cos/sin (2·head_dim·x) and the final norm.

Checkpointing keeps each layer's input (x·h per token) and recomputes one layer at a time in backward:
L·x·h + S. Offloading moves what the layers save to pinned host memory; the device keeps the copies
in flight, about two layers' worth (``fastalign.train.memory.ActivationOffloader``): 2·S, or 2·x·h
with checkpointing, + S recomputed. Host: L·S or L·x·h.

Loss head: fastalign's fused head walks the tokens in chunks sized by the head workspace budget
(``fastalign.ops.head_workspace``: 256 MiB on CUDA, 32 MiB on CPU, or ``FASTALIGN_HEAD_WORKSPACE_MIB``;
``_loss_head_chunk`` takes its rows from the ops' own ``chunk_rows``) and forms the gradients during
the forward: one chunk + the gradient of
the hidden states (T·h·a) + 6 fp32 statistics per token + an fp32 accumulator of the head's weight
gradient (4·V·h) when a trainable head runs in bf16. A materialized head (HF's own loss: SFT without
``use_liger_kernel``) holds at least the fp32 logits [T, V] and their gradient: 8·T·V.

CUDA context: 0.75 GiB assumed (context, cuBLAS workspace, kernel images: 0.5-1 GiB depending on GPU,
driver and libraries; invisible to ``torch.cuda.max_memory_allocated``).

Host RAM per process: the pinned buffers of offloaded activations, or the CPU copy of the model at load
time (fp32, built by ``from_pretrained`` before ``.to(device)``), whichever is larger: loading is over
before training starts. ``host_total`` is that times N (all ranks).

The total per GPU is the sum of the terms. That is the peak with gradient accumulation (gradients
persist while the next micro-batch's forward builds its activations and weight copies); with a single
micro-batch per step it is an upper bound, as the backward frees activations while it allocates
gradients. Allocator fragmentation (typically a few %) is not included.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal

from transformers import PretrainedConfig

from fastalign.ops.head_workspace import accumulator_budget, chunk_rows, head_workspace_bytes
from fastalign.plan.shapes import ModelShape, PlanError, resolve_model, shape_from_config

Method = Literal[
    "full", "lora", "qlora", "ppo", "ppo-lora", "ppo-qlora",
    "distill-offline", "distill-offline-lora", "distill-offline-qlora",
]  # fmt: skip
#: PPO's plans (``_ppo_plan``), each with the fine-tuning method of its policy: separate models, or one base
#: model under LoRA / QLoRA.
PPO_METHODS = {"ppo": "full", "ppo-lora": "lora", "ppo-qlora": "qlora"}
#: Offline distillation (``train distill --teacher_logprobs_path``): the student trained against stored
#: teacher top-k log-probs, no teacher in memory; each method with its student's fine-tuning method (in
#: full, or LoRA / QLoRA adapters: ``use_peft``, ``quantization``).
DISTILL_OFFLINE = "distill-offline"
DISTILL_OFFLINE_METHODS = {
    DISTILL_OFFLINE: "full",
    "distill-offline-lora": "lora",
    "distill-offline-qlora": "qlora",
}
METHODS: tuple[str, ...] = ("full", "lora", "qlora", *PPO_METHODS, *DISTILL_OFFLINE_METHODS)
#: The methods the suggestions step through, cheapest last: a plan stays on its own ladder.
_LADDERS = (("full", "lora", "qlora"), tuple(PPO_METHODS), tuple(DISTILL_OFFLINE_METHODS))
#: Methods that run in one process only (PPO's policy and critic adapters share one model).
_ONE_PROCESS = ("ppo-lora", "ppo-qlora")

GiB = 2**30
#: The share of the GPU's memory that ``keep_on_device: auto`` fills (``fastalign plan`` and training's
#: ``activation_offloading_keep_on_device: auto`` alike): the planner came out up to 8% under the H100's
#: measured peaks of offloaded steps (docs/memory.md), and too many layers kept is an out-of-memory error
#: mid-run, too few only some PCIe traffic.
AUTO_KEEP_SHARE = 0.92
#: CUDA context + cuBLAS workspace + kernel images, per process (0.5-1 GiB in practice).
CUDA_CONTEXT_BYTES = 3 * GiB // 4
#: Units of ``--gpu-memory``: binary (JEDEC), as GPU memory is sold: a 24GB card has 24 GiB.
_UNITS = {"": GiB, "b": 1, "k": 2**10, "m": 2**20, "g": GiB, "t": 2**40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt]?)(i?b)?)?\s*$", re.IGNORECASE)
#: Dtypes the model can be loaded in (``TrainConfig.dtype``): fp32 is TRL's default.
BASE_DTYPES = ("fp32", "bf16")
#: GPU counts the suggestions try, as multiples of the current one.
_MAX_GPUS = 1024


def parse_memory(text: str, option: str = "gpu_memory_bytes") -> int:
    """Bytes of '24GB', '80GiB', '141 GB', '81559MiB', '1.5T', '512' (GiB when no unit); a bad ``text``
    raises ``PlanError`` naming ``option``.

    Units are binary (JEDEC: 1 GB = 2**30 bytes), as GPU memory is sold.
    """
    match = _MEMORY.match(str(text))
    if not match or (match.group(3) and match.group(3).lower() == "ib" and not match.group(2)):
        raise PlanError(option, f"cannot parse {text!r} (e.g. 24GB, 80GiB, 81559MiB)")
    unit = (match.group(2) or "").lower() or ("b" if match.group(3) else "")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise PlanError(option, f"must be positive, got {text!r}")
    return value


def format_bytes(n: int) -> str:
    """1 decimal MiB/KiB, 2 decimals GiB: '31.94 GiB', '12.0 MiB', '0 B'."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n} B"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _shard(n: int, gpus: int) -> int:
    return -(-n // gpus)


@dataclass(frozen=True)
class Term:
    """One row of the plan: bytes per GPU and in host RAM (per process), and how they arise."""

    name: str
    label: str
    gpu_bytes: int
    host_bytes: int
    sharded: bool
    how: str


@dataclass(frozen=True)
class _Request:
    """What a plan is asked for: the model's name and the ``plan_memory`` flags (which ``_suggest``
    varies). The first fields of a ``MemoryPlan``, and of the ``_Setup`` its terms are computed from."""

    model: str
    method: str
    gpus: int
    seq_len: int
    batch_size: int
    checkpointing: bool
    offload_activations: bool
    keep_on_device: int | str
    lora_r: int
    lora_dropout: float
    bf16: bool
    base_dtype: str
    device: str
    fused_loss_head: bool
    double_quant: bool
    gpu_memory_bytes: int
    tiled_mlp_mib: float
    host_memory_bytes: int | None


_FLAGS = tuple(f.name for f in fields(_Request) if f.name != "model")


def _flags(request: _Request) -> dict:
    """The ``plan_memory`` keyword arguments of a request (or of the plan made for it)."""
    return {name: getattr(request, name) for name in _FLAGS}


@dataclass(frozen=True)
class MemoryPlan(_Request):
    """Memory of one training configuration, per GPU and per process on the host, in bytes.

    The per-GPU terms add up to ``total_per_gpu``; ``fits`` compares it with ``gpu_memory_bytes``, and
    where ``host_memory_bytes`` is given, ``host_total`` with what offloading may take of it (``host_fits``);
    ``suggestions`` are flag changes (applied together) that make it fit, cheapest first, with the
    resulting total in ``suggested_total_per_gpu``.
    """

    params: int
    trainable_params: int
    # per GPU
    weights: int
    lora_params: int
    gradients: int
    optimizer: int
    weight_copies: int
    activations: int
    loss_head: int
    cuda_context: int
    total_per_gpu: int
    # host, per process
    activations_host: int
    model_load_host: int
    host_per_process: int
    host_total: int
    # for reference
    layer_activation_bytes_per_token: int
    layer_input_bytes_per_token: int
    loss_head_fused: int
    loss_head_materialized: int
    fits: bool
    terms: list[Term]
    suggestions: list[str] = field(default_factory=list)
    suggested_total_per_gpu: int | None = None
    notes: list[str] = field(default_factory=list)
    #: With offloading: the decoder layers whose saved tensors stay on the GPU (the last ones, which
    #: backward reaches first), the most that still fit (``enable_activation_offloading(keep_on_device=)``).
    offload_keep_on_device: int = 0
    # PPO's other roles, per GPU (0 for the other methods)
    critic: int = 0
    reference: int = 0
    #: distill-offline methods: disk per completion token of the teacher's stored top-k (0 for the others)
    teacher_logprobs_bytes_per_token: int = 0
    #: ``host_total`` within ``usable_host_bytes(host_memory_bytes)`` (True where no host memory is given)
    host_fits: bool = True

    @property
    def training_state_bytes(self) -> int:
        """What training adds on top of the loaded model: all but weights, adapters and CUDA context."""
        return self.total_per_gpu - self.weights - self.lora_params - self.cuda_context

    def to_dict(self) -> dict:
        """Plain JSON-able data (``--json``): every field, terms as a list of objects."""
        return asdict(self)


@dataclass(frozen=True)
class _Regime:
    """Dtypes and code paths of one configuration (see the module docstring)."""

    sharded: bool  # FSDP2
    autocast: bool  # single-process bf16
    residual: int  # bytes of the residual stream
    compute: int  # bytes of bf16/fp32 activations
    casts: bool  # each linear casts its own fp32 input (autocast over an fp32 residual stream)
    adapter: int  # bytes of the adapters' dtype during compute
    mask: int  # bytes per element of a dropout mask
    patched: bool  # fastalign's kernels (``use_liger_kernel``): fused norms and MLP activation
    rstd: int  # bytes per row a fused norm keeps besides its input (its 1/rms; 0 on CPU: recomputed)


def residual_stream_bytes(method: str, gpus: int, bf16: bool, base_dtype: str) -> int:
    """Bytes per element of the residual stream (what checkpointing keeps of each layer): bf16 weights,
    or ``bf16`` under FSDP2 (its mixed precision casts the weights) or QLoRA, make it 2; fp32 weights on
    one GPU (autocast, which leaves the stream in fp32), 4. Activation offloading sizes its host check
    with the same number (``fastalign.train.memory.enable_activation_offloading(residual_bytes=)``)."""
    return 2 if base_dtype == "bf16" or (bf16 and (gpus > 1 or method == "qlora")) else 4


def _regime(
    method: str, gpus: int, bf16: bool, base_dtype: str, device: str, lora_dropout: float, patched: bool
) -> _Regime:
    sharded, autocast = gpus > 1, bf16 and gpus == 1
    bf16_base = base_dtype == "bf16"
    compute = 2 if bf16 or bf16_base else 4
    residual = residual_stream_bytes(method, gpus, bf16, base_dtype)
    adapter = 2 if sharded and bf16 else 4
    mask = 0 if lora_dropout == 0 else (1 if device == "cuda" else adapter)
    rstd = 4 if device == "cuda" else 0
    return _Regime(
        sharded, autocast, residual, compute, autocast and residual == 4, adapter, mask, patched, rstd
    )


def _layer_activation_bytes(shape: ModelShape, method: str, regime: _Regime, lora_r: int) -> int:
    """Bytes one decoder layer saves for backward, per token (formula in the module docstring)."""
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    a, x, full = regime.compute, regime.residual, method == "full"
    heads = shape.num_heads + shape.num_kv_heads
    if regime.patched:  # the fused norm keeps its input and 1/rms, nothing per weight
        norms = shape.norms_per_layer * (x * h + regime.rstd)
        norms += (q + kv) * a + regime.rstd * heads if shape.qk_norm else 0
    else:
        norms = shape.norms_per_layer * (4 * h + 4 + (x * h if full else 0))
        if shape.qk_norm:  # per-head norms of q and k: fp32 upcast, 1/rms, (normalized when trained)
            norms += (q + kv) * (4 + (a if full else 0)) + 4 * heads
    attention = a * (2 * q + 2 * kv) + 4 * shape.num_heads
    linears = shape.linears()
    norm_fed = [fan_in for name, fan_in, _ in linears if name not in ("o_proj", "down_proj")]
    if full:  # fused: gate and up only (SiLU and the product recomputed); q/k/v (gate/up) share one cast
        mlp = (2 if regime.patched else 4) * a * i
        inputs = a * (sum(norm_fed) if regime.casts and not regime.patched else 2 * h)
    else:
        mlp = (2 if regime.patched else 3) * a * i
        own_copy = 2 if regime.autocast else regime.adapter
        if regime.mask == 0 and not regime.autocast and regime.adapter == x:  # adapters share the inputs
            inputs = a * (2 * h + i) + len(linears) * lora_r * a
        else:
            inputs = sum(fan_in for _, fan_in, _ in linears) * (own_copy + regime.mask)
            inputs += len(linears) * lora_r * own_copy
    return norms + attention + mlp + inputs


def _mlp_activation_bytes(shape: ModelShape, method: str, regime: _Regime, lora_r: int) -> int:
    """The part of ``_layer_activation_bytes`` the gated MLP saves, per token: gate and up (the fused
    activation's inputs), and the inputs its gate/up/down projections (and their adapters) keep. A tiled
    MLP (``fastalign.ops.tiled``) keeps none of it, only its own input."""
    h, i, a = shape.hidden_size, shape.intermediate_size, regime.compute
    if method == "full":
        return (2 if regime.patched else 4) * a * i + a * h  # + gate/up's shared cast of the normed input
    mlp = (2 if regime.patched else 3) * a * i
    own_copy = 2 if regime.autocast else regime.adapter
    if regime.mask == 0 and not regime.autocast and regime.adapter == regime.residual:
        return mlp + a * (h + i) + 3 * lora_r * a
    return mlp + (2 * h + i) * (own_copy + regime.mask) + 3 * lora_r * own_copy


def _quantized_bytes(params: int, double_quant: bool) -> int:
    """NF4: 4 bits per weight + absmax per block of 64 (fp32, or 8-bit + fp32 per 256 blocks)."""
    blocks = -(-params // 64)
    absmax = blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks
    return -(-params // 2) + absmax


@dataclass(frozen=True)
class _Setup(_Request):
    """One configuration to plan: the request with the model's shapes, and the quantities that several
    terms read."""

    shape: ModelShape
    keep: int = 0  # offloading: the last layers whose saved tensors stay on the GPU

    @functools.cached_property
    def regime(self) -> _Regime:
        return _regime(
            self.method,
            self.gpus,
            self.bf16,
            self.base_dtype,
            self.device,
            self.lora_dropout,
            self.fused_loss_head,
        )

    @property
    def full(self) -> bool:
        return self.method == "full"

    @property
    def tokens(self) -> int:
        """Tokens per GPU and micro-batch."""
        return self.batch_size * self.seq_len

    @functools.cached_property
    def lora_count(self) -> int:
        return 0 if self.full else self.shape.lora_params(self.lora_r)

    @property
    def trainable(self) -> int:
        return self.shape.params if self.full else self.lora_count

    @property
    def nonlinear_bytes(self) -> int:
        """Bytes per weight of what QLoRA does not quantize: embeddings, head, norms, biases."""
        return 2 if self.bf16 or self.base_dtype == "bf16" else 4

    @property
    def base_bytes(self) -> int:
        """Bytes per weight of the model as loaded (``base_dtype``): 4 in fp32, 2 in bf16."""
        return 2 if self.base_dtype == "bf16" else 4

    @property
    def offload(self) -> bool:
        """Whether activations really move to the host (on CPU they are there already)."""
        return self.offload_activations and self.device == "cuda"

    @functools.cached_property
    def layer_activations(self) -> int:
        """Bytes one decoder layer saves for backward, per token: tiled, its MLP keeps only its input."""
        shape = self.shape.activation_shape
        saved = _layer_activation_bytes(shape, self.method, self.regime, self.lora_r)
        if self.tiled_mlp_mib:  # the tile's input: the normed residual stream, in its dtype
            saved += self.regime.residual * shape.hidden_size - _mlp_activation_bytes(
                shape, self.method, self.regime, self.lora_r
            )
        return saved

    @property
    def mlp_tile_bytes(self) -> int:
        """The tiled MLP's working set, held once (by the layer running or being recomputed)."""
        return int(self.tiled_mlp_mib * 2**20)

    @property
    def layer_input(self) -> int:
        """Bytes of one layer's input per token: what checkpointing keeps."""
        return self.regime.residual * self.shape.hidden_size


def plan_memory(
    config: PretrainedConfig | ModelShape | str,
    *,
    method: Method = "full",
    gpus: int = 1,
    seq_len: int = 4096,
    batch_size: int = 1,
    checkpointing: bool = False,
    offload_activations: bool = False,
    keep_on_device: int | Literal["auto"] = "auto",
    lora_r: int = 16,
    lora_dropout: float = 0.05,
    gpu_memory_bytes: int = 80 * GiB,
    bf16: bool = True,
    base_dtype: Literal["fp32", "bf16"] = "fp32",
    device: Literal["cuda", "cpu"] = "cuda",
    fused_loss_head: bool = True,
    double_quant: bool = True,
    tiled_mlp_mib: float = 0,
    host_memory_bytes: int | None = None,
    suggest: bool = True,
    top_k: int | None = None,
    tail_samples: int | None = None,
) -> MemoryPlan:
    """Plan the memory of training ``config`` (a HF config, a ``ModelShape``, or a built-in shape name /
    local config.json path) with ``method`` on ``gpus`` GPUs of ``gpu_memory_bytes`` each.

    ``batch_size`` sequences of ``seq_len`` tokens per GPU and micro-batch. ``bf16``: mixed precision as
    the engine does it (``TrainConfig.bf16``); ``base_dtype``: the dtype the model is loaded in
    (``TrainConfig.dtype``): fp32 (TRL's and the engine's default) or bf16 (a frozen LoRA base at half the
    bytes; full fine-tuning then trains bf16 weights with bf16 gradients and AdamW state; QLoRA: the
    unquantized rest). ``device='cpu'``: no CUDA context, CPU chunk sizes, offloading is a no-op.
    ``fused_loss_head=True``: fastalign's kernels (``use_liger_kernel``, the default: fused norms, MLP
    activation and loss head); False: the model's own code, and the head builds [tokens, vocab] logits.
    ``keep_on_device``: with offloading, how many of the last decoder layers keep their saved tensors on
    the GPU (``enable_activation_offloading``); "auto": the most that fit (``offload_keep_on_device``).
    ``tiled_mlp_mib``: the gated MLPs run in token tiles of that working set (``TrainConfig.tiled_mlp``
    with ``tiled_mlp_budget_mib``; needs the fused kernels): a layer keeps only its MLP's input, and the
    tile's working set is held once; 0: untiled.
    ``host_memory_bytes``: the host RAM of the machine (all its GPUs' processes together); the plan then
    fits only where ``host_total`` stays within ``usable_host_bytes`` of it, the share training's own
    check gives offloading (``fastalign.train.memory``). None: the host is not checked.
    ``top_k``, ``tail_samples``: with a ``distill-offline`` method, the teacher's stored top-k (None: 32)
    and tail draws per token (None: 0), for the disk per token; no other method reads them, so setting
    them there is an error (a size that changed nothing would read as planned).
    ``suggest``: also search the cheapest flag changes that fit. Raises ``PlanError`` (a ``ValueError``
    naming the parameter) on bad input.
    """
    shape = _model_shape(config)
    if isinstance(tiled_mlp_mib, bool) or not isinstance(tiled_mlp_mib, (int, float)) or tiled_mlp_mib < 0:
        raise PlanError("tiled_mlp_mib", f"must be a working set in MiB (0: untiled), got {tiled_mlp_mib!r}")
    if tiled_mlp_mib and not fused_loss_head:
        raise PlanError("tiled_mlp_mib", "tiles the fused MLP: needs fused_loss_head (fastalign's kernels)")
    _validate(method, gpus, seq_len, batch_size, lora_r, lora_dropout, gpu_memory_bytes, device, base_dtype)
    if host_memory_bytes is not None and (
        isinstance(host_memory_bytes, bool) or not isinstance(host_memory_bytes, int) or host_memory_bytes < 1
    ):
        raise PlanError("host_memory_bytes", f"must be a positive integer or None, got {host_memory_bytes!r}")
    if checkpointing and method in _ONE_PROCESS:
        raise PlanError(
            "checkpointing",
            f"{method} trains two adapters of one model, where training refuses gradient checkpointing (a "
            "layer recomputed in backward would take whichever adapter is active then): plan without it",
        )
    if host_memory_bytes is not None and device == "cpu":
        raise PlanError(
            "host_memory_bytes",
            "with device 'cpu' every term is host memory: give the machine's memory as gpu_memory_bytes",
        )
    if method not in DISTILL_OFFLINE_METHODS:
        for name, value in (("top_k", top_k), ("tail_samples", tail_samples)):
            if value is not None:
                raise PlanError(
                    name,
                    f"applies to the methods {', '.join(DISTILL_OFFLINE_METHODS)} only (the stored teacher "
                    f"log-probs' disk), not {method!r}: remove it",
                )
    if keep_on_device != "auto" and (
        isinstance(keep_on_device, bool)
        or not isinstance(keep_on_device, int)
        or not 0 <= keep_on_device <= shape.num_layers
    ):
        raise PlanError(
            "keep_on_device", f"must be 'auto' or 0 to {shape.num_layers} layers, got {keep_on_device!r}"
        )
    flags = dict(
        method=method,
        gpus=gpus,
        seq_len=seq_len,
        batch_size=batch_size,
        checkpointing=checkpointing,
        offload_activations=offload_activations,
        keep_on_device=keep_on_device,
        lora_r=lora_r,
        lora_dropout=lora_dropout,
        bf16=bf16,
        base_dtype=base_dtype,
        device=device,
        fused_loss_head=fused_loss_head,
        double_quant=double_quant,
        gpu_memory_bytes=gpu_memory_bytes,
        tiled_mlp_mib=tiled_mlp_mib,
        host_memory_bytes=host_memory_bytes,
    )
    if method in PPO_METHODS:
        return _ppo_plan(shape, flags, suggest)
    if method in DISTILL_OFFLINE_METHODS:
        return _distill_offline_plan(
            shape, flags, suggest, 32 if top_k is None else top_k, 0 if tail_samples is None else tail_samples
        )
    setup = _Setup(model=shape.name, **flags, shape=shape)
    if setup.offload:
        setup = replace(setup, keep=_largest_keep(setup) if keep_on_device == "auto" else keep_on_device)
    terms = [
        _weights(setup),
        _lora_params(setup),
        _gradients(setup),
        _optimizer(setup),
        _weight_copies(setup),
        _activations(setup),
        _loss_head(setup),
        _cuda_context(setup),
        _model_load(setup),
    ]
    by_name = {term.name: term for term in terms}
    total = sum(term.gpu_bytes for term in terms)
    host = max(term.host_bytes for term in terms)  # loading is over before training starts
    host_fits = _host_fits(host * gpus, host_memory_bytes)
    plan = MemoryPlan(
        model=shape.name,
        **_flags(setup),
        params=shape.params,
        trainable_params=setup.trainable,
        # the per-GPU fields, named after their terms (the model load is host memory only)
        **{term.name: term.gpu_bytes for term in terms if term.name != "model_load"},
        total_per_gpu=total,
        activations_host=by_name["activations"].host_bytes,
        model_load_host=by_name["model_load"].host_bytes,
        host_per_process=host,
        host_total=host * gpus,
        layer_activation_bytes_per_token=setup.layer_activations,
        layer_input_bytes_per_token=setup.layer_input,
        loss_head_fused=_fused_loss_head_bytes(setup),
        loss_head_materialized=_materialized_loss_head_bytes(setup),
        fits=total <= gpu_memory_bytes and host_fits,
        terms=terms,
        offload_keep_on_device=setup.keep,
        host_fits=host_fits,
    )
    return _with_suggestions(shape, plan, _notes(plan, setup), suggest)


def host_margin(available: int) -> int:
    """What offloading leaves to everything else on the host (the data loader, the CPU copy of a
    checkpoint being written, the page cache): a tenth of what is available, at least 2 GiB."""
    return max(available // 10, 2 * GiB)


def usable_host_bytes(host_memory_bytes: int) -> int:
    """The host memory offloading may take: what there is, less ``host_margin``."""
    return host_memory_bytes - host_margin(host_memory_bytes)


def _host_fits(host_total: int, host_memory_bytes: int | None) -> bool:
    return host_memory_bytes is None or host_total <= usable_host_bytes(host_memory_bytes)


def _largest_keep(setup: _Setup) -> int:
    """The most layers whose saved tensors can stay on the GPU with offloading on, within
    ``AUTO_KEEP_SHARE`` of its memory: each kept layer adds its share to the device and saves the host as
    much (0 where even none kept does not fit)."""
    others = sum(
        term(setup).gpu_bytes
        for term in (
            _weights,
            _lora_params,
            _gradients,
            _optimizer,
            _weight_copies,
            _loss_head,
            _cuda_context,
        )
    )
    keep = setup.shape.num_layers
    room = AUTO_KEEP_SHARE * setup.gpu_memory_bytes
    while keep > 0 and others + _activations(replace(setup, keep=keep)).gpu_bytes > room:
        keep -= 1
    return keep


def _with_suggestions(shape: ModelShape, plan: MemoryPlan, notes: list[str], suggest: bool) -> MemoryPlan:
    if not suggest or plan.fits:
        return replace(plan, notes=notes)
    changes, fitting = _suggest(shape, plan)
    if not changes:
        notes.append(
            f"nothing on the ladder (checkpointing, offloading, LoRA, QLoRA, up to {_MAX_GPUS} GPUs, "
            "smaller micro-batches) fits: shorten --seq-len"
        )
    return replace(plan, suggestions=changes, suggested_total_per_gpu=fitting, notes=notes)


def _ppo_plan(shape: ModelShape, flags: dict, suggest: bool) -> MemoryPlan:
    """PPO (``fastalign/train/objectives/ppo.py``): the policy's plan under its method, plus what the
    critic and the reference add while the policy trains (the reward model, if ``reward_funcs`` names
    one, is a note).

    ``ppo``, separate models: the critic is a second model of the same shape (a [h → 1] value head for
    the LM head), trained in full: its weights, gradients and AdamW state, and, as its forward runs
    beside the policy's before their one backward, working copies and activations as the policy's; the
    reference is a frozen fp32 copy of the policy (4 B × P), sharded alike. ``ppo-lora`` / ``ppo-qlora``,
    one base model: the critic is a second adapter of the policy's shape and a value head (16 B per
    trained parameter), plus its forward's working copies and activations as the policy's; the reference
    is the base with the adapters off (no memory). The rollout's KV cache lives while no activations do
    (a note compares it)."""
    if flags["keep_on_device"] == "auto" and flags["offload_activations"] and flags["device"] == "cuda":
        # the critic's activations are as the policy's: the most kept layers that fit both within
        # AUTO_KEEP_SHARE of the GPU (bisection)
        low, high = 0, shape.num_layers
        room = AUTO_KEEP_SHARE * flags["gpu_memory_bytes"]
        while low < high:
            middle = (low + high + 1) // 2
            if _ppo_plan(shape, {**flags, "keep_on_device": middle}, suggest=False).total_per_gpu <= room:
                low = middle
            else:
                high = middle - 1
        flags = {**flags, "keep_on_device": low}
    method = flags["method"]
    policy = plan_memory(shape, **{**flags, "method": PPO_METHODS[method]}, suggest=False)
    h, gpus, separate = shape.hidden_size, flags["gpus"], method == "ppo"
    head = 0 if shape.tie_embeddings else shape.vocab_size * h
    critic_trained = shape.params - head + h if separate else policy.trainable_params + h
    state = _shard(16 * critic_trained, gpus)  # weights (LoRA: the adapter), gradients, AdamW m and v
    critic_how = (
        f"{'model' if separate else 'adapter + value head'}: 16 B × {_count(critic_trained)} trained "
        f"(weights, grads, AdamW){f' ÷ {gpus} (FSDP2)' if gpus > 1 else ''}; working copies and "
        "activations as the policy's"
    )
    # the critic's activations are offloaded as the policy's are (one base model: its forward runs
    # through the policy's hooked layers; separate models: the critic is prepared as the policy is)
    critic_host = policy.activations_host
    critic = Term(
        "critic",
        "critic",
        state + policy.weight_copies + policy.activations,
        critic_host,
        gpus > 1,
        critic_how,
    )
    if separate:
        w = 2 if flags["base_dtype"] == "bf16" else 4
        how = f"frozen {flags['base_dtype']} copy of the policy, {w} B × {_count(shape.params)}"
        how += f" ÷ {gpus} (FSDP2)" if gpus > 1 else ""
        reference = Term("reference", "reference", _shard(w * shape.params, gpus), 0, gpus > 1, how)
    else:
        reference = Term("reference", "reference", 0, 0, False, "the base with the adapters off")
    total = policy.total_per_gpu + critic.gpu_bytes + reference.gpu_bytes
    host = max(policy.activations_host + critic_host, policy.model_load_host)
    host_fits = _host_fits(host * gpus, flags["host_memory_bytes"])
    plan = replace(
        policy,
        method=method,
        trainable_params=policy.trainable_params + critic_trained,
        terms=[*policy.terms, critic, reference],
        total_per_gpu=total,
        activations_host=policy.activations_host + critic_host,
        host_per_process=host,
        host_total=host * gpus,
        host_fits=host_fits,
        fits=total <= flags["gpu_memory_bytes"] and host_fits,
        critic=critic.gpu_bytes,
        reference=reference.gpu_bytes,
    )
    kv_cache = 2 * shape.num_layers * shape.kv_dim * (2 if flags["bf16"] else 4) * policy.batch_size
    kv_cache *= policy.seq_len
    notes = [
        f"the rollout's KV cache ({format_bytes(kv_cache)} for {policy.batch_size} × {policy.seq_len} "
        "tokens) lives while no activations do: the training step is the peak",
        "a reward model in reward_funcs adds its weights on every GPU (the run's dtype, unsharded)",
    ]
    if separate:
        one_base = plan_memory(  # one GPU, no checkpointing: how that mode trains
            shape, **{**flags, "method": "ppo-lora", "gpus": 1, "checkpointing": False}, suggest=False
        )
        notes.append(
            "the one-base-model mode (--method ppo-lora: policy and critic adapters, the reference the "
            f"base; one GPU) needs {format_bytes(one_base.total_per_gpu)}"
        )
    return _with_suggestions(shape, plan, notes, suggest)


# --------------------------------------------------------------------------------------------------
# The terms, in the order of the plan's table (what each holds: the module docstring).


def _sharded(setup: _Setup, name: str, label: str, total_bytes: int, how: str) -> Term:
    """A term that FSDP2 divides over the GPUs."""
    sharded = setup.regime.sharded
    how += f" ÷ {setup.gpus} (FSDP2)" if sharded else ""
    return Term(name, label, _shard(total_bytes, setup.gpus), 0, sharded, how)


def _weights(setup: _Setup) -> Term:
    shape = setup.shape
    if setup.method != "qlora":
        how = f"{setup.base_dtype}, {setup.base_bytes} B × {_count(shape.params)} params"
        how += "" if setup.full else " (frozen base)"
        return _sharded(setup, "weights", "weights", setup.base_bytes * shape.params, how)
    quantized = shape.num_layers * shape.layer_linear_params
    others = shape.params - quantized
    how = (
        f"NF4 {bits_per_param(setup.double_quant):.3f} bit × {_count(quantized)} linear weights + "
        f"{'bf16' if setup.bf16 else 'fp32'} × {_count(others)} others"
    )
    weight_bytes = _quantized_bytes(quantized, setup.double_quant) + setup.nonlinear_bytes * others
    return _sharded(setup, "weights", "weights", weight_bytes, how)


def _lora_params(setup: _Setup) -> Term:
    if not setup.lora_count:
        return Term("lora_params", "LoRA adapters", 0, 0, setup.regime.sharded, "none")
    how = f"fp32, 4 B × {_count(setup.lora_count)} (rank {setup.lora_r}, all linear layers)"
    return _sharded(setup, "lora_params", "LoRA adapters", 4 * setup.lora_count, how)


def _trained_bytes(setup: _Setup) -> int:
    """Bytes per trained weight: the loaded dtype's in full fine-tuning, fp32 for adapters (peft's)."""
    return setup.base_bytes if setup.full else 4


def _gradients(setup: _Setup) -> Term:
    w = _trained_bytes(setup)
    how = f"{'fp32' if w == 4 else 'bf16'}, {w} B × {_count(setup.trainable)}"
    return _sharded(setup, "gradients", "gradients", w * setup.trainable, how)


def _optimizer(setup: _Setup) -> Term:
    w = _trained_bytes(setup)
    how = f"{'fp32' if w == 4 else 'bf16'} m and v, {2 * w} B × {_count(setup.trainable)}; the params are "
    how += "the master copy"
    return _sharded(setup, "optimizer", "optimizer (AdamW m, v)", 2 * w * setup.trainable, how)


def _weight_copies(setup: _Setup) -> Term:
    copies, how = _gathered_copies(setup) if setup.regime.sharded else _cast_copies(setup)
    return Term("weight_copies", "weight working copies", copies, 0, False, how)


def _gathered_copies(setup: _Setup) -> tuple[int, str]:
    """FSDP2: the root unit and two layer units gathered (computing + prefetching), with, for trained
    weights, their unsharded gradients and fp32 reduce buffers."""
    shape, qlora, full = setup.shape, setup.method == "qlora", setup.full
    w = 2 if setup.bf16 else 4
    lora_per_layer = setup.lora_count // shape.num_layers
    if qlora:
        quantized = _quantized_bytes(shape.layer_linear_params, setup.double_quant)
        layer_gathered = quantized + setup.nonlinear_bytes * shape.layer_other_params
    else:
        layer_gathered = w * shape.layer_params
    layer_gathered += w * lora_per_layer
    layer_grads = (w + 4) * (shape.layer_params if full else lora_per_layer)
    root = (setup.nonlinear_bytes if qlora else w) * shape.root_params
    root += (w + 4) * shape.root_params if full else 0
    dequant = setup.nonlinear_bytes * shape.max_linear_params if qlora else 0
    how = f"FSDP2 gathered {'bf16' if setup.bf16 else 'fp32'}: root unit + 2 layers"
    how += ", their unsharded grads + fp32 reduce buffers" if full else ""
    how += " + one dequantized linear" if dequant else ""
    return root + 2 * (layer_gathered + layer_grads) + dequant, how


def _cast_copies(setup: _Setup) -> tuple[int, str]:
    """One process: autocast's casts of the weights, or QLoRA's dequantized weight."""
    shape, autocast = setup.shape, setup.regime.autocast
    head_cast = 2 * shape.vocab_size * shape.hidden_size
    if setup.base_dtype == "bf16" and setup.method != "qlora":  # the weights are bf16 already
        adapters = 2 * setup.lora_count if autocast and setup.method == "lora" else 0
        return (
            adapters,
            "adapters' bf16 casts (the bf16 weights need none)" if adapters else "none (bf16 weights)",
        )
    if autocast and setup.fused_loss_head and setup.method in ("full", "lora"):
        adapters = 2 * setup.lora_count if setup.method == "lora" else 0
        how = "one linear's bf16 cast at a time (none kept for backward) + the head's bf16 cast"
        return 2 * shape.max_linear_params + adapters + head_cast, how + (
            " + adapters' casts" if adapters else ""
        )
    if autocast and setup.method == "full":
        copies = 2 * shape.num_layers * shape.layer_linear_params + head_cast
        return copies, "autocast's bf16 cache of the layers' linear weights + the head's bf16 cast"
    if autocast and setup.method == "lora":
        saved = shape.layer_linear_params * (1 if setup.checkpointing else shape.num_layers)
        which = "1 layer" if setup.checkpointing else "all layers"
        how = f"bf16 casts of frozen weights saved for backward ({which}) + adapters' casts + head cast"
        return 2 * saved + 2 * setup.lora_count + head_cast, how
    if setup.method == "qlora":
        copies = setup.nonlinear_bytes * shape.max_linear_params + (2 * setup.lora_count if autocast else 0)
        return copies, "largest linear dequantized to bf16" + (" + adapters' bf16 casts" if autocast else "")
    return 0, "none (fp32 compute)"


def _activations(setup: _Setup) -> Term:
    shape, tokens, layers = setup.shape, setup.tokens, setup.shape.num_layers
    per_layer, checkpointing, offload = setup.layer_activations, setup.checkpointing, setup.offload
    x, h = setup.regime.residual, shape.hidden_size
    kept = setup.layer_input if checkpointing else per_layer
    offloaded = layers - setup.keep if offload else 0
    on_device = layers - offloaded + min(offloaded, 2)  # kept, and the offloaded ones in flight
    extras = 2 * shape.head_dim * x + 4 * h + 4 + (x * h if setup.full else 0)  # RoPE cos/sin, final norm
    activations = tokens * (on_device * kept + (per_layer if checkpointing else 0) + extras)
    activations += setup.mlp_tile_bytes
    host = tokens * offloaded * kept
    saved_what = "layer inputs" if checkpointing else f"{per_layer:,} B/token/layer"
    how = f"{saved_what} × {on_device} layers × {tokens:,} tokens"
    how += " + 1 layer recomputed" if checkpointing else ""
    how += f" + one MLP tile ({format_bytes(setup.mlp_tile_bytes)})" if setup.mlp_tile_bytes else ""
    if offload:
        how += f" (offloaded: {offloaded} layers to host, 2 in flight; {setup.keep} kept on the GPU)"
    return Term("activations", "activations", activations, host, False, how)


def _loss_head_logit_bytes(setup: _Setup) -> int:
    """Bytes per logit of a chunk, as the head's ``logit_bytes`` counts them with no softcap, temperature
    or entropy: the logits (the Triton kernels turn them into the gradient in place; CUDA's fp32 sum of
    the weight gradient takes bf16 operands) and, on CPU (the PyTorch path) in low precision, their fp32
    copy and the gradient's fp32 copy for the weight gradient's sum."""
    a = setup.regime.compute
    return a + (8 if setup.device == "cpu" and a != 4 else 0)


def _loss_head_chunk(setup: _Setup) -> int:
    """Tokens per chunk of the fused head, by the ops' own rule (``fastalign.ops.head_workspace``)."""
    budget = head_workspace_bytes(setup.device)
    if setup.device == "cuda" and _head_grad_accumulator(setup):  # a trained bf16 head: as the ops do
        budget = max(budget, accumulator_budget(setup.shape.vocab_size * setup.shape.hidden_size))
    return min(setup.tokens, chunk_rows(setup.shape.vocab_size, _loss_head_logit_bytes(setup), budget))


def _head_grad_accumulator(setup: _Setup) -> int:
    """The fp32 accumulator of a trainable head's weight gradient when the head runs in bf16."""
    shape = setup.shape
    return 4 * shape.vocab_size * shape.hidden_size if setup.full and setup.regime.compute == 2 else 0


def _fused_loss_head_bytes(setup: _Setup) -> int:
    shape, tokens, a = setup.shape, setup.tokens, setup.regime.compute
    chunk = _loss_head_chunk(setup) * shape.vocab_size * _loss_head_logit_bytes(setup)
    hidden_grad = tokens * shape.hidden_size * a
    return chunk + hidden_grad + 24 * tokens + _head_grad_accumulator(setup)


def _materialized_loss_head_bytes(setup: _Setup) -> int:
    """HF's own loss: the fp32 logits [T, V] and their gradient."""
    return 8 * setup.tokens * setup.shape.vocab_size


def _loss_head(setup: _Setup) -> Term:
    if not setup.fused_loss_head:
        how = f"[{setup.tokens:,}, {setup.shape.vocab_size:,}] fp32 logits + their gradient"
        return Term("loss_head", "loss head", _materialized_loss_head_bytes(setup), 0, False, how)
    how = f"fused: {_loss_head_chunk(setup):,}-token chunk of logits + grad of hidden"
    how += " + fp32 head-grad accumulator" if _head_grad_accumulator(setup) else ""
    return Term("loss_head", "loss head", _fused_loss_head_bytes(setup), 0, False, how)


def _cuda_context(setup: _Setup) -> Term:
    if setup.device != "cuda":
        return Term("cuda_context", "CUDA context", 0, 0, False, "none on CPU")
    how = "assumed 0.75 GiB (context, cuBLAS workspace, kernels)"
    return Term("cuda_context", "CUDA context", CUDA_CONTEXT_BYTES, 0, False, how)


def _model_load(setup: _Setup) -> Term:
    """A local checkpoint is read tensor by tensor into a model already sharded (fastalign.quant.loading):
    the host holds about one layer (and the embeddings) of the checkpoint at a time, bf16 for QLoRA and
    fp32 otherwise."""
    shape, bf16 = setup.shape, setup.method == "qlora" or setup.base_dtype == "bf16"
    host = (2 if bf16 else 4) * (shape.layer_params + shape.root_params)
    how = f"{'bf16' if bf16 else 'fp32'} checkpoint streamed layer by layer, before training"
    return Term("model_load", "model load (host)", 0, host, False, how)


# --------------------------------------------------------------------------------------------------
# Input, notes and suggestions.


def _model_shape(config: PretrainedConfig | ModelShape | str) -> ModelShape:
    if isinstance(config, str):
        label, config = resolve_model(config)
        return shape_from_config(config, label)
    if isinstance(config, ModelShape):
        return config
    return shape_from_config(config)


def teacher_logprobs_bytes_per_token(top_k: int, tail_samples: int = 0) -> int:
    """Disk per completion token of ``fastalign teacher-logprobs`` (fp32 log-probs): k × (4 B int32 id +
    4 B log-prob), plus the fp32 tail and completion-token log-prob (8 B), plus a 4 B int32 id per tail
    draw; as ``fastalign.data.teacher_logprobs.disk_bytes_per_token``."""
    return top_k * (4 + 4) + 8 + tail_samples * 4


def _distill_offline_plan(
    shape: ModelShape, flags: dict, suggest: bool, top_k: int, tail_samples: int
) -> MemoryPlan:
    """Offline distillation: the student's fine-tuning plan (in full, LoRA or QLoRA, as ``flags``'
    method; the fused sparse head holds one chunk of logits, as the cross-entropy's) and no teacher: its
    top-k log-probs come from disk, a few bytes per token in each batch."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise PlanError("top_k", f"must be a positive integer, got {top_k!r}")
    if isinstance(tail_samples, bool) or not isinstance(tail_samples, int) or tail_samples < 0:
        raise PlanError("tail_samples", f"must be an integer of 0 or more, got {tail_samples!r}")
    # the suggestions stay on offline distillation's own ladder (checkpointing, offloading, GPUs): "use
    # --method lora" would plan LoRA SFT, a run without the stored log-probs
    method = flags["method"]
    student = plan_memory(shape, **{**flags, "method": DISTILL_OFFLINE_METHODS[method]}, suggest=False)
    per_token = teacher_logprobs_bytes_per_token(top_k, tail_samples)
    teacher = Term("teacher", "teacher", 0, 0, False, "none: its top-k log-probs are read from disk")
    draws = f" and {tail_samples} tail draws" if tail_samples else ""
    draw_bytes = f" + {tail_samples} × 4 B draw" if tail_samples else ""
    note = (
        f"teacher log-probs on disk: {per_token} B per completion token at top_k {top_k}{draws} "
        f"(k × (4 B id + 4 B log-prob) + 8 B{draw_bytes}); {format_bytes(per_token * 10**9)} per billion "
        "tokens"
    )
    plan = replace(
        student,
        method=method,
        terms=[*student.terms, teacher],
        teacher_logprobs_bytes_per_token=per_token,
    )
    return _with_suggestions(shape, plan, [*student.notes, note], suggest)


def _validate(
    method, gpus, seq_len, batch_size, lora_r, lora_dropout, gpu_memory_bytes, device, base_dtype
) -> None:
    if method not in METHODS:
        raise PlanError("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    if method in _ONE_PROCESS and gpus != 1:
        raise PlanError("gpus", f"{method} (one base model, two adapters) runs on 1 GPU; use --method ppo")
    for name, value in (
        ("gpus", gpus),
        ("seq_len", seq_len),
        ("batch_size", batch_size),
        ("lora_r", lora_r),
        ("gpu_memory_bytes", gpu_memory_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(name, f"must be a positive integer, got {value!r}")
    if not 0 <= lora_dropout < 1:
        raise PlanError("lora_dropout", f"must be in [0, 1), got {lora_dropout!r}")
    if base_dtype not in BASE_DTYPES:
        raise PlanError("base_dtype", f"must be 'fp32' or 'bf16', got {base_dtype!r}")
    if device not in ("cuda", "cpu"):
        raise PlanError("device", f"must be 'cuda' or 'cpu', got {device!r}")


def _notes(plan: MemoryPlan, setup: _Setup) -> list[str]:
    notes = []
    if plan.method == "lora" and plan.base_dtype == "fp32":
        notes.append(
            f"the frozen base stays fp32 as loaded (TRL's default): {format_bytes(plan.weights)} per GPU; "
            "loaded in bf16 (dtype: bfloat16, --base-dtype bf16) it takes half"
        )
    if plan.method != "full" and plan.lora_dropout > 0:
        no_dropout = plan_memory(setup.shape, **{**_flags(setup), "lora_dropout": 0.0}, suggest=False)
        saved = plan.activations - no_dropout.activations
        if saved > 0:
            notes.append(
                f"lora_dropout {plan.lora_dropout:g}: peft saves a dropout copy and mask of every adapter "
                f"input; --lora-dropout 0 saves {format_bytes(saved)} of activations"
            )
    if plan.offload_activations and not setup.offload:
        notes.append("offloading has no effect on CPU (the tensors are in host memory already)")
    if not plan.fused_loss_head:
        notes.append(
            f"a fused loss head (use_liger_kernel, or any preference/GRPO objective) would need "
            f"{format_bytes(plan.loss_head_fused)} instead of {format_bytes(plan.loss_head)}"
        )
    return notes


def _suggest(shape: ModelShape, plan: MemoryPlan) -> tuple[list[str], int | None]:
    """Flag changes that make ``plan`` fit, and the total per GPU they lead to.

    The ladder, cumulative and cheapest first: checkpointing, offloading, no LoRA dropout, LoRA, QLoRA,
    then the fewest GPUs (doubling) that fit. Each rung first keeps the micro-batch, then halves it (the
    global batch stays the same with gradient accumulation). Once something fits, changes it no longer
    needs are dropped again, the dearest first.
    """
    original = _flags(plan)
    inputs = dict(original)
    changed: list[str] = []  # keys of inputs, in the order they were changed
    batch_sizes = [plan.batch_size]
    while batch_sizes[-1] > 1:
        batch_sizes.append(batch_sizes[-1] // 2)

    def attempt(values: dict) -> MemoryPlan | None:
        """The plan of ``values``; None where the method cannot run so (PPO on one base model: on more
        than one GPU, or with checkpointing)."""
        if values["method"] in _ONE_PROCESS and (values["gpus"] > 1 or values["checkpointing"]):
            return None
        return plan_memory(shape, **values, suggest=False)

    def fitting() -> MemoryPlan | None:
        for batch_size in batch_sizes:
            result = attempt({**inputs, "batch_size": batch_size})
            if result is not None and result.fits:
                return result
        return None

    def change(key: str, value) -> None:
        inputs[key] = value
        if key not in changed:
            changed.append(key)

    rungs: list[tuple[str, object]] = [("checkpointing", True)]
    rungs += [("offload_activations", True)] if plan.device == "cuda" else []
    rungs += [("lora_dropout", 0.0)]
    ladder = next(methods for methods in _LADDERS if plan.method in methods)
    for method in ladder[ladder.index(plan.method) + 1 :]:
        rungs += [("method", method), ("lora_dropout", 0.0)]
    result = None
    for key, value in rungs:
        if (
            inputs[key] == value
            or (key == "lora_dropout" and inputs["method"] in ("full", "ppo", DISTILL_OFFLINE))
            or (key == "checkpointing" and inputs["method"] in _ONE_PROCESS)
        ):
            continue
        if key == "method" and value in _ONE_PROCESS and inputs["checkpointing"]:
            change("checkpointing", False)  # PPO on one base model trains without it
        change(key, value)
        if result := fitting():
            break
    gpus = plan.gpus
    while result is None and gpus < _MAX_GPUS:
        gpus *= 2
        change("gpus", gpus)
        if inputs["method"] in _ONE_PROCESS:  # only PPO's separate models shard
            change("method", "ppo")
        result = fitting()
    if result is None:
        return [], None
    change("batch_size", result.batch_size)
    for key in reversed(changed):  # drop what the fit does not need, the dearest first (GPUs, batch: minimal)
        trial = None if key in ("gpus", "batch_size") else attempt({**inputs, key: original[key]})
        if trial is not None and trial.fits:
            inputs[key], result = original[key], trial
            changed.remove(key)
    flags = {"checkpointing": "--checkpointing", "offload_activations": "--offload-activations"}
    return [
        flags.get(key) or f"--{key.replace('_', '-')} {inputs[key]:g}"
        if isinstance(inputs[key], float)
        else flags.get(key) or f"--{key.replace('_', '-')} {inputs[key]}"
        for key in changed
        if inputs[key] != original[key]
    ], result.total_per_gpu


#: The longest sequence ``longest_sequence`` tries: 16M tokens.
_MAX_SEQ_LEN = 1 << 24


def longest_sequence(
    config: PretrainedConfig | ModelShape | str,
    *,
    method: Method = "full",
    gpu_memory_bytes: int = 80 * GiB,
    multiple: int = 256,
    **flags,
) -> int:
    """The longest ``seq_len``, a multiple of ``multiple`` (1: exact), whose plan fits in
    ``gpu_memory_bytes`` (and in ``host_memory_bytes`` where given) with the other ``plan_memory`` flags;
    0 when not even ``multiple`` tokens fit.

    Bisection: the plan grows with the sequence (activations, loss head; offloading's "auto"
    keep_on_device trades device for host memory, but never past what fits)."""
    if "seq_len" in flags or "suggest" in flags:
        raise PlanError("seq_len", "longest_sequence chooses seq_len itself")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise PlanError("multiple", f"must be a positive integer, got {multiple!r}")
    shape = _model_shape(config)

    def fits(units: int) -> bool:
        plan = plan_memory(
            shape, method=method, gpu_memory_bytes=gpu_memory_bytes, seq_len=units * multiple, suggest=False,
            **flags,
        )  # fmt: skip
        return plan.fits

    low, high = 0, _MAX_SEQ_LEN // multiple  # fits(low) (or low = 0), high: the most tried
    step = 1
    while low + step <= high and fits(low + step):  # doubling: a plan is cheap, a long bisection is not
        low += step
        step *= 2
    high = min(high, low + step - 1)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low * multiple


def bits_per_param(double_quant: bool = True) -> float:
    """Bits per quantized weight of NF4 with blocksize 64 (4.127 with double quantization, else 4.5)."""
    return 4 + (8 / 64 + 32 / (64 * 256) if double_quant else 32 / 64)


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "METHODS",
    "PPO_METHODS",
    "MemoryPlan",
    "PlanError",
    "Term",
    "bits_per_param",
    "format_bytes",
    "longest_sequence",
    "parse_memory",
    "plan_memory",
]
