"""Independent float64 NumPy reference of the Kimi K3 text model (and Kimi-Linear).

Written straight from /work/shared/spec/k3_architecture.md (§2 math, §3 checkpoint layout).
It deliberately imports nothing from ``k3jax`` / ``pallas_kernels``: it reads an HF-format
checkpoint directory (config.json + model.safetensors or shards + index) with its own tiny
safetensors parser and runs the model token-by-token in float64.

Every "cast to model dtype" of the spec is a no-op here (float64 throughout); the eps values
follow §2.1 exactly:
  * standard RMSNorm eps = rms_norm_eps (input/post/final/routed_expert/AttnRes norms),
  * q_a_layernorm / kv_a_layernorm eps = 1e-6 (the class default; §2.1 trap),
  * KDA gated o_norm eps = rms_norm_eps,
  * KDA q/k L2-norm: x * rsqrt(sum(x^2) + 1e-6).

Public API:
  reference_logits(ckpt_dir, ids)                   -> float64 logits [B, T, V]
  reference_forward(ckpt_dir, ids, trace=dict())    -> logits, and fills ``trace`` with
      per-layer intermediates + router statistics (for debugging / tie checks)
  reference_greedy(ckpt_dir, ids, n)                -> [B, T+n] argmax continuation (full recompute)
  load_reference(ckpt_dir)                          -> RefModel (cached per directory)
"""

from __future__ import annotations

import functools
import json
import os
import struct

import numpy as np

# --------------------------------------------------------------------------------------------
# safetensors reading (own parser; handles BF16 which numpy lacks)
# --------------------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_,
}


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as fh:
        data = fh.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        raw = data[base + s: base + e]
        shape = tuple(info["shape"])
        dt = info["dtype"]
        if dt == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
            arr = (u16 << 16).view(np.float32).reshape(shape)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[dt]).newbyteorder("<")).reshape(shape)
        out[name] = arr.copy()
    return out


def _read_checkpoint_tensors(ckpt_dir: str) -> dict[str, np.ndarray]:
    idx = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as fh:
            weight_map = json.load(fh)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            part = _read_safetensors(os.path.join(ckpt_dir, shard))
            for k, v in part.items():
                assert weight_map.get(k) == shard, f"tensor {k} not mapped to {shard} in the index"
                tensors[k] = v
        missing = set(weight_map) - set(tensors)
        assert not missing, f"index lists tensors not found in shards: {sorted(missing)[:5]}"
        return tensors
    single = os.path.join(ckpt_dir, "model.safetensors")
    assert os.path.exists(single), f"no model.safetensors(.index.json) in {ckpt_dir}"
    return _read_safetensors(single)


# --------------------------------------------------------------------------------------------
# MXFP4 (§3.3)
# --------------------------------------------------------------------------------------------

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def mxfp4_dequant(packed: np.ndarray, scale: np.ndarray, group: int = 32) -> np.ndarray:
    """packed [R, C/2] u8 (low nibble = even column), scale [R, C/group] u8 E8M0 -> float64 [R, C]."""
    packed = np.asarray(packed, dtype=np.uint8)
    R, half = packed.shape
    C = 2 * half
    nib = np.empty((R, C), dtype=np.uint8)
    nib[:, 0::2] = packed & 0x0F          # low nibble -> even column
    nib[:, 1::2] = packed >> 4            # high nibble -> odd column
    mag = _E2M1[nib & 0x7]
    val = np.where(nib & 0x8, -mag, mag)
    assert scale.shape == (R, C // group), (scale.shape, (R, C // group))
    s = np.exp2(np.asarray(scale, dtype=np.float64) - 127.0)
    return val * np.repeat(s, group, axis=1)


# --------------------------------------------------------------------------------------------
# small math helpers (float64)
# --------------------------------------------------------------------------------------------

def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _silu(x):
    return x * _sigmoid(x)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _rmsnorm(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def _lin(x, w):
    """x W with W stored [out, in]."""
    return x @ w.T


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------

class RefModel:
    def __init__(self, ckpt_dir: str):
        with open(os.path.join(ckpt_dir, "config.json")) as fh:
            top = json.load(fh)
        if "text_config" in top:            # K3: nested text config, prefixed tensors
            tc = top["text_config"]
            prefix = "language_model."
        else:                               # Kimi-Linear: flat, no prefix
            tc = top
            prefix = ""
        self.top, self.cfg = top, tc
        raw = _read_checkpoint_tensors(ckpt_dir)
        if prefix:
            assert any(k.startswith(prefix) for k in raw), "K3 checkpoint without language_model. prefix"
        self.t = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}

        c = tc
        self.H = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        self.V = c["vocab_size"]
        self.eps = float(c["rms_norm_eps"])
        la = c["linear_attn_config"]
        full = [int(i) for i in la["full_attn_layers"]]
        kda = [int(i) for i in la["kda_layers"]]
        # 1-based lists (§1.3)
        self.is_kda = [(l + 1) in kda for l in range(self.L)]
        for l in range(self.L):
            assert ((l + 1) in kda) != ((l + 1) in full), f"layer {l} must be exactly one of KDA/MLA"
        self.N = int(la["num_heads"])
        self.dk = int(la["head_dim"])
        self.conv_k = int(la["short_conv_kernel_size"])
        self.gate_lb = la.get("gate_lower_bound", None)
        self.full_rank_gate = bool(la.get("use_full_rank_gate", False))
        # MLA
        self.nh = int(c["num_attention_heads"])
        self.q_lora = c.get("q_lora_rank", None)
        self.r_kv = int(c["kv_lora_rank"])
        self.d_nope = int(c["qk_nope_head_dim"])
        self.d_rope = int(c["qk_rope_head_dim"])
        self.d_v = int(c["v_head_dim"])
        self.mla_gate = bool(c.get("mla_use_output_gate", False))
        assert c.get("mla_use_nope", True), "reference only implements NoPE MLA"
        # FFN / MoE
        self.act = c["hidden_act"]
        self.situ_b1 = float(c.get("activation_situ_beta", 4.0))
        self.situ_b2 = float(c.get("activation_situ_linear_beta", 25.0))
        self.first_dense = int(c.get("first_k_dense_replace", 1))
        self.moe_freq = int(c.get("moe_layer_freq", 1))
        self.E = int(c["num_experts"])
        self.topk = int(c.get("num_experts_per_token", c.get("num_experts_per_tok")))
        self.renorm = bool(c.get("moe_renormalize", True))
        self.rsf = float(c.get("routed_scaling_factor", 1.0))
        self.latent = c.get("routed_expert_hidden_size", None)
        self.latent_norm = bool(c.get("latent_moe_use_norm", self.latent is not None))
        assert c.get("moe_router_activation_func", "sigmoid") == "sigmoid"
        assert int(c.get("num_expert_group", 1) or 1) == 1, "group-limited routing not implemented"
        # AttnRes
        self.attn_res = c.get("attn_res_block_size", None)
        # quantization
        qc = c.get("quantization_config", top.get("quantization_config")) or {}
        grp = 32
        for g in (qc.get("config_groups") or {}).values():
            grp = int(((g or {}).get("weights") or {}).get("group_size", grp))
        self.mx_group = grp
        self._experts: dict = {}

    # ---- tensor access -----------------------------------------------------------------------
    def w(self, name):
        return np.asarray(self.t[name], dtype=np.float64)

    def has(self, name):
        return name in self.t

    def expert_weight(self, l, e, which):
        key = (l, e, which)
        if key not in self._experts:
            base = f"model.layers.{l}.block_sparse_moe.experts.{e}.{which}"
            if self.has(base + ".weight_packed"):
                W = mxfp4_dequant(self.t[base + ".weight_packed"], self.t[base + ".weight_scale"], self.mx_group)
            else:
                W = self.w(base + ".weight")
            self._experts[key] = W
        return self._experts[key]

    # ---- building blocks -----------------------------------------------------------------------
    def glu(self, g, u):
        if self.act == "situ":
            b1, b2 = self.situ_b1, self.situ_b2
            return (b1 * np.tanh(g / b1) * _sigmoid(g)) * (b2 * np.tanh(u / b2))
        assert self.act == "silu", self.act
        return _silu(g) * u

    def mlp(self, x, pre):
        return _lin(self.glu(_lin(x, self.w(pre + "gate_proj.weight")), _lin(x, self.w(pre + "up_proj.weight"))),
                    self.w(pre + "down_proj.weight"))

    def short_conv(self, xhat, w):
        """xhat [B,T,C], w [C,1,K] -> SiLU(causal depthwise conv)."""
        B, T, C = xhat.shape
        K = w.shape[-1]
        w = w.reshape(C, K)
        xp = np.concatenate([np.zeros((B, K - 1, C)), xhat], axis=1)
        y = np.zeros_like(xhat)
        for i in range(K):               # tap i multiplies x_{t-(K-1)+i}; tap K-1 = current token
            y += w[:, i] * xp[:, i:i + T]
        return _silu(y)

    def kda(self, l, x, tr):
        p = f"model.layers.{l}.self_attn."
        B, T, _ = x.shape
        N, d = self.N, self.dk
        q = self.short_conv(_lin(x, self.w(p + "q_proj.weight")), self.w(p + "q_conv1d.weight"))
        k = self.short_conv(_lin(x, self.w(p + "k_proj.weight")), self.w(p + "k_conv1d.weight"))
        v = self.short_conv(_lin(x, self.w(p + "v_proj.weight")), self.w(p + "v_conv1d.weight"))
        q = q.reshape(B, T, N, d)
        k = k.reshape(B, T, N, d)
        v = v.reshape(B, T, N, d)
        f = _lin(_lin(x, self.w(p + "f_a_proj.weight")), self.w(p + "f_b_proj.weight")).reshape(B, T, N, d)
        z = f + self.w(p + "dt_bias").reshape(N, d)
        A_log = self.w(p + "A_log").reshape(-1)
        assert A_log.size >= N
        A = np.exp(A_log[:N])[:, None]                                # live heads only (§3.1 padding)
        if self.gate_lb is not None:                                  # K3
            g = float(self.gate_lb) * _sigmoid(A * z)
        else:                                                         # Kimi-Linear
            g = -A * _softplus(z)
        beta = _sigmoid(_lin(x, self.w(p + "b_proj.weight")))          # [B,T,N]
        qn = _l2norm(q) * d ** -0.5
        kn = _l2norm(k)
        S = np.zeros((B, N, d, d))
        o = np.empty((B, T, N, d))
        alpha = np.exp(g)
        for t in range(T):
            S = S * alpha[:, t, :, :, None]                            # Diag(alpha) S
            kt = kn[:, t]
            mem = np.einsum("bnkv,bnk->bnv", S, kt)
            delta = beta[:, t, :, None] * (v[:, t] - mem)
            S = S + kt[..., :, None] * delta[..., None, :]
            o[:, t] = np.einsum("bnkv,bnk->bnv", S, qn[:, t])
        if self.full_rank_gate:
            G = _lin(x, self.w(p + "g_proj.weight"))
        else:
            G = _lin(_lin(x, self.w(p + "g_a_proj.weight")), self.w(p + "g_b_proj.weight"))
        G = G.reshape(B, T, N, d)
        on = _rmsnorm(o, self.w(p + "o_norm.weight"), self.eps) * _sigmoid(G)
        if tr is not None:
            tr[f"L{l}.kda.g"] = g
            tr[f"L{l}.kda.o"] = o
        return _lin(on.reshape(B, T, N * d), self.w(p + "o_proj.weight"))

    def mla(self, l, x, tr):
        p = f"model.layers.{l}.self_attn."
        B, T, _ = x.shape
        nh, dn, dr, dv, rkv = self.nh, self.d_nope, self.d_rope, self.d_v, self.r_kv
        if self.q_lora:
            qa = _rmsnorm(_lin(x, self.w(p + "q_a_proj.weight")), self.w(p + "q_a_layernorm.weight"), 1e-6)
            q = _lin(qa, self.w(p + "q_b_proj.weight"))
        else:
            q = _lin(x, self.w(p + "q_proj.weight"))
        q = q.reshape(B, T, nh, dn + dr)
        c = _lin(x, self.w(p + "kv_a_proj_with_mqa.weight"))
        c_kv, k_r = c[..., :rkv], c[..., rkv:]
        assert k_r.shape[-1] == dr
        cbar = _rmsnorm(c_kv, self.w(p + "kv_a_layernorm.weight"), 1e-6)
        kv = _lin(cbar, self.w(p + "kv_b_proj.weight")).reshape(B, T, nh, dn + dv)
        k_n, v = kv[..., :dn], kv[..., dn:]
        k = np.concatenate([k_n, np.broadcast_to(k_r[:, :, None, :], (B, T, nh, dr))], axis=-1)
        s = np.einsum("bthd,bshd->bhts", q, k) * (dn + dr) ** -0.5
        mask = np.triu(np.ones((T, T), dtype=bool), 1)
        s = np.where(mask, -np.inf, s)
        s = s - s.max(-1, keepdims=True)
        a = np.exp(s)
        a = a / a.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshd->bthd", a, v).reshape(B, T, nh * dv)
        if self.mla_gate:
            o = o * _sigmoid(_lin(x, self.w(p + "g_proj.weight")))
        return _lin(o, self.w(p + "o_proj.weight"))

    def is_moe(self, l):
        return l >= self.first_dense and (l % self.moe_freq == 0)

    def moe(self, l, x, tr):
        p = f"model.layers.{l}.block_sparse_moe."
        B, T, H = x.shape
        xf = x.reshape(B * T, H)
        s = _sigmoid(_lin(xf, self.w(p + "gate.weight")))              # [BT, E]
        bias = self.w(p + "gate.e_score_correction_bias")
        sel_score = s + bias
        order = np.argsort(-sel_score, axis=-1, kind="stable")
        sel = order[:, :self.topk]                                       # selection uses score + bias only
        srt = np.take_along_axis(sel_score, order, axis=-1)
        margin = srt[:, self.topk - 1] - srt[:, self.topk] if self.topk < self.E else np.full(B * T, np.inf)
        wts = np.take_along_axis(s, sel, axis=-1)                         # weights from RAW scores
        if self.renorm and self.topk > 1:
            wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
        wts = wts * self.rsf
        if tr is not None:
            tr[f"L{l}.moe.sel"] = sel.reshape(B, T, -1)
            tr[f"L{l}.moe.w"] = wts.reshape(B, T, -1)
            tr[f"L{l}.moe.margin"] = margin.reshape(B, T)
        if self.latent:
            zin = _lin(xf, self.w(p + "routed_expert_down_proj.weight"))
        else:
            zin = xf
        y = np.zeros((B * T, zin.shape[1]))
        for e in np.unique(sel):
            rows, slot = np.nonzero(sel == e)
            ze = zin[rows]
            he = self.glu(_lin(ze, self.expert_weight(l, e, "w1")), _lin(ze, self.expert_weight(l, e, "w3")))
            ye = _lin(he, self.expert_weight(l, e, "w2"))
            y[rows] += wts[rows, slot][:, None] * ye
        if self.latent:
            if self.latent_norm:
                y = _rmsnorm(y, self.w(p + "routed_expert_norm.weight"), self.eps)
            y = _lin(y, self.w(p + "routed_expert_up_proj.weight"))
        out = y + self.mlp(xf, p + "shared_experts.")
        return out.reshape(B, T, H)

    def ffn(self, l, x, tr):
        if self.is_moe(l):
            assert self.has(f"model.layers.{l}.block_sparse_moe.gate.weight"), f"layer {l}: MoE tensors missing"
            return self.moe(l, x, tr)
        pre = f"model.layers.{l}.mlp."
        if not self.has(pre + "gate_proj.weight"):             # HF 5.x Kimi-Linear naming deviation
            pre = f"model.layers.{l}.block_sparse_moe."
        return self.mlp(x, pre)

    def attn(self, l, x, tr):
        return self.kda(l, x, tr) if self.is_kda[l] else self.mla(l, x, tr)

    def mix(self, cands, pre):
        """AttnRes depth mixer (§2.2): softmax over candidates of <RMSNorm(v_i) * gamma, u>; mixes raw v_i."""
        gu = self.w(pre + "_norm.weight") * self.w(pre + "_proj.weight").reshape(-1)
        V = np.stack(cands, axis=0)                                       # [n, B, T, H]
        sc = np.sum(_rmsnorm(V, None, self.eps) * gu, axis=-1)            # [n, B, T]
        sc = sc - sc.max(0, keepdims=True)
        a = np.exp(sc)
        a = a / a.sum(0, keepdims=True)
        return np.sum(a[..., None] * V, axis=0)

    # ---- full forward ------------------------------------------------------------------------
    def forward(self, ids, trace=None):
        ids = np.asarray(ids, dtype=np.int64)
        assert ids.ndim == 2
        emb = self.w("model.embed_tokens.weight")[ids]                     # [B,T,H]
        tr = trace
        if self.attn_res:
            bs = int(self.attn_res)
            bank: list = []
            p = emb
            for l in range(self.L):
                pl = f"model.layers.{l}."
                h = self.mix(bank + [p], pl + "self_attention_res") if bank else p
                if l % bs == 0:
                    bank.append(p)
                    p = None
                xa = _rmsnorm(h, self.w(pl + "input_layernorm.weight"), self.eps)
                a = self.attn(l, xa, tr)
                p = a if p is None else p + a
                h = self.mix(bank + [p], pl + "mlp_res")
                xf = _rmsnorm(h, self.w(pl + "post_attention_layernorm.weight"), self.eps)
                f = self.ffn(l, xf, tr)
                p = p + f
                if tr is not None:
                    tr[f"L{l}.attn_in"] = xa
                    tr[f"L{l}.ffn_in"] = xf
                    tr[f"L{l}.attn_out"] = a
                    tr[f"L{l}.ffn_out"] = f
                    tr[f"L{l}.partial"] = p
            x = self.mix(bank + [p], "model.output_attn_res")
        else:
            x = emb
            for l in range(self.L):
                pl = f"model.layers.{l}."
                xa = _rmsnorm(x, self.w(pl + "input_layernorm.weight"), self.eps)
                a = self.attn(l, xa, tr)
                x = x + a
                xf = _rmsnorm(x, self.w(pl + "post_attention_layernorm.weight"), self.eps)
                f = self.ffn(l, xf, tr)
                x = x + f
                if tr is not None:
                    tr[f"L{l}.attn_in"] = xa
                    tr[f"L{l}.ffn_in"] = xf
                    tr[f"L{l}.attn_out"] = a
                    tr[f"L{l}.ffn_out"] = f
                    tr[f"L{l}.hidden"] = x
        xn = _rmsnorm(x, self.w("model.norm.weight"), self.eps)
        if tr is not None:
            tr["final_hidden"] = xn
        return _lin(xn, self.w("lm_head.weight"))


@functools.lru_cache(maxsize=4)
def _load_cached(ckpt_dir: str) -> RefModel:
    return RefModel(ckpt_dir)


def load_reference(ckpt_dir) -> RefModel:
    return _load_cached(os.path.abspath(str(ckpt_dir)))


def reference_forward(ckpt_dir, ids, trace=None):
    return load_reference(ckpt_dir).forward(ids, trace)


def reference_logits(ckpt_dir, ids) -> np.ndarray:
    """float64 logits [B, T, V] of the checkpoint in ``ckpt_dir`` for token ids [B, T]."""
    return reference_forward(ckpt_dir, ids)


def reference_greedy(ckpt_dir, ids, n: int) -> np.ndarray:
    """Greedy continuation by full recompute; returns [B, T + n]."""
    m = load_reference(ckpt_dir)
    seq = np.asarray(ids, dtype=np.int64)
    for _ in range(n):
        nxt = np.argmax(m.forward(seq)[:, -1], axis=-1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return seq


def router_min_margin(ckpt_dir, ids) -> float:
    """Smallest gap between the k-th and (k+1)-th selection score (score + bias) over all MoE decisions."""
    tr: dict = {}
    reference_forward(ckpt_dir, ids, tr)
    ms = [v.min() for k, v in tr.items() if k.endswith(".moe.margin")]
    return float(min(ms)) if ms else float("inf")
