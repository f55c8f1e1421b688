"""The whole-first planner experiment (``sharding._plan(..., whole_first=1.0)``, timed by ``cp_imbalance.py
--whole-first``): every position of the row exactly once, equal tokens per rank, the work counts right, and the
default plan unchanged by it."""

from __future__ import annotations

import random

from longtrain.blockdiag_cp import sharding
from longtrain.blockdiag_cp.sharding import causal_work_of, plan_cp_shards


def test_whole_first_plans_are_permutations_with_equal_tokens_and_true_work():
    rng = random.Random(0)
    for _ in range(400):
        lens = [rng.choice([0, 1, 2, rng.randint(1, 40), rng.randint(40, 900)]) for _ in range(rng.randint(0, 10))]
        w, chunk, pad = rng.randint(1, 8), rng.choice([1, 2, 16, 128]), rng.randint(0, 7)
        plan = sharding._plan(lens, w, "balanced", chunk, pad, whole_first=1.0)
        owned = sorted(i for r in range(w) for a, b in plan.pieces[r] for i in range(a, b))
        assert owned == list(range(plan.seq_len)), (lens, w)
        assert all(sum(b - a for a, b in plan.pieces[r]) == plan.local_len for r in range(w))
        assert plan.causal_work == tuple(causal_work_of(lens, plan.pieces[r]) for r in range(w))
        default = plan_cp_shards(lens, w, chunk=chunk, pad=pad)
        assert default.pieces == sharding._plan(lens, w, "balanced", chunk, pad).pieces


def test_whole_first_keeps_documents_that_fit_whole():
    # Four documents of 100 tokens over 2 ranks: two whole documents per rank, no cut, equal work.
    plan = sharding._plan([100] * 4, 2, "balanced", 16, 0, whole_first=1.0)
    assert plan.pieces == (((0, 100), (200, 300)), ((100, 200), (300, 400)))
    assert plan.causal_work[0] == plan.causal_work[1]
    # The default plan cuts each of them head-tail over both ranks (documents >= 2 W chunk = 64 tokens).
    default = plan_cp_shards([100] * 4, 2, chunk=16)
    for d in range(4):
        owners = {r for r in range(2) for a, b in default.pieces[r] if min(b, 100 * d + 100) > max(a, 100 * d)}
        assert owners == {0, 1}, d
