"""One layer's placement as a local search: the state (counts, which GPU and node holds what), the scores of
its steps (rewrite one slot, swap two), a round of improving steps, and the repairs of broken rules."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import REL_EPS, BoolArray, FloatArray, IntArray, Layout

_FOCUS = 16  # overloaded GPUs whose swaps are scored in one search round
_PARTNERS = 32  # at least this many of the lightest GPUs (or half of all) are swap partners
_PARTNER_TRIES = 16  # best partners tried per overloaded GPU before it waits for the next round
CANDIDATES = 24  # rewrites scored exactly per round, picked by a cheap estimate


@dataclass(frozen=True)
class Step:
    swap: bool  # swap slots a and b, else slot a now holds expert b
    a: int
    b: int
    cost: int  # change in the number of slots that differ from previous
    forced: bool = False  # repairs a constraint violation
    top: float = np.inf  # busiest GPU's load after the step


Scores = tuple[BoolArray, FloatArray, FloatArray, IntArray]  # valid, busiest GPU after, gain, cost


class Search:
    """One layer's placement, moved a step at a time: rewrite a slot (counts change) or swap two slots.

    Steps cut the load above a target ``T``, ``excess = sum_g max(0, gpu_load_g - T)``, and never raise
    the busiest GPU; with a previous placement they are ranked by excess cut per changed slot. Each round
    takes the best rewrite for the busiest GPU, or the best swaps of up to ``_FOCUS`` overloaded GPUs that
    touch disjoint GPUs (their effects then add up exactly).
    """

    def __init__(self, load: FloatArray, phy2log: IntArray, previous: IntArray | None, layout: Layout) -> None:
        self.load = load
        self.p2l = phy2log.copy()
        self.prev = previous
        self.layout = layout
        self.gos = layout.gpu_of_slot
        self.nog = layout.domain_of_gpu
        self.nos = self.nog[self.gos]
        experts, gpus = layout.experts, layout.gpus
        self.floor, self.cap = layout.limits()
        self.cnt = np.bincount(self.p2l, minlength=experts).astype(np.int64)
        self.hold = np.zeros((gpus, experts), dtype=np.int64)
        np.add.at(self.hold, (self.gos, self.p2l), 1)
        self.nodecnt = np.zeros((experts, layout.domains), dtype=np.int64)
        np.add.at(self.nodecnt, (self.p2l, self.nos), 1)
        self.distinct = (self.nodecnt > 0).sum(axis=1)
        self.waived = np.zeros(experts, dtype=bool)  # violations found impossible to repair

    # state ------------------------------------------------------------------------------------------
    def loads(self) -> FloatArray:
        w = self.load / self.cnt
        result: FloatArray = w[self.p2l].reshape(self.layout.gpus, -1).sum(axis=1)
        return result

    def rewrite(self, s: int, y: int) -> None:
        x, g = int(self.p2l[s]), int(self.gos[s])
        n = int(self.nog[g])
        self.hold[g, x] -= 1
        self.hold[g, y] += 1
        self.cnt[x] -= 1
        self.cnt[y] += 1
        self.nodecnt[x, n] -= 1
        self.nodecnt[y, n] += 1
        self.distinct[x] = int(np.count_nonzero(self.nodecnt[x]))
        self.distinct[y] = int(np.count_nonzero(self.nodecnt[y]))
        self.p2l[s] = y

    def apply(self, step: Step) -> None:
        if step.swap:
            x, y = int(self.p2l[step.a]), int(self.p2l[step.b])
            self.rewrite(step.a, y)
            self.rewrite(step.b, x)
        else:
            self.rewrite(step.a, step.b)

    def _changed(self, slots: IntArray, experts: IntArray) -> IntArray:
        """1 where slot ``slots`` holding ``experts`` would differ from previous (broadcast)."""
        if self.prev is None:
            return np.zeros(np.broadcast(slots, experts).shape, dtype=np.int64)
        result: IntArray = (experts != self.prev[slots]).astype(np.int64)
        return result

    # scoring ----------------------------------------------------------------------------------------
    def rewrites(self, s: IntArray, y: IntArray, gl: FloatArray, target: float, spread_y: bool = True) -> Scores:
        """Rewrite slot ``s[C]`` to expert ``y[C]``: every GPU holding either expert changes load.

        ``spread_y=False`` lets ``y``'s new copy land on a node it is already on (a later swap spreads it).
        """
        lay = self.layout
        x, h = self.p2l[s], self.gos[s]
        cx, cy = self.cnt[x], self.cnt[y]
        ok = (y != x) & (cx > self.floor) & (cy < self.cap)
        if not lay.allow_dup:
            ok &= self.hold[h, y] == 0
        if lay.spread:
            nh = self.nog[h]
            after_x = self.distinct[x] - (self.nodecnt[x, nh] == 1)
            ok &= (after_x >= np.minimum(lay.need(cx - 1), self.distinct[x])) | self.waived[x]
            after_y = self.distinct[y] + (self.nodecnt[y, nh] == 0)
            if spread_y:
                ok &= (after_y >= np.minimum(lay.need(cy + 1), self.distinct[y] + 1)) | self.waived[y]
        lx, ly = self.load[x], self.load[y]
        wx_new = lx / np.maximum(cx - 1, 1)
        wy_new = ly / (cy + 1)
        new = (
            gl[None, :]
            + self.hold[:, x].T * (wx_new - lx / cx)[:, None]
            + self.hold[:, y].T * (wy_new - ly / cy)[:, None]
        )
        new[np.arange(len(s)), h] += wy_new - wx_new
        gain = np.maximum(gl - target, 0.0).sum() - np.maximum(new - target, 0.0).sum(axis=1)
        cost = self._changed(s, y) - self._changed(s, x)
        return ok, new.max(axis=1), gain, cost

    def swaps(
        self, gs: IntArray, gl: FloatArray, target: float, partners: IntArray | None = None
    ) -> tuple[IntArray, IntArray, Scores]:
        """Swap each slot of GPUs ``gs[k]`` with each slot of ``partners[P]`` (default all): ``[k, S * P]``.

        Valid swaps lower GPU ``g`` and leave the partner below ``g``'s old load.
        """
        lay = self.layout
        per = lay.per_gpu
        t = np.arange(lay.slots) if partners is None else partners
        sg = gs[:, None] * per + np.arange(per)[None, :]  # [k, S]
        eg, et = self.p2l[sg], self.p2l[t]
        w = self.load / self.cnt
        d = w[eg][:, :, None] - w[et][None, None, :]  # [k, S, P]
        h = self.gos[t]
        lg = gl[gs][:, None, None]
        new_g = lg - d
        new_h = gl[h][None, None, :] + d
        ok = (h[None, None, :] != gs[:, None, None]) & (eg[:, :, None] != et[None, None, :])
        if not lay.allow_dup:
            ok &= self.hold.T[eg][:, :, h] == 0  # g's expert not on the partner GPU
            ok &= (self.hold[gs][:, et] == 0)[:, None, :]  # partner's expert not on g
        if lay.spread:
            ng, nh = self.nog[gs], self.nog[h]
            need = lay.need(self.cnt)
            de, dt = self.distinct[eg], self.distinct[et]
            after_e = (de - (self.nodecnt[eg, ng[:, None]] == 1))[:, :, None] + (self.nodecnt[eg][:, :, nh] == 0)
            ok_e = after_e >= np.minimum(need[eg], de)[:, :, None]
            after_t = (dt - (self.nodecnt[et, nh] == 1))[None, :] + (self.nodecnt[et][:, ng].T == 0)
            ok_t = after_t >= np.minimum(need[et], dt)[None, :]
            ok &= (nh[None, None, :] == ng[:, None, None]) | (ok_e & ok_t[:, None, :])
        pair = np.maximum(new_g, new_h)
        ok &= pair < lg * (1 - 1e-12)
        gain = (
            np.maximum(lg - target, 0.0)
            + np.maximum(gl[h] - target, 0.0)[None, None, :]
            - np.maximum(new_g - target, 0.0)
            - np.maximum(new_h - target, 0.0)
        )
        k, shape = len(gs), (len(gs), per, len(t))
        if self.prev is None:
            cost = np.zeros(shape, dtype=np.int64)
        else:
            was_g, was_t = self.prev[sg], self.prev[t]
            cost = (
                (et[None, None, :] != was_g[:, :, None]).astype(np.int64)
                + (eg[:, :, None] != was_t[None, None, :])
                - (eg != was_g)[:, :, None]
                - (et != was_t)[None, None, :]
            )
        s_idx = np.broadcast_to(sg[:, :, None], shape).reshape(k, -1)
        t_idx = np.broadcast_to(t, shape).reshape(k, -1)
        return s_idx, t_idx, (ok.reshape(k, -1), pair.reshape(k, -1), gain.reshape(k, -1), cost.reshape(k, -1))

    def _score(self, scores: Scores, top: float, per_slot: bool) -> FloatArray:
        ok, newmax, gain, cost = scores
        ok = ok & (gain > REL_EPS * top) & (newmax <= top * (1 + 1e-12))
        # per changed slot; steps that change no slot (or undo a change) come first
        raw = np.where(cost > 0, gain / np.maximum(cost, 1), gain * 1e9) if per_slot else gain
        result: FloatArray = np.where(ok, raw, -np.inf)
        return result

    # steps ------------------------------------------------------------------------------------------
    def improve(self, target: float, per_slot: bool) -> list[Step]:
        """One round of steps cutting the excess above ``target``; empty when none helps."""
        lay = self.layout
        gl = self.loads()
        g = int(gl.argmax())
        top = float(gl[g])
        if lay.per_gpu < 2:
            rewrite = self._best_rewrite(g, gl, target, top, per_slot)
            return [rewrite[1]] if rewrite else []
        over = np.flatnonzero(gl > target)
        focus = over[np.argsort(-gl[over], kind="stable")][:_FOCUS]
        # partners: slots on the lighter half of the GPUs (where the load can go)
        light = np.argsort(gl, kind="stable")[: max(_PARTNERS, lay.gpus // 2)]
        partners = (light[:, None] * lay.per_gpu + np.arange(lay.per_gpu)[None, :]).ravel()
        s_idx, t_idx, scores = self.swaps(focus, gl, target, partners)
        score = self._score(scores, top, per_slot)
        steps: list[Step] = []
        used = np.zeros(lay.gpus, dtype=bool)
        used_e = np.zeros(lay.experts, dtype=bool)
        if not np.isfinite(score[0].max()):  # the busiest GPU needs its replica counts changed
            rewrite = self._best_rewrite(g, gl, target, top, per_slot)
            if rewrite:
                step = rewrite[1]
                x = int(self.p2l[step.a])
                used |= (self.hold[:, x] > 0) | (self.hold[:, step.b] > 0)
                used_e[[x, step.b]] = True
                steps.append(step)
        # swaps on disjoint GPUs (and experts): each keeps its exact score when applied together
        k = min(_PARTNER_TRIES, score.shape[1])
        top_k = np.argpartition(-score, k - 1, axis=1)[:, :k]
        top_k = np.take_along_axis(top_k, np.argsort(-np.take_along_axis(score, top_k, axis=1), axis=1), axis=1)
        for i in np.argsort(-score.max(axis=1), kind="stable"):
            for j in top_k[i]:
                if not np.isfinite(score[i, j]):
                    break
                s, t = int(s_idx[i, j]), int(t_idx[i, j])
                gpus = [int(self.gos[s]), int(self.gos[t])]
                experts = [int(self.p2l[s]), int(self.p2l[t])]
                if used[gpus].any() or used_e[experts].any():
                    continue
                used[gpus] = True
                if lay.spread:
                    used_e[experts] = True
                steps.append(Step(True, s, t, int(scores[3][i, j])))
                break
        return steps

    def _best_rewrite(
        self, g: int, gl: FloatArray, target: float, top: float, per_slot: bool
    ) -> tuple[float, Step] | None:
        """Best rewrite for GPU ``g``: one more replica of an expert on ``g`` in a slot elsewhere (donor:
        light GPU, cheap expert), or a slot of ``g`` given to an expert that is light or whose GPUs are busy.
        """
        lay = self.layout
        w = self.load / self.cnt
        per = lay.per_gpu
        sg = g * per + np.arange(per)
        eg = np.unique(self.p2l[sg])
        x = self.p2l
        proxy = gl[self.gos] - w[x] + self.load[x] / np.maximum(self.cnt[x] - 1, 1) - w[x]
        proxy = np.where((self.cnt[x] > self.floor) & (self.gos != g), proxy, np.inf)
        k = min(CANDIDATES, lay.slots)
        donors = np.argpartition(proxy, k - 1)[:k]
        free = (self.hold[g] == 0) & (self.cnt < self.cap)
        k_e = min(CANDIDATES, lay.experts)
        light = np.argpartition(np.where(free, self.load / (self.cnt + 1), np.inf), k_e - 1)[:k_e]
        relief = np.where(free, w - self.load / (self.cnt + 1), -np.inf)
        busy = np.argpartition(-relief, k_e // 2)[: k_e // 2 + 1]
        ys = np.unique(np.concatenate([light, busy]))
        s = np.concatenate([np.repeat(donors, len(eg)), np.repeat(sg, len(ys))])
        y = np.concatenate([np.tile(eg, len(donors)), np.tile(ys, per)])
        scores = self.rewrites(s, y, gl, target)
        score = self._score(scores, top, per_slot)
        i = int(np.argmax(score))
        if not np.isfinite(score[i]):
            return None
        return float(score[i]), Step(False, int(s[i]), int(y[i]), int(scores[3][i]))

    def violation(self) -> tuple[str, int]:
        """The first broken constraint: ('dup', slot), ('floor', expert), ('spread', expert) or ('', -1)."""
        lay = self.layout
        if not lay.allow_dup:
            dup = np.flatnonzero(self.hold[self.gos, self.p2l] > 1)
            if len(dup):
                return "dup", int(dup[0])
        low = np.flatnonzero((self.cnt < self.floor) & ~self.waived)
        if len(low):
            return "floor", int(low[0])
        short = np.flatnonzero((self.distinct < lay.need(self.cnt)) & ~self.waived)
        if len(short):
            return "spread", int(short[0])
        return "", -1

    def waive(self, kind: str, which: int) -> bool:
        """Give up on a violation that no step repairs; False if it was given up on before (nothing is left)."""
        expert = int(self.p2l[which]) if kind == "dup" else which
        if self.waived[expert]:
            return False
        self.waived[expert] = True
        return True

    def repair(self, kind: str, which: int, rewrite: bool = True) -> Step | None:
        """The cheapest step that repairs a violation; among those, the lowest busiest GPU.

        A rewrite (one slot, counts change) if ``rewrite`` and one exists, else a swap.
        """
        lay = self.layout
        gl = self.loads()
        if rewrite:
            if kind == "dup":
                s = np.full(lay.experts, which)
                y = np.arange(lay.experts)
            else:
                s = np.arange(lay.slots)
                if kind == "spread":
                    s = s[self.nodecnt[which, self.nos] == 0]
                y = np.full(len(s), which)
            ok, newmax, _, cost = self.rewrites(s, y, gl, np.inf)
            if not ok.any() and kind == "floor":
                ok, newmax, _, cost = self.rewrites(s, y, gl, np.inf, spread_y=False)
            if ok.any():
                best = int(np.lexsort((newmax, np.where(ok, cost, 1 << 30)))[0])
                return Step(False, int(s[best]), int(y[best]), int(cost[best]), forced=True)
        if kind == "floor":
            return None
        if kind == "dup":
            slot = which
        else:  # move the copy on the most crowded node, busiest GPU first
            copies = np.flatnonzero(self.p2l == which)
            crowd = self.nodecnt[which, self.nos[copies]]
            slot = int(copies[np.lexsort((-gl[self.gos[copies]], -crowd))[0]])
        t = np.arange(lay.slots)
        ok_s = self._swap_valid(np.full(lay.slots, slot), t)
        if kind == "dup" and not ok_s.any():  # a duplicate is worse than a crowded node: spread it later
            ok_s = self._swap_valid(np.full(lay.slots, slot), t, spread=False)
        if kind == "spread":
            ok_s &= self.nodecnt[which, self.nos] == 0
        if not ok_s.any():
            return None
        w = self.load / self.cnt
        d = w[self.p2l[slot]] - w[self.p2l]
        worse = np.maximum(gl[self.gos[slot]] - d, gl[self.gos] + d)
        cost = (
            self._changed(np.full(lay.slots, slot), self.p2l)
            - self._changed(np.array([slot]), self.p2l[[slot]])
            + self._changed(t, np.full(lay.slots, self.p2l[slot]))
            - self._changed(t, self.p2l)
        )
        best = int(np.lexsort((worse, np.where(ok_s, cost, 1 << 30)))[0])
        return Step(True, slot, best, int(cost[best]), forced=True)

    def _swap_valid(self, s: IntArray, t: IntArray, spread: bool = True) -> BoolArray:
        """Constraint-only validity of swapping slots ``s[C]`` and ``t[C]`` (``spread``: keep node spread)."""
        lay = self.layout
        es, et = self.p2l[s], self.p2l[t]
        gs, gt = self.gos[s], self.gos[t]
        ok = (gs != gt) & (es != et)
        if not lay.allow_dup:
            ok &= (self.hold[gt, es] == 0) & (self.hold[gs, et] == 0)
        if lay.spread and spread:
            ns, nt = self.nog[gs], self.nog[gt]
            need = lay.need(self.cnt)
            after_s = self.distinct[es] - (self.nodecnt[es, ns] == 1) + (self.nodecnt[es, nt] == 0)
            after_t = self.distinct[et] - (self.nodecnt[et, nt] == 1) + (self.nodecnt[et, ns] == 0)
            ok &= (ns == nt) | (after_t >= np.minimum(need[et], self.distinct[et]))
            ok &= (ns == nt) | (after_s >= np.minimum(need[es], self.distinct[es])) | (self.distinct[es] < need[es])
        result: BoolArray = ok
        return result
