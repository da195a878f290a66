"""The MoE GGUF of a moefy plan (models/moefy.py): the dense file with every FFN as a
Mixtral-style mixture of experts that llama.cpp loads, every other tensor and key copied.

llama.cpp weights the k chosen experts by their renormalised softmax (sum 1), so two moves give
back "the sum of the chosen experts" (MoEfication's masked FFN, and the dense model at k = E):
every down_exps is multiplied by k, and the router is flattened, W <- tau W, tau per layer from
the spread of its logits on calibration text (TAU_SPREAD), so that k * w_j = exp(tau (z_j - mean))
stays within ~1e-3 of 1 (1e-6 at k = E) while the order of the logits (which experts win) is the
unflattened router's. The scale k is baked in: build one file per k rather than overriding
expert_used_count.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFValueType as V, GGUFWriter
from gguf.quants import dequantize

from .gptq import gptq_q4_1
from .moefy import ATOM, F32, RIDGE, ExpertLayer, check_args

# tau * the largest spread (max - min) of a layer's router logits over the calibration tokens
# (module doc). k < E: large enough that softmax's f32 probabilities (spacing 6e-8 near 1/E) keep
# the logits' order but for gaps under 1e-4 of the spread; k = E: every expert runs and only
# the weights matter, so they are 1/k to f32 rounding.
TAU_SPREAD = {"some": 1e-3, "all": 1e-6}
Q4_1_BYTES = 20           # a Q4_1 block: f16 d, f16 m, 16 bytes of nibbles


def write_moe(path: str, out: str, moe: dict, top_k: int, bar=None) -> None:
    """The dense GGUF at `path` with every FFN as experts (moe: plan()'s), k = top_k folded into
    down_exps; every other tensor and key copied as is (gguf-py's gguf_new_metadata.py way)."""
    from .gguf_file import open_gguf
    reader = open_gguf(path)
    layers, meta = moe["layers"], moe["meta"]
    E, n_ff = layers[0].groups.shape
    check_args(E * n_ff, E, top_k, meta["split"])
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(out, arch=arch)
    w.data_alignment = int(reader.alignment)                # general.alignment, copied below
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        value = n_ff if f.name == f"{arch}.feed_forward_length" else f.contents()
        sub = f.types[-1] if f.types[0] == V.ARRAY else None
        w.add_key_value(f.name, value, f.types[0], sub_type=sub)
    w.add_uint32(f"{arch}.expert_count", E)
    w.add_uint32(f"{arch}.expert_used_count", top_k)
    _add_meta(w, meta, layers, top_k)
    T = {t.name: t for t in reader.tensors}
    done = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in ("ffn_gate", "ffn_up", "ffn_down"):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        i = int(parts[1])
        if i in done:
            continue
        done.add(i)
        for name, arr, kind in expert_tensors(T, i, layers[i], top_k, meta["split"]):
            w.add_tensor(f"blk.{i}.{name}.weight", arr, raw_dtype=kind)
        bar and bar("writing", len(done), len(layers))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def expert_tensors(T: dict, i: int, layer: ExpertLayer, k: int, split: str):
    """-> (name, array, type) of layer i's router and three expert tensors (notes/moe.md §1)."""
    g = layer.groups                                                    # [E, n_ff]
    E, n_ff = g.shape
    gate = np.asarray(T[f"blk.{i}.ffn_gate.weight"].data)               # [ffn, dim/32*20] u8
    up = np.asarray(T[f"blk.{i}.ffn_up.weight"].data)
    down = np.asarray(T[f"blk.{i}.ffn_down.weight"].data)               # [dim, ffn/32*20] u8
    dim = down.shape[0]
    if split == "atoms":                                                # byte copies of blocks
        blocks = down.reshape(dim, -1, Q4_1_BYTES)[:, g[:, ::ATOM] // ATOM]   # [dim, E, n/32, 20]
        blocks = np.ascontiguousarray(blocks.transpose(1, 0, 2, 3))
        dm = blocks[..., :4].copy().view(np.float16)                    # d, m: [E, dim, n/32, 2]
        blocks[..., :4] = (dm.astype(F32) * F32(k)).astype(np.float16).view(np.uint8)
        down_exps = blocks.reshape(E, dim, -1)
    else:                                                               # requantized columns
        D = dequantize(down, Q.Q4_1)                                    # [dim, ffn] f32
        down_exps = np.stack([gptq_q4_1(D[:, g[e]] * F32(k), layer.hess[e]) for e in range(E)])
    yield "ffn_gate_inp", (tau_of(layer, k) * layer.router).astype(F32), Q.F32   # [E, dim]
    yield "ffn_gate_exps", gate[g], Q.Q4_1                              # [E, n_ff, dim/32*20]
    yield "ffn_up_exps", up[g], Q.Q4_1
    yield "ffn_down_exps", down_exps, Q.Q4_1                            # [E, dim, n_ff/32*20]


def tau_of(layer: ExpertLayer, k: int) -> float:
    """The router's flattening for a file of k experts a token (TAU_SPREAD)."""
    return TAU_SPREAD["all" if k == len(layer.groups) else "some"] / max(layer.spread, 1e-30)


def _add_meta(w: GGUFWriter, meta: dict, layers: list[ExpertLayer], k: int) -> None:
    """socllm.moe.*: how the file was built (llama.cpp never reads these keys)."""
    E = len(layers[0].groups)
    w.add_uint32("socllm.moe.experts", E)
    w.add_uint32("socllm.moe.top_k", k)                 # the k folded into down_exps
    w.add_string("socllm.moe.split", meta["split"])
    w.add_uint32("socllm.moe.seed", meta["seed"])
    w.add_string("socllm.moe.router", f"ridge (lambda {RIDGE:g} x mean diag X^T X) on each "
                 "token's centred expert shares, of sum |silu(gate) * up| |down column|")
    w.add_string("socllm.moe.tau_rule", "tau * the largest (max - min router logit) over the "
                 f"calibration tokens = {TAU_SPREAD['all' if k == E else 'some']:g}")
    w.add_array("socllm.moe.tau", [tau_of(l, k) for l in layers])
    w.add_array("socllm.moe.recall", [float(l.recall[k - 1]) for l in layers])
    w.add_array("socllm.moe.neurons", np.concatenate([l.groups.ravel() for l in layers]).tolist())
    w.add_string("socllm.moe.calibration_text", meta["calibration_text"])
    w.add_uint32("socllm.moe.calibration_tokens", meta["calibration_tokens"])
    w.add_string("socllm.moe.source_sha256", meta["source_sha256"])
