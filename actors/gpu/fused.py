"""Launches of the fused decode kernels (cl/decode.cl) for the tasks graph/fuse.py produced.

The prepared activation row lives in the arena's "act" scratch and the per-step RoPE table in its
"rope" scratch (memory/layout.py). Its format follows the precision (ACT_BITS): f32 keeps the
oracle's numerics (only reassociated: d * sum(q x) + m * sum(x) per block), q16 rounds it to int16
per 32-block, q8 to int8.
"""
from __future__ import annotations

from socllm.memory.layout import ATT_SPLITS
from socllm.models.quant import QK

from socllm.actors.gpu.kernels import CLKernels, check_aligned, out_offset, round_up, weight_build


ACT_BITS = {"q16": 16, "q8": 8}     # other precisions: f32 activations


def counter_at(rope_off: int) -> int:
    """last_group's atomic word (epilogue.cl): the rope area's end."""
    return rope_off + 4096 - 64


def pos_word_at(rope_off: int) -> int:
    """the step's position word (an int32 the GPU backend writes before each step), beside it"""
    return counter_at(rope_off) + 8


class FusedCL:
    def __init__(self, kernels: CLKernels, act_off: int, rope_off: int, precision: str = "f32",
                 att_off: int | None = None, att_bytes: int = 0, pos_word: bool = False):
        """att_off / att_bytes: the scratch of split-K attention's partials (none: no
        attention_split). pos_word: the kernels read pos0 from pos_word_at(rope_off), which the
        caller writes before each step, so no launch's arguments move with pos0 (setting an
        argument again costs ~15 us a launch on NVIDIA's OpenCL: scripts/launch_cost.py)."""
        if act_off % 64 or rope_off % 64 or (att_off or 0) % 64:
            raise ValueError("the act, rope and att scratch areas must be 64-byte aligned")
        self.k, self.act, self.table = kernels, act_off, rope_off
        # the slot whose row the act scratch holds prepared (a norm's stored output), else None:
        # a MoE layer's experts read it there instead of preparing it again
        self.act_row = None
        self.att, self.att_bytes = att_off, att_bytes
        self.counter = counter_at(rope_off)
        self.pw = pos_word_at(rope_off) if pos_word else 0
        self.bits = ACT_BITS.get(precision, 32)
        self.ks = kernels._kernels(64, self.bits)
        # a GPU (LIN_T > 1) shares a GEMV row pair over LIN_T work-items, runs an epilogue over
        # its last work-group and attention a work-group per head (decode.cl, epilogue.cl)
        self.lin_t, self.lin_r, self.att_wg = kernels.lin_t, kernels.lin_r, kernels.att_wg

    def run(self, f, N: int, pos0: int):
        if N != 1:
            raise ValueError(f"{f.op}: fused decode kernels take one row, got N={N}")
        getattr(self, "_" + f.op)(f.args, pos0)

    def _go(self, name, gsize, lsize, *args, w=None):
        """w: a weight ref of the launch: the program built for its format (graph/fuse.py joins
        the weights of one launch only when they share a format)."""
        ks = self.ks
        if w is not None:
            _, wopts = weight_build(w)
            ks = self.k._kernels(64, self.bits, None, wopts) if wopts else self.ks
        self.k._go(name, gsize, lsize, *args, ks=ks)

    def _rows(self, m: int):
        """global and local size of the kernels over row pairs of m (decode.cl ROW_PAIR)"""
        return (self.lin_t, round_up(-(-m // 2), self.lin_r)), (self.lin_t, self.lin_r)

    def _prep(self, a, pos0):
        """x [K] -> act"""
        K = a["K"]
        if K % QK:
            raise ValueError(f"prep: K={K} is not a multiple of {QK}")
        check_aligned("prep", a["x"][1])
        self._go("prep", (round_up(K // QK, 8),), (8,), a["x"][1], self.act, K)
        self.act_row = a["x"][1]

    def _norm_prep(self, a, pos0):
        """x [D], w [D] -> act of rmsnorm(x) (and out [D] if a["store"])"""
        D = a["D"]
        if D % QK:
            raise ValueError(f"norm_prep: D={D} is not a multiple of {QK}")
        check_aligned("norm_prep", a["x"][1], a["w"][1], a["out"][1])
        g = (self.lin_t,) if self.lin_t > 1 else (1,)
        self._go("norm_prep", g, g, a["x"][1], a["w"][1], self.act, a["out"][1], D,
                 a["eps"], int(a["store"]), int(a.get("natural", False)))
        self.act_row = a["out"][1] if a["store"] and not a.get("natural") else None

    def _rope_table(self, a, pos0):
        """cos, sin [head_dim / 2] of position pos0 -> the rope scratch"""
        hd = a["head_dim"]
        self._go("rope_table", (hd // 2,), None, self.table, hd, a["theta"], 0 if self.pw else pos0,
                 a["f"][1] if "f" in a else 0, self.pw)

    def _linear_act(self, a, pos0):
        """act [K], W [M, K] -> out [M] (+ res [M])"""
        M, ((qs, d, m), _) = a["M"], weight_build(a["w"])
        rows = a["rows"][1] if "rows" in a else 0          # paged KV: KV row rows[0]
        if not rows and self.pw and a["out"][0] == "kv" and a.get("ld", M) == M:
            rows = self.pw                                  # a contiguous cache: KV row pos0
        out = a["out"][1] if rows else out_offset(a["out"], pos0, a.get("ld", M), self.k.kv_half)
        res = a["res"][1] if a["res"] is not None else 0
        self._go("linear_act", *self._rows(M), self.act, qs, d, m, out, res, a["K"], M,
                 int(a["res"] is not None), rows, w=a["w"])

    def _qkv_rope(self, a, pos0):
        """act [K] -> q [Mq] roped, K cache row pos0 roped, V cache row pos0"""
        Mq, Mk, hd = a["Mq"], a["Mk"], a["head_dim"]
        if Mq % 2 or Mk % 2 or hd % 2:
            raise ValueError(f"qkv_rope: Mq={Mq}, Mk={Mk}, head_dim={hd} must be even")
        ws = [x for w in ("wq", "wk", "wv") for x in weight_build(a[w])[0]]
        rows = a["rows"][1] if "rows" in a else 0
        if not rows and self.pw and a["k_out"][0] == a["v_out"][0] == "kv":
            rows = self.pw      # a contiguous cache: KV row pos0, read from the position word
        if rows:                # the kernel reads the K/V row from the pool
            outs = [a["q_out"][1], a["k_out"][1], a["v_out"][1]]
        else:
            outs = [out_offset(a[o], pos0, m, self.k.kv_half)
                    for o, m in (("q_out", Mq), ("k_out", Mk), ("v_out", Mk))]
        self._go("qkv_rope", *self._rows(Mq + 2 * Mk), self.act, *ws, *outs, self.table,
                 a["K"], Mq, Mk, hd, rows, w=a["wq"])

    def _gate_up_silu(self, a, pos0):
        """act [K] -> out [M] = silu(W_gate act) * (W_up act)"""
        M = a["M"]
        self._go("gate_up_silu", *self._rows(M), self.act, *weight_build(a["wg"])[0],
                 *weight_build(a["wu"])[0], a["out"][1], a["K"], M, w=a["wg"])

    def _moe_gate_up(self, a, pos0):
        """x [K] -> out [k, M] = act(gate) * up of the row's k experts (cl/moe.cl moe_gate_up),
        its row prepared in the MoE scratch (CLKernels._moe_rows), or in the act scratch where the
        norm before prepared it there; op by op where there is none"""
        k, (g, wopts), (u, _) = self.k, weight_build(a["wg"]), weight_build(a["wu"])
        held = self.act if self.act_row == a["x"][1] else None
        prepared = k._moe_rows(a["x"][1], a["K"], 1, wopts, a["wg"][0], held)
        if prepared is None:
            for op, args in a["tasks"]:
                k.run(op, args, 1, pos0)
            return
        ks, off, row_bytes = prepared
        (gsize, lsize), kk = self._rows(a["M"]), a["k"]
        k._go("moe_gate_up", (*gsize, kk), (*lsize, 1), off, a["route"][1], *g, *u, a["out"][1],
              a["K"], a["M"], kk, a["gelu"], row_bytes, ks=ks)

    def _moe_down(self, a, pos0):
        """moe_linear's weighted sum of the k experts' down projections, plus the residual"""
        if self.k._moe_rows(a["x"][1], a["K"], a["k"], weight_build(a["w"])[1], a["w"][0]) is None:
            for op, args in a["tasks"]:
                self.k.run(op, args, 1, pos0)
            return
        self.k.run("moe_linear", a, 1, pos0)

    def _lm_head_act(self, a, pos0):
        """act [D] (natural order), table Q8_0 [V, D] -> logits [V]"""
        D, V, (_, qs, d) = a["D"], a["V"], a["table"]
        if D % QK:
            raise ValueError(f"lm_head: D={D} is not a multiple of {QK}")
        check_aligned("lm_head", qs, to=16)
        g, l = ((self.lin_t, round_up(V, self.lin_r)), (self.lin_t, self.lin_r)) if self.lin_t > 1 \
            else ((round_up(V, 64),), (64,))
        self._go("lm_head_act", g, l, self.act, qs, d, a["out"][1], D, V)

    def _attention_split(self, a, pos0, launch: bool = True):
        """q [H*hd], K/V cache rows 0 .. pos0 -> partials [H, ATT_SPLITS, hd + 2] in att
        (launch=False: only the checks)"""
        H, KVH, hd = a["heads"], a["kv_heads"], a["head_dim"]
        if self.att is None or ATT_SPLITS * H * (hd + 2) * 4 > self.att_bytes:
            raise ValueError(f"attention_split: no room for {H} heads' partials")
        if H % KVH or hd % QK:
            raise ValueError(f"attention_split: heads {H} / kv {KVH}, head_dim {hd} (a multiple of {QK})")
        check_aligned("attention", a["q"][1], a["k"][1], a["v"][1])
        if not launch:
            return
        self.k._go("attention_split", (ATT_SPLITS,), (1,), a["q"][1], a["k"][1], a["v"][1],
                   self.att, H, KVH, pos0, *_pages(a), a.get("window", 0), ks=self.k._kernels(hd, self.bits))

    def _merge_prep(self, a, pos0):
        """partials -> act of the attention row (and out [H*hd] if a["store"])"""
        H, hd = a["heads"], a["head_dim"]
        check_aligned("merge_prep", a["out"][1])
        self.k._go("merge_prep", (1,), (1,), self.att, self.act, a["out"][1], H, int(a["store"]),
                   ks=self.k._kernels(hd, self.bits))

    # -- with an epilogue in the launch's last work-group (decode.cl, last_group) ---------------
    def _linear_act_norm(self, a, pos0):
        """linear_act, then norm_prep of its output [M] -> act (and norm_out if a["store"])"""
        M, ((qs, d, m), _) = a["M"], weight_build(a["w"])
        if M % QK or a["out"][0] != "a":
            raise ValueError(f"linear_act_norm: M={M} must be a multiple of {QK}, out a slot")
        check_aligned("linear_act_norm", a["out"][1], a["norm_w"][1], a["norm_out"][1])
        res = a["res"][1] if a["res"] is not None else 0
        self._go("linear_act_norm", *self._rows(M), self.act, qs, d, m, a["out"][1], res, a["K"], M,
                 int(a["res"] is not None), a["norm_w"][1], a["norm_out"][1], a["eps"],
                 int(a["store"]), int(a["natural"]), self.counter, w=a["w"])
        self.act_row = a["norm_out"][1] if a["store"] and not a["natural"] else None

    def _gate_up_silu_prep(self, a, pos0):
        """gate_up_silu, then prep of its output [M] -> act"""
        M = a["M"]
        if M % QK:
            raise ValueError(f"gate_up_silu_prep: M={M} is not a multiple of {QK}")
        check_aligned("gate_up_silu_prep", a["out"][1])
        self.act_row = None
        self._go("gate_up_silu_prep", *self._rows(M), self.act, *weight_build(a["wg"])[0],
                 *weight_build(a["wu"])[0], a["out"][1], a["K"], M, self.counter, w=a["wg"])

    def _attention_merge(self, a, pos0):
        """attention_split, then merge_prep -> act (and out if a["store"])"""
        H, KVH, hd = a["heads"], a["kv_heads"], a["head_dim"]
        self._attention_split(a, pos0, launch=False)
        check_aligned("attention_merge", a["out"][1])
        self.act_row = None
        g, l = ((self.att_wg, H), (self.att_wg, 1)) if self.att_wg > 1 and self.lin_t > 1 \
            else ((ATT_SPLITS,), (1,))
        self.k._go("attention_merge", g, l, a["q"][1], a["k"][1], a["v"][1],
                   self.att, H, KVH, 0 if self.pw else pos0, self.act, a["out"][1], int(a["store"]),
                   self.counter, *_pages(a), a.get("window", 0), self.pw,
                   ks=self.k._kernels(hd, self.bits))


def _pages(a: dict) -> tuple:
    """(seq, btab offsets, block rows, table length) of a paged attention's args, else zeros."""
    if "btab" not in a:
        return 0, 0, 0, 0
    if a["block_rows"] % 8:
        raise ValueError(f"attention: block_rows {a['block_rows']} is not a multiple of 8")
    return a["seq"][1], a["btab"][1], a["block_rows"], a["max_blocks"]
