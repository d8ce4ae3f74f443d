"""The shared decoder of every model family (RMSNorm, RoPE, GQA, gated MLP, tied or separate head) over a flat
batch of tokens. A family is a set of ModelConfig features (parrot.engine.models.registry has the table); the
layer below runs each one only where its config has it.

Tokens of many sequences are concatenated into one flat batch ``[T]``; attention is the only per-sequence step
and is delegated to an :class:`AttentionBackend` (the engine's paged-KV attention, which also applies each
layer's sliding window and score soft-capping). Per layer (``[...]``: only in families that have it):

    h [T, H] ──rms──► qkv_proj [+ bias] ──► [ q | k | v ]  (one fused matmul; q,k rows in interleaved RoPE order)
                      [rms per q / k head]  rope(q,k) ─► attn(layer, q, k, v) ─► o_proj [─► rms] ─► h += ·
    h ──rms──► gate_up_proj ──► [ gate | up ] ─► act(gate) * up ─► down_proj [─► rms] ─► h += ·

``act`` is silu (SwiGLU) or tanh-GELU (GeGLU). The residual stream ``h`` and the RMSNorm weights stay float32
whatever the compute dtype: the norms then run without dtype round trips (cheaper than a bf16 norm:
docs/results/kernels.md) and the residual keeps fp32 precision; only the matmul
inputs/outputs (and attention) are in the compute dtype. Norm weights are the multiplier itself (Gemma's 1 + w is
folded in by the loaders).

With native fused ops (:meth:`CausalLM.use_fused_ops`, bf16 on the CPU) each residual add runs fused with
the norm after it, ``x = rms_norm(h += delta)`` in one pass per row, and silu(gate) * up is one op; the math
is the same (fp32 inside), only the rounding of the intermediate bf16 tensors differs. A plain LLaMA-shaped model
(ModelConfig.is_plain_llama) may run decode-only batches through the native all-layers op.

Weights arrive as float32 under canonical (HF) names from parrot.engine.loader and are fused and cast by
parrot.engine.models.assembly; each matmul's numerics path (layers/linear.py) is chosen once, from the
MatmulKernels the model is assembled with.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parrot.engine.files.config import ModelConfig
from parrot.engine.layers.attention import LayerAttention, PlainDecode
from parrot.engine.layers.linear import Linear
from parrot.engine.layers.packed import VnniWeight
from parrot.engine.layers.quant import Embedding, QuantWeight
from parrot.engine.layers.rotary import RotaryEmbedding
from parrot.engine.layers.weight import NativeCall
from parrot.engine.loader import to_hf_layout


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


class DecoderLayer(nn.Module):
    """One decoder layer of any family; the optional parts (None when the family has none) are the QKV bias
    (compute dtype, [q + 2 kv]), the q / k head norms (float32 [num_heads + num_kv_heads, head_dim], q's weight
    repeated over the q heads, k's over the kv heads) and the norms of the attention and MLP outputs."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, input_norm: Tensor, qkv_proj: Linear,
                 o_proj: Linear, post_norm: Tensor, gate_up_proj: Linear, down_proj: Linear,
                 qkv_bias: Tensor | None = None, qk_norm: Tensor | None = None, attn_out_norm: Tensor | None = None,
                 ffn_out_norm: Tensor | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qk_heads = config.num_heads + config.num_kv_heads
        self.qk_size = self.qk_heads * config.head_dim
        self.inter = config.intermediate_size
        self.norm_shape = (config.hidden_size,)
        self.eps = config.rms_norm_eps
        self.gelu = config.hidden_act == "gelu_tanh"
        # which RoPE table the layer rotates with: the local one of a sliding layer in families that have one
        self.local_rope = config.local_rope_theta is not None and config.layer_window(layer_idx) is not None
        self.register_buffer("input_norm", input_norm)  # float32, like the residual stream
        self.register_buffer("post_norm", post_norm)  # the norm before the MLP
        self.register_buffer("qkv_bias", qkv_bias)
        self.register_buffer("qk_norm", qk_norm)
        self.register_buffer("attn_out_norm", attn_out_norm)
        self.register_buffer("ffn_out_norm", ffn_out_norm)
        self.compute_dtype = qkv_proj.dtype
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def forward(self, h: Tensor, rot: Tensor, attn: AttentionBackend, precise: bool = True) -> Tensor:
        """Updates the float32 residual stream ``h`` [T, H] in place and returns it. ``precise``: the batch processes
        prompt tokens (the matmuls' activation rule: layers/quant.py)."""
        dtype = self.compute_dtype
        a = self._attention(F.rms_norm(h, self.norm_shape, self.input_norm, self.eps).to(dtype), rot, attn,
                            precise=precise)
        h.add_(a if self.attn_out_norm is None else F.rms_norm(a.float(), self.norm_shape, self.attn_out_norm,
                                                               self.eps))
        gate_up = self.gate_up_proj(F.rms_norm(h, self.norm_shape, self.post_norm, self.eps).to(dtype), precise)
        m = self.down_proj(self._act(gate_up), precise)
        h.add_(m if self.ffn_out_norm is None else F.rms_norm(m.float(), self.norm_shape, self.ffn_out_norm,
                                                              self.eps))
        return h

    def forward_fused(self, h: Tensor, x: Tensor, rot: Tensor, attn: AttentionBackend, next_norm: Tensor,
                      ops: FusedOps, precise: bool = True) -> Tensor:
        """The same layer on native fused ops. ``x`` is this layer's normed input (compute dtype); updates ``h``
        in place and returns ``rms_norm(h, next_norm)``, the next layer's input (or the final norm's output):
        each residual add runs fused with the norm that follows it."""
        dtype = self.compute_dtype
        a = self._attention(x, rot, attn, ops.rope, precise)
        if self.attn_out_norm is not None:
            a = ops.rms_norm_cast(a.float().contiguous(), self.attn_out_norm, self.eps, torch.float32)
        x = ops.add_rms_norm_cast(h, a, self.post_norm, self.eps, dtype)
        gate_up = self.gate_up_proj(x, precise)
        m = self.down_proj(self._act(gate_up) if self.gelu else ops.silu_mul(gate_up), precise)
        if self.ffn_out_norm is not None:
            m = ops.rms_norm_cast(m.float().contiguous(), self.ffn_out_norm, self.eps, torch.float32)
        return ops.add_rms_norm_cast(h, m, next_norm, self.eps, dtype)

    def native_calls(self, rows: int) -> tuple[NativeCall, NativeCall, NativeCall, NativeCall] | None:
        """The packed weights native kernels run for ``rows`` rows (qkv, o, gate_up, down), or None if any of
        the four matmuls would run a torch kernel."""
        calls = tuple(lin.native_call(rows) for lin in (self.qkv_proj, self.o_proj, self.gate_up_proj,
                                                         self.down_proj))
        return None if any(c is None for c in calls) else calls

    def _act(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter:]
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)).mul_(up)

    def _attention(self, x: Tensor, rot: Tensor, attn: AttentionBackend,
                   rope: Callable[[Tensor, Tensor], Tensor] = RotaryEmbedding.apply, precise: bool = True) -> Tensor:
        """Normed input [T, H] -> o_proj(attention) [T, H] in the compute dtype (``rope``: torch's or the fused op,
        same contract)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x, precise)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk = qkv[:, : self.qk_size].view(t, self.qk_heads, self.head_dim)
        if self.qk_norm is not None:  # float32 like every norm here, one rounding to the compute dtype
            qk = (F.rms_norm(qk.float(), (self.head_dim,), eps=self.eps) * self.qk_norm).to(qkv.dtype)
        # q and k are adjacent, so one RoPE call rotates both; v stays a view of qkv
        qk = rope(qk, rot)
        v = qkv[:, self.qk_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn(self.layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads:], v), precise)


@dataclass(frozen=True)
class DecodeArgs:
    """The per-layer arguments of the all-layers decode op for one row count (see CausalLM)."""

    qkv: list[Tensor]  # packed weights (quantized: qlinear; dense bf16: vnni_linear) per Linear.native_call
    o: list[Tensor]
    gate_up: list[Tensor]
    down: list[Tensor]
    post_norms: list[Tensor]
    next_norms: list[Tensor]  # the norm after each layer: the next layer's input norm, the final norm last
    qmm_variant: str  # the quantized matmul's settings ("" when no layer is quantized)
    act_terms: int
    x2_rows: int
    vnni_backend: str  # the dense bf16 kernel's backend ("" when no layer is dense bf16)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, embedding: Embedding, layers: list[DecoderLayer],
                 norm: Tensor, lm_head: Linear) -> None:
        super().__init__()
        self.config = config
        self.embedding = embedding  # dense, or rows read out of packed GGUF codes (layers/quant.py)
        self.pack_cache = None  # the packed-weight cache it was loaded with (models/assembly.py load_model)
        self.layers = nn.ModuleList(layers)
        self.register_buffer("norm", norm)  # float32
        self.lm_head = lm_head
        self.rotary = RotaryEmbedding(config, device=embedding.device)
        self.local_rotary = (RotaryEmbedding(config, device=embedding.device, local=True)
                             if any(layer.local_rope for layer in layers) else None)
        # what the attention backend applies per layer (the runner hands it to PagedAttention)
        self.attention_layers = [LayerAttention(config.layer_window(i), config.attn_logit_softcap)
                                 for i in range(config.num_layers)]
        self._native_decode = config.is_plain_llama()  # the all-layers decode op computes plain LLaMA layers
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
        return self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend, *, precise: bool = True) -> Tensor:
        """input_ids / positions: flat [T] -> final-normed hidden states [T, H] in the compute dtype. ``precise``
        (the default): the batch processes prompt tokens; False: decode rows only, where quantized matmuls may take
        their faster activation rule (layers/quant.py) and the all-layers decode op may run."""
        # a fresh float32 tensor: the layers add into it in place
        h = self.embedding.lookup(input_ids).float()
        if self.config.embedding_scale is not None:
            h.mul_(self.config.embedding_scale)
        rot = self.rotary.table(positions)  # once per forward, shared by all layers
        local = self.local_rotary.table(positions) if self.local_rotary is not None else rot
        eps, ops = self.config.rms_norm_eps, self.fused_ops
        if ops is not None:
            x = ops.rms_norm_cast(h, self.layers[0].input_norm, eps, self.dtype)
            if not precise and (done := self._decode_layers(h, x, rot, attn, ops)) is not None:
                return done
            for i, layer in enumerate(self.layers):
                x = layer.forward_fused(h, x, local if layer.local_rope else rot, attn, self._norm_after(i), ops,
                                        precise)
            return x
        for layer in self.layers:
            h = layer(h, local if layer.local_rope else rot, attn, precise)
        return F.rms_norm(h, (self.config.hidden_size,), self.norm, eps).to(self.dtype)

    def _norm_after(self, i: int) -> Tensor:
        """The norm applied to layer i's output: layer i + 1's input norm, the final norm after the last."""
        return self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm

    def _decode_layers(self, h: Tensor, x: Tensor, rot: Tensor, attn: AttentionBackend, ops: FusedOps) -> Tensor | None:
        """All layers in one native call (kernels/decode_layers.cpp: the same kernels in the same order, with the same
        decode activation rule, as :meth:`DecoderLayer.forward_fused` with ``precise=False``) when the batch is
        decode rows only (``attn.plain_decode()``) and every matmul runs a native kernel at this row count; else
        None (nothing done)."""
        if not self._native_decode or not hasattr(ops, DECODE_LAYERS_OP) or not hasattr(attn, "plain_decode"):
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
                                 self.config.num_heads, args.qmm_variant, args.act_terms, args.x2_rows,
                                 args.vnni_backend)

    def _build_decode_args(self, rows: int) -> DecodeArgs | None:
        calls = [layer.native_calls(rows) for layer in self.layers]
        if any(c is None for c in calls):
            return None
        # one quantized kernel and one VNNI backend per model (the assembly builds every layer from one set)
        paths = [lin.path for layer in self.layers for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                                layer.down_proj)]
        quant = next((p.kernel for p in paths if isinstance(p, QuantWeight)), None)
        vnni = next((p.kernel for p in paths if isinstance(p, VnniWeight)), None)
        qkv, o, gate_up, down = ([c.weight for c in cs] for cs in zip(*calls))
        return DecodeArgs(qkv, o, gate_up, down, [layer.post_norm for layer in self.layers],
                          [self._norm_after(i) for i in range(len(self.layers))],
                          quant.variant if quant else "", quant.fast.terms if quant else 2,
                          quant.fast.x2_rows if quant else 0, vnni.backend if vnni else "")

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor, *, precise: bool = True) -> Tensor:
        """[N, H] -> float32 logits [N, vocab] (soft-capped where the family caps them); ``precise`` as in
        :meth:`forward`."""
        logits = self.lm_head(hidden, precise).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def export_hf_state_dict(self) -> dict[str, Tensor]:
        """Float32 weights under HF names in HF's layout (Q/K rows half-split), e.g. to save as safetensors (plain
        LLaMA models only: the families' extra weights have no export)."""
        cfg = self.config
        if not cfg.is_plain_llama() or cfg.embedding_scale is not None:
            raise ValueError(f"export_hf_state_dict exports plain LLaMA models, not {cfg.arch!r}")
        out = {"model.embed_tokens.weight": self.embedding.dense().float(), "model.norm.weight": self.norm.float()}
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
