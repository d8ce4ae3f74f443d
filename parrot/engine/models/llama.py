"""LLaMA decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or separate head) over a flat batch of tokens.

Tokens of many sequences are concatenated into one flat batch ``[T]``; attention is the only per-sequence step
and is delegated to an :class:`AttentionBackend` (the engine's paged-KV attention). Per layer:

    h [T, H] ──rms──► qkv_proj ──► [ q | k | v ]  (one fused matmul; q,k rows in interleaved RoPE order)
                                    rope(q,k)    ─► attn(layer, q, k, v) ─► o_proj ─► h += ·
    h ──rms──► gate_up_proj ──► [ gate | up ] ─► silu(gate) * up ─► down_proj ─► h += ·

The residual stream ``h`` and the RMSNorm weights stay float32 whatever the compute dtype: the norms then run
without dtype round trips (cheaper than a bf16 norm: docs/results/README.md#kernel-design-measurements) and the
residual keeps fp32 precision; only the matmul inputs/outputs (and attention) are in the compute dtype.

With native fused ops (:meth:`LlamaForCausalLM.use_fused_ops`, bf16 on the CPU) each residual add runs fused with
the norm after it, ``x = rms_norm(h += delta)`` in one pass per row, and silu(gate) * up is one op; the math
is the same (fp32 inside), only the rounding of the intermediate bf16 tensors differs.

Weights arrive as float32 under canonical (HF) names from parrot.engine.loader and are fused and cast here; each
matmul's numerics path (layers/linear.py) is chosen once, from the MatmulKernels the model is assembled with.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parrot.engine.config import ModelConfig, read_model_config
from parrot.engine.layers.attention import PlainDecode
from parrot.engine.layers.int4 import int4_kernel_available
from parrot.engine.layers.int8 import int8_compute_dtype, int8_kernel_available
from parrot.engine.layers.linear import WEIGHT_QUANTS, Linear, MatmulKernels, make_linear
from parrot.engine.layers.qdot import EXACT_FORMATS, QDotKernel
from parrot.engine.layers.rotary import RotaryEmbedding
from parrot.engine.layers.weight import NativeCall
from parrot.engine.loader import iter_weights, to_hf_layout, weight_formats
from parrot.engine.model_files import resolve_model_path

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (RoPE applied to q and k; last dim
        contiguous, rows may be strided views of one buffer) -> [T, num_heads * head_dim] in the compute dtype.
        Writes k/v into the KV cache and attends over each sequence's whole context."""
        ...


class FusedOps(Protocol):
    """The native fused elementwise ops (parrot/engine/kernels/fused.cpp, ``torch.ops.parrot_kernels``)."""

    def rms_norm_cast(self, x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> Tensor: ...

    def add_rms_norm_cast(self, h: Tensor, delta: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
        ...

    def silu_mul(self, gate_up: Tensor) -> Tensor: ...

    def rope(self, x: Tensor, rot: Tensor) -> Tensor: ...


FUSED_OP_NAMES = ("rms_norm_cast", "add_rms_norm_cast", "silu_mul", "rope")
# the all-layers op for decode-only batches (kernels/decode_layers.cpp); used when the library has it
DECODE_LAYERS_OP = "decode_layers"


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, input_norm: Tensor, qkv_proj: Linear,
                 o_proj: Linear, post_norm: Tensor, gate_up_proj: Linear, down_proj: Linear) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qk_heads = config.num_heads + config.num_kv_heads
        self.qk_size = self.qk_heads * config.head_dim
        self.inter = config.intermediate_size
        self.norm_shape = (config.hidden_size,)
        self.eps = config.rms_norm_eps
        self.register_buffer("input_norm", input_norm)  # float32, like the residual stream
        self.register_buffer("post_norm", post_norm)
        self.compute_dtype = qkv_proj.dtype
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def forward(self, h: Tensor, rot: Tensor, attn: AttentionBackend) -> Tensor:
        """Updates the float32 residual stream ``h`` [T, H] in place and returns it."""
        dtype = self.compute_dtype
        h.add_(self._attention(F.rms_norm(h, self.norm_shape, self.input_norm, self.eps).to(dtype), rot, attn))
        gate_up = self.gate_up_proj(F.rms_norm(h, self.norm_shape, self.post_norm, self.eps).to(dtype))
        h.add_(self.down_proj(F.silu(gate_up[:, : self.inter]).mul_(gate_up[:, self.inter:])))
        return h

    def forward_fused(self, h: Tensor, x: Tensor, rot: Tensor, attn: AttentionBackend, next_norm: Tensor,
                      ops: FusedOps) -> Tensor:
        """The same layer on native fused ops. ``x`` is this layer's normed input (compute dtype); updates ``h``
        in place and returns ``rms_norm(h, next_norm)``, the next layer's input (or the final norm's output):
        each residual add runs fused with the norm that follows it."""
        dtype = self.compute_dtype
        x = ops.add_rms_norm_cast(h, self._attention(x, rot, attn, ops.rope), self.post_norm, self.eps, dtype)
        mlp = self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        return ops.add_rms_norm_cast(h, mlp, next_norm, self.eps, dtype)

    def native_calls(self, rows: int) -> tuple[NativeCall, NativeCall, NativeCall, NativeCall] | None:
        """The packed weights native kernels run for ``rows`` rows (qkv, o, gate_up, down), or None if any of
        the four matmuls would run a torch kernel."""
        calls = tuple(lin.native_call(rows) for lin in (self.qkv_proj, self.o_proj, self.gate_up_proj,
                                                         self.down_proj))
        return None if any(c is None for c in calls) else calls

    def _attention(self, x: Tensor, rot: Tensor, attn: AttentionBackend,
                   rope: Callable[[Tensor, Tensor], Tensor] = RotaryEmbedding.apply) -> Tensor:
        """Normed input [T, H] -> o_proj(attention) [T, H] in the compute dtype (``rope``: torch's or the fused op,
        same contract)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are adjacent in qkv, so one RoPE call rotates both; v stays a view of qkv
        qk = rope(qkv[:, : self.qk_size].view(t, self.qk_heads, self.head_dim), rot)
        v = qkv[:, self.qk_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn(self.layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads:], v))


@dataclass(frozen=True)
class DecodeArgs:
    """The per-layer arguments of the all-layers decode op for one row count (see LlamaForCausalLM)."""

    qkv: list[Tensor]  # packed weights, int4 / VNNI / qdot form per Linear.native_call
    o: list[Tensor]
    gate_up: list[Tensor]
    down: list[Tensor]
    post_norms: list[Tensor]
    next_norms: list[Tensor]  # the norm after each layer: the next layer's input norm, the final norm last
    backend: str  # the VNNI backend or the qdot variant the calls share ("" when every matmul runs int4)
    act_terms: int  # the qdot kernel's activation terms (unused by the other kernels)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, embed_tokens: Tensor, layers: list[LlamaDecoderLayer],
                 norm: Tensor, lm_head: Linear) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("embed_tokens", embed_tokens)
        self.layers = nn.ModuleList(layers)
        self.register_buffer("norm", norm)  # float32
        self.lm_head = lm_head
        self.rotary = RotaryEmbedding(config, device=embed_tokens.device)
        self.fused_ops: FusedOps | None = None  # see use_fused_ops
        # per decode row count: the per-layer arguments of the all-layers op, or None where a matmul would run a
        # torch kernel (built on first use; a layer's path is fixed at load, so they stay valid)
        self._decode_args: dict[int, DecodeArgs | None] = {}

    def use_fused_ops(self, ops: FusedOps | None) -> bool:
        """Run the norms, residual adds and SwiGLU through native fused ops (``torch.ops.parrot_kernels``, see
        parrot.engine.kernels) instead of torch's op chains; None restores the torch path (torch's exact op
        order, e.g. for tests that compare tokens with HF). Taken by a bfloat16 or float32 model on the CPU.
        Returns whether the fused path is now in use."""
        usable = (ops is not None and self.dtype in (torch.bfloat16, torch.float32) and self.device.type == "cpu"
                  and all(hasattr(ops, name) for name in FUSED_OP_NAMES))
        self.fused_ops = ops if usable else None
        return usable

    def linears(self) -> list[Linear]:
        """Every matmul of the model (the layers' four, then the head)."""
        return [m for m in self.modules() if isinstance(m, Linear)]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """input_ids / positions: flat [T] -> final-normed hidden states [T, H] in the compute dtype."""
        # a fresh float32 tensor: the layers add into it in place
        h = F.embedding(input_ids, self.embed_tokens).float()
        rot = self.rotary.table(positions)  # once per forward, shared by all layers
        eps, ops = self.config.rms_norm_eps, self.fused_ops
        if ops is not None:
            x = ops.rms_norm_cast(h, self.layers[0].input_norm, eps, self.dtype)
            if (done := self._decode_layers(h, x, rot, attn, ops)) is not None:
                return done
            for i, layer in enumerate(self.layers):
                x = layer.forward_fused(h, x, rot, attn, self._norm_after(i), ops)
            return x
        for layer in self.layers:
            h = layer(h, rot, attn)
        return F.rms_norm(h, (self.config.hidden_size,), self.norm, eps).to(self.dtype)

    def _norm_after(self, i: int) -> Tensor:
        """The norm applied to layer i's output: layer i + 1's input norm, the final norm after the last."""
        return self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm

    def _decode_layers(self, h: Tensor, x: Tensor, rot: Tensor, attn: AttentionBackend, ops: FusedOps) -> Tensor | None:
        """All layers in one native call (kernels/decode_layers.cpp: the same kernels in the same order as
        :meth:`LlamaDecoderLayer.forward_fused`) when the batch is decode rows only (``attn.plain_decode()``) and
        every matmul runs a native kernel at this row count; else None (nothing done)."""
        if not hasattr(ops, DECODE_LAYERS_OP) or not hasattr(attn, "plain_decode"):
            return None
        plain: PlainDecode | None = attn.plain_decode()
        if plain is None:
            return None
        rows = x.shape[0]
        if rows not in self._decode_args:
            self._decode_args[rows] = self._build_decode_args(rows)
        args = self._decode_args[rows]
        if args is None:
            return None
        return ops.decode_layers(h, x, rot, args.qkv, args.o, args.gate_up, args.down, args.post_norms,
                                 args.next_norms, self.config.rms_norm_eps, [k for k, _ in plain.kv_caches],
                                 [v for _, v in plain.kv_caches], plain.slots, plain.table, plain.lens, plain.scale,
                                 self.config.num_heads, args.backend, args.act_terms)

    def _build_decode_args(self, rows: int) -> DecodeArgs | None:
        calls = [layer.native_calls(rows) for layer in self.layers]
        if any(c is None for c in calls):
            return None
        # the VNNI backend or qdot variant: one per model (the int4 kernel's calls name none)
        named = [c for layer_calls in calls for c in layer_calls if c.backend]
        backend, act_terms = (named[0].backend, named[0].act_terms) if named else ("", 1)
        qkv, o, gate_up, down = ([c.weight for c in cs] for cs in zip(*calls))
        return DecodeArgs(qkv, o, gate_up, down, [layer.post_norm for layer in self.layers],
                          [self._norm_after(i) for i in range(len(self.layers))], backend, act_terms)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, H] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def export_hf_state_dict(self) -> dict[str, Tensor]:
        """Float32 weights under HF names in HF's layout (Q/K rows half-split), e.g. to save as safetensors."""
        cfg = self.config
        out = {"model.embed_tokens.weight": self.embed_tokens.float(), "model.norm.weight": self.norm.float()}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.dense_weight().float()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = layer.qkv_proj.dense_weight().float().split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            gate, up = layer.gate_up_proj.dense_weight().float().split(cfg.intermediate_size)
            out |= {
                p + "input_layernorm.weight": layer.input_norm.float(),
                p + "post_attention_layernorm.weight": layer.post_norm.float(),
                p + "self_attn.q_proj.weight": to_hf_layout(q, cfg.num_heads),
                p + "self_attn.k_proj.weight": to_hf_layout(k, cfg.num_kv_heads),
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": layer.o_proj.dense_weight().float(),
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.down_proj.dense_weight().float(),
            }
        return {name: t.contiguous().cpu() for name, t in out.items()}


# ---- assembly from canonical weights ---------------------------------------------------------------------------
# canonical per-layer name -> (fused part, index within the part); fused parts are concatenated along rows
_LAYER_PARTS = {
    "self_attn.q_proj.weight": ("qkv_proj", 0),
    "self_attn.k_proj.weight": ("qkv_proj", 1),
    "self_attn.v_proj.weight": ("qkv_proj", 2),
    "self_attn.o_proj.weight": ("o_proj", 0),
    "mlp.gate_proj.weight": ("gate_up_proj", 0),
    "mlp.up_proj.weight": ("gate_up_proj", 1),
    "mlp.down_proj.weight": ("down_proj", 0),
    "input_layernorm.weight": ("input_norm", 0),
    "post_attention_layernorm.weight": ("post_norm", 0),
}
_PART_SIZES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1, "input_norm": 1, "post_norm": 1}
_NORMS = ("input_norm", "post_norm")


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "self_attn.q_proj.weight": (cfg.q_size, h), "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h), "self_attn.o_proj.weight": (h, cfg.q_size),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }


def _qdot_quant(weight_quant: str, formats: list[str | None]) -> str:
    """The qdot weight form of a (fused) matmul whose parts came in ``formats``: "auto" keeps a Q4_0 / Q4_1 file's
    4-bit codes and runs everything else as Q8_0 (exact for a Q8_0 file, near-lossless for wider formats)."""
    if weight_quant != "auto":
        return weight_quant
    return "int4" if all(f in EXACT_FORMATS["int4"] for f in formats) else "int8"


def assemble_model(config: ModelConfig, weights: Iterable[tuple[str, Tensor]], *, dtype: torch.dtype,
                   device: str | torch.device = "cpu", weight_quant: str = "none",
                   kernels: MatmulKernels | None = None, formats: Mapping[str, str] | None = None) -> LlamaForCausalLM:
    """Build the model from ``(canonical name, float tensor)`` pairs in any order. A layer's fused matmul is
    built as soon as its parts have all arrived, so only a few float32 tensors are alive at a time.

    ``kernels``: the matmul kernels the layers may run (the engine's NumericsPlan: MatmulKernels.for_plan; None =
    everything this machine runs but the qdot kernel). With ``kernels.qdot`` every matmul (weight_quant "int4" /
    "int8" / "auto") runs the integer-dot kernel, and ``formats`` (canonical name -> GGUF format, e.g. "q4_1")
    lets it keep a file's own codes (layers/qdot.py); without it, weight_quant "auto" means "int4"."""
    if weight_quant not in (*WEIGHT_QUANTS, "auto"):
        raise ValueError(f"weight_quant must be one of {(*WEIGHT_QUANTS, 'auto')}, got {weight_quant!r}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    kernels = kernels if kernels is not None else MatmulKernels.available(device, dtype)
    if torch.device(device).type != "cpu" and any(k is not None for k in (kernels.vnni, kernels.int4, kernels.qdot)):
        raise ValueError(f"the native matmul kernels run on the CPU, not on {device!r}")
    formats = formats or {}
    if weight_quant == "none":
        kernels = replace(kernels, qdot=None)  # an unquantized model runs no integer-dot matmul
    if kernels.qdot is None and weight_quant == "auto":
        weight_quant = "int4"
    shapes = _expected_shapes(config)
    pending: dict[tuple[int, str], dict[int, tuple[Tensor, str | None]]] = {}
    parts: list[dict[str, Tensor | Linear]] = [{} for _ in range(config.num_layers)]
    globals_: dict[str, Tensor] = {}

    def linear(ws: list[tuple[Tensor, str | None]], quant: str) -> Linear:
        return make_linear([(w.to(device), f) for w, f in ws], dtype=dtype, quant=quant, kernels=kernels)

    def layer_quant(ws: list[tuple[Tensor, str | None]]) -> str:
        return _qdot_quant(weight_quant, [f for _, f in ws]) if kernels.qdot is not None else weight_quant

    for name, tensor in weights:
        if name.startswith("model.layers."):
            idx_str, _, local = name[len("model.layers."):].partition(".")
            layer = int(idx_str)
            if local not in _LAYER_PARTS or not 0 <= layer < config.num_layers:
                raise ValueError(f"unexpected weight {name!r} for a {config.num_layers}-layer LLaMA")
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            layer, local = -1, name
        else:
            raise ValueError(f"unexpected weight {name!r}")
        if tuple(tensor.shape) != shapes[local]:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {shapes[local]}")
        if layer < 0:
            globals_[name] = tensor
            continue
        part, slot = _LAYER_PARTS[local]
        group = pending.setdefault((layer, part), {})
        group[slot] = (tensor, formats.get(name))
        if len(group) == _PART_SIZES[part]:
            del pending[(layer, part)]
            ws = [group[s] for s in range(len(group))]
            parts[layer][part] = (ws[0][0].to(device=device, dtype=torch.float32) if part in _NORMS
                                  else linear(ws, layer_quant(ws)))

    missing = [f"layer {i}: {sorted(set(_PART_SIZES) - set(p))}" for i, p in enumerate(parts) if len(p) < 6]
    for required in ("model.embed_tokens.weight", "model.norm.weight"):
        if required not in globals_:
            missing.append(required)
    if not config.tie_word_embeddings and "lm_head.weight" not in globals_:
        missing.append("lm_head.weight")
    if missing:
        raise ValueError(f"model weights incomplete, missing: {missing}")

    embed_f32 = globals_["model.embed_tokens.weight"]
    embed = embed_f32.to(device=device, dtype=dtype)
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head_f32, head_fmt = globals_[head_name], formats.get(head_name)
    # int4 stays off the head: GGUFs store it (token_embd) as Q8_0 or better, so 4-bit codes would lose
    # precision there (and flip borderline greedy tokens); an int4 model's head is Q8_0 instead (two int4 planes
    # of the native kernel, exact for a Q8_0 head; the bf16 weight where that kernel does not run). On the qdot
    # kernel the head keeps a 4-bit file's codes only when the file has them, else Q8_0; a head shape it cannot
    # pack stays dense (exact).
    if kernels.qdot is not None and QDotKernel.packable(*head_f32.shape):
        head_quant = "int4" if weight_quant in ("auto", "int4") and head_fmt in EXACT_FORMATS["int4"] else "int8"
    elif weight_quant == "int4":  # from the float32 weights: the planes are exact only for the file's values
        head_quant = "q8_0"
    elif weight_quant == "none" or kernels.qdot is not None:
        head_quant = "none"
    else:
        head_quant = weight_quant
    # a tied dense head shares the embedding's storage (the dense form casts only when needed)
    head = embed if config.tie_word_embeddings and head_quant == "none" else head_f32
    lm_head = linear([(head, head_fmt)], head_quant)
    layers = [LlamaDecoderLayer(config, i, **p) for i, p in enumerate(parts)]
    return LlamaForCausalLM(config, embed_tokens=embed, layers=layers,
                            norm=globals_["model.norm.weight"].to(device=device, dtype=torch.float32), lm_head=lm_head)


def load_model(path: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               weight_quant: str = "none", kernels: MatmulKernels | None = None) -> LlamaForCausalLM:
    """Load a GGUF file or an HF safetensors dir. ``weight_quant``: "none", "int8", "int4" or "auto" (see
    :func:`assemble_model`, which also explains ``kernels``). Raises ValueError for a bad option or unsupported
    model, ModelNotFound for a missing path."""
    if weight_quant not in (*WEIGHT_QUANTS, "auto"):
        raise ValueError(f"weight_quant must be one of {(*WEIGHT_QUANTS, 'auto')}, got {weight_quant!r}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    kernels = kernels if kernels is not None else MatmulKernels.available(device, dtype)
    torch_quant = kernels.qdot is None  # with qdot, the integer-dot kernel runs every quantized layer, not torch's
    if torch_quant and weight_quant == "int8" and not int8_kernel_available(device, int8_compute_dtype(dtype)):
        raise ValueError(f"weight_quant='int8' needs torch.ops.aten._weight_int8pack_mm for {dtype} on {device!r}")
    if torch_quant and weight_quant in ("int4", "auto") and not int4_kernel_available(device, dtype):
        raise ValueError(f"weight_quant='int4' needs torch._weight_int4pack_mm_for_cpu with bfloat16 on the CPU, "
                         f"not {dtype} on {device!r}")
    path = resolve_model_path(path)
    start = time.perf_counter()
    config = read_model_config(path)
    model = assemble_model(config, iter_weights(path, config), dtype=dtype, device=device, weight_quant=weight_quant,
                           kernels=kernels, formats=weight_formats(path))
    logger.info("loaded %s (%d layers, %s, quant=%s) from %s in %.1f s", config.name, config.num_layers, dtype,
                weight_quant, path, time.perf_counter() - start)
    return model


def random_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, Tensor]:
    """Random float32 weights under canonical names (std 0.02 like HF's init; norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _expected_shapes(config)
    out: dict[str, Tensor] = {}

    def draw(shape: tuple[int, ...], norm: bool) -> Tensor:
        noise = torch.randn(shape, generator=gen)
        return 1.0 + 0.1 * noise if norm else 0.02 * noise

    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        out[name] = draw(shapes[name], name.endswith("norm.weight"))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = draw(shapes["lm_head.weight"], False)
    for i in range(config.num_layers):
        for local in _LAYER_PARTS:
            out[f"model.layers.{i}.{local}"] = draw(shapes[local], local.endswith("layernorm.weight"))
    return out


def build_random_model(config: ModelConfig, *, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                       weight_quant: str = "none", kernels: MatmulKernels | None = None) -> LlamaForCausalLM:
    """A model with random weights (tests, benchmarks); deterministic for a given seed."""
    return assemble_model(config, random_weights(config, seed=seed).items(), dtype=dtype, device=device,
                          weight_quant=weight_quant, kernels=kernels)
