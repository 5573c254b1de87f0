"""Which flag at equal GPU memory: admission and eviction policies of the expert pool's
bank, compared on synthetic route traces in a CPU simulator.

``python -m harness bank-sim`` answers the issue's "measure first": before a policy is
built into the GPU planner, does any admission or eviction rule give fewer misses (so
fewer host-to-GPU row copies) than today's promote-on-miss, on skewed routing, without
losing on uniform or drifting routing?

**The traces are synthetic.** They are drawn from the router's distribution of the
synthetic checkpoint (:mod:`harness.checkpoint_routed`), not recorded from a served run
(no route trace of a served run is recorded yet). Per decode step, each layer routes
``tokens`` tokens, each to ``top_k`` distinct experts:

* ``skewed``: each layer's top-k is sampled without replacement (Plackett-Luce, drawn
  as the top-k of log-weights plus Gumbel noise) from Zipf weights ``1 / (k + 1)^s``,
  ``s = 1``, over a per-layer random permutation of the experts, fixed for the trace;
* ``uniform``: top-k uniformly without replacement (a cache's worst case);
* ``drifting``: ``skewed``, but every layer's permutation is redrawn every
  ``drift_every`` steps (default 300), so yesterday's hot experts turn cold at once.

**The bank** (:class:`Bank`) follows the planner of the series (0002's
``reference_decode_step``), one layer step at a time: ``layers`` pooled layers of
``rows`` placement rows each, all in one global LRU order; layer ``l`` starts with its
experts ``0 .. min(rows, experts - 1) - 1``. A layer step ticks a clock, counts the
distinct routed experts, and stamps the rows of the resident ones (hits) with the clock.
Its misses, most-routed first (ties: lower expert id), may each be promoted, at most
``top_k`` per layer step: a promoted miss takes a row of any layer not used in this layer
step, evicting what the row held. A miss not promoted uses a staging row for this step
only. Every miss, promoted or staged, copies one row from host memory, so misses count
the bytes moved. The policies (:data:`POLICIES`) decide which misses are promoted and
which row they take:

* ``promote-on-miss`` (today's planner): every miss is promoted into the least recently
  used row, until ``top_k`` are;
* ``second-miss``: a miss is promoted only if the same layer's expert also missed within
  the last ``window`` steps (default 200); otherwise it is staged;
* ``frequency``: TinyLFU-style admission. Each layer keeps an exponentially decayed
  count of the routes (token lanes) to each of its experts (half-life
  ``half_life`` steps, default 100; exact counts, no sketch: a layer has few experts).
  A miss is promoted only if its count, this step's routes included, exceeds the
  count of the expert in the victim row; the victim stays the global LRU row;
* ``planner-frequency``: ``frequency`` as the series' planner builds it (half-life 25
  steps; integer counts with 8 fractional bits, each layer's decayed at its own step);
* ``lfru``: a frequency-aware LRU in the spirit of LFRU, comparable to the one proposed
  upstream for ``--moe-expert-cache-size`` (this is our own formulation, not a port of
  that code): every miss is promoted, as today, but the victim is the row with the
  lowest decayed count among the ``candidates`` (default 32) least recently used rows
  not used in this layer step (ties, and empty rows first: the less recently used).
  Recency keeps the scan short and steers eviction away from freshly used rows;
  frequency keeps a popular row that merely went unused for a while.

Metrics per trace, policy, rows per layer and tokens per step are taken after a warm-up
of the first 20% of the steps: the hit rate (distinct routed experts found in the bank
over distinct routed experts, the unit of the pool's ``vllm:moe_expert_pool_hits``
counter; with one token a route and a distinct expert are the same), misses and
promotions per step (all layers), and misses relative to promote-on-miss on the same
trace. Beside them: the share of the distinct routes taken by the ``rows`` experts of
each layer that take the most routes over the measured steps (a static placement chosen
in hindsight; for a stationary trace such as ``skewed`` it is about the best hit rate any
online policy can reach; on ``uniform`` hindsight lifts it above ``rows / experts``).

Nothing here measures GPU time or decode speed: a policy's cost in the planner, and what
fewer copies buy end to end, need the policy built into the planner and a GPU run.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import results
from harness.project import REPO, git, progress

if TYPE_CHECKING:  # numpy is imported where it is used: the harness itself needs none
    import numpy as np

SYNTHETIC = (
    "synthetic route traces drawn from the router's distribution (Zipf s = 1 popularity over "
    "a per-layer permutation, top-k without replacement), not routes recorded from a served "
    "run (none are recorded yet)"
)
TRACES = ("skewed", "uniform", "drifting")
ZIPF_S = 1.0
DRIFT_EVERY = 300
WARMUP = 0.2
#: One expert's bytes (all six pooled tensors) in the synthetic NVFP4 model: 6.75 MiB.
ROW_MIB = 6.75
BASELINE = "promote-on-miss"
#: A policy "loses" on a trace where its misses exceed promote-on-miss's by more than this.
TOLERANCE = 0.01


# --- traces ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Trace:
    """One synthetic route trace.

    ``routes[step][layer][token]`` holds the ``top_k`` distinct experts that token is
    routed to: a numpy array of shape ``(steps, layers, tokens, top_k)`` from
    :func:`make_trace`, or nested lists (hand-made traces in tests).
    """

    kind: str
    routes: Any
    layers: int
    experts: int
    top_k: int
    tokens: int
    steps: int

    @property
    def description(self) -> str:
        return f"{self.kind}: {SYNTHETIC}"


def zipf_weights(experts: int, s: float = ZIPF_S) -> np.ndarray:
    """Popularity by rank, ``1 / (rank + 1)^s``, normalized."""
    import numpy as np

    weights = 1.0 / np.arange(1, experts + 1, dtype=np.float64) ** s
    return np.asarray(weights / weights.sum())


def make_trace(
    kind: str,
    *,
    layers: int = 42,
    experts: int = 128,
    top_k: int = 8,
    tokens: int = 1,
    steps: int = 2000,
    seed: int = 0,
    drift_every: int = DRIFT_EVERY,
) -> Trace:
    """A seeded synthetic trace (``kind`` one of :data:`TRACES`), drawn, not recorded.

    Each token's experts are the ``top_k`` largest of ``log p + Gumbel noise`` (drawn as
    the ``top_k`` smallest of ``Exp(1) / p``, the same order), which samples ``top_k``
    experts without replacement with probabilities ``p`` (Plackett-Luce); ``p`` is
    uniform, or Zipf over a per-layer random permutation (redrawn every ``drift_every``
    steps for ``drifting``). The same arguments give the same trace.
    """
    import numpy as np

    if kind not in TRACES:
        raise ValueError(f"unknown trace {kind!r}; expected one of {', '.join(TRACES)}")
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..experts ({experts}), not {top_k}")
    if min(layers, tokens, steps, drift_every) < 1:
        raise ValueError("layers, tokens, steps and drift_every must be positive")
    rng = np.random.default_rng([seed, TRACES.index(kind), tokens, layers, experts, top_k])
    rank = zipf_weights(experts).astype(np.float32)
    routes = np.empty((steps, layers, tokens, top_k), dtype=np.int16)
    period = steps if kind == "skewed" else drift_every
    for layer in range(layers):
        for start in range(0, steps, period):
            stop = min(start + period, steps)
            weights = np.ones(experts, dtype=np.float32)
            if kind != "uniform":
                weights[rng.permutation(experts)] = rank
            # The k smallest of Exp(1) / p are the k largest of log p + Gumbel noise.
            keys = rng.standard_exponential((stop - start, tokens, experts), np.float32) / weights
            routes[start:stop, layer] = np.argpartition(keys, top_k - 1, axis=-1)[..., :top_k]
    return Trace(kind, routes, layers, experts, top_k, tokens, steps)


def _step_lists(routes: Any, step: int) -> Sequence[Sequence[Sequence[int]]]:
    """``routes[step]`` as plain lists (numpy's ``tolist`` once per step is cheap)."""
    rows = routes[step]
    return rows.tolist() if hasattr(rows, "tolist") else rows  # type: ignore[no-any-return]


def lanes_per_expert(tokens: Sequence[Sequence[int]]) -> dict[int, int]:
    """How many tokens of one layer step route to each distinct expert."""
    lanes: dict[int, int] = {}
    for experts in tokens:
        for expert in experts:
            lanes[expert] = lanes.get(expert, 0) + 1
    return lanes


def static_top_share(trace: Trace, rows: int, warmup: float = WARMUP) -> float:
    """Share of the measured distinct routes that the ``rows`` experts of each layer with
    the most distinct routes over the measured steps take (the best static placement)."""
    start = warmup_steps(trace.steps, warmup)
    per_layer = [[0] * trace.experts for _ in range(trace.layers)]
    for step in range(start, trace.steps):
        for layer, tokens in enumerate(_step_lists(trace.routes, step)):
            counts = per_layer[layer]
            for expert in lanes_per_expert(tokens):
                counts[expert] += 1
    total = sum(sum(counts) for counts in per_layer)
    top = sum(sum(sorted(counts, reverse=True)[:rows]) for counts in per_layer)
    return top / total if total else 0.0


def warmup_steps(steps: int, warmup: float = WARMUP) -> int:
    """The steps left out of the metrics: the first ``warmup`` share."""
    return int(steps * warmup)


# --- the bank -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Counters:
    """Distinct routed experts, hits, misses and promotions over the counted layer steps."""

    routes: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0


class Bank:
    """The pool's bank: ``layers * rows`` placement rows in one global LRU order.

    ``hot[layer * experts + expert]`` is the expert's row (-1: not resident),
    ``owner[row]`` the flat ``layer * experts + expert`` the row holds (-1: empty),
    ``stamp[row]`` the clock of the layer step that last used it. ``lru`` orders the
    rows by ``(stamp, row)``, least recently used first, as the planner's sort does.
    """

    def __init__(self, layers: int, experts: int, rows: int, top_k: int) -> None:
        if min(layers, experts, rows, top_k) < 1:
            raise ValueError("layers, experts, rows and top_k must be positive")
        self.layers, self.experts, self.rows, self.top_k = layers, experts, rows, top_k
        self.pool_rows = layers * rows
        self.hot = [-1] * (layers * experts)
        self.owner = [-1] * self.pool_rows
        self.stamp = [0] * self.pool_rows
        self.clock = 0
        self.lru: OrderedDict[int, None] = OrderedDict((row, None) for row in range(self.pool_rows))
        for layer in range(layers):
            for expert in range(min(rows, experts - 1)):
                self.place(layer * experts + expert, layer * rows + expert)
        self.counters = Counters()

    def place(self, flat: int, row: int) -> None:
        """Put ``flat`` (``layer * experts + expert``) in ``row``, evicting its holder."""
        old = self.owner[row]
        if old >= 0:
            self.hot[old] = -1
        self.hot[flat] = row
        self.owner[row] = flat

    def lru_victim(self) -> int | None:
        """The least recently used row not used in this layer step (None: every row was)."""
        row = next(iter(self.lru))
        return row if self.stamp[row] < self.clock else None

    def layer_step(
        self, policy: Policy, layer: int, lanes: Mapping[int, int], step: int, count: bool = True
    ) -> tuple[list[int], list[int]]:
        """Plan one layer step of decode step ``step``; returns (promoted, staged) experts.

        ``lanes`` maps each distinct routed expert to its number of tokens. ``count``
        adds the step to :attr:`counters` (off during the warm-up).
        """
        self.clock += 1
        clock, hot, stamp, lru = self.clock, self.hot, self.stamp, self.lru
        base = layer * self.experts
        used: list[int] = []
        misses: list[int] = []
        for expert in lanes:
            row = hot[base + expert]
            if row >= 0:
                used.append(row)
            else:
                misses.append(expert)
        policy.observe(self, layer, lanes, step)
        for row in used:
            stamp[row] = clock
        used.sort()
        for row in used:
            lru.move_to_end(row)
        promoted: list[int] = []
        staged: list[int] = []
        if misses:
            misses.sort(key=lambda e: (-lanes[e], e))
            for expert in misses:
                victim = None
                if len(promoted) < self.top_k:
                    victim = policy.victim(self, layer, expert, step)
                if victim is None:
                    staged.append(expert)
                    continue
                self.place(base + expert, victim)
                stamp[victim] = clock
                lru.move_to_end(victim)
                used.append(victim)
                promoted.append(expert)
            if promoted:  # this step's rows at the end, by row, as (stamp, row) orders them
                used.sort()
                for row in used:
                    lru.move_to_end(row)
            policy.missed(self, layer, misses, step)
        if count:
            c = self.counters
            c.routes += len(lanes)
            c.hits += len(lanes) - len(misses)
            c.misses += len(misses)
            c.promotions += len(promoted)
        return promoted, staged


# --- policies -------------------------------------------------------------------------------------


class Policy:
    """Today's planner, ``promote-on-miss``: every miss takes the global LRU row.

    Subclasses change :meth:`victim` (which row a miss takes, or None to stage it) and
    may watch routes (:meth:`observe`, before placement) and misses (:meth:`missed`,
    after it).
    """

    name = "promote-on-miss"
    _label: str | None = None  # set by make_policy: the spec, parameters included

    @property
    def label(self) -> str:
        """The name, with the parameters given to :func:`make_policy`."""
        return self._label or self.name

    def reset(self, bank: Bank) -> None:
        """Start over for a new bank."""

    def params(self) -> dict[str, float]:
        return {}

    def observe(self, bank: Bank, layer: int, lanes: Mapping[int, int], step: int) -> None:
        """See every layer step's routes (expert -> tokens) before placement."""

    def victim(self, bank: Bank, layer: int, expert: int, step: int) -> int | None:
        """The row a missed ``expert`` of ``layer`` takes, or None to stage it."""
        return bank.lru_victim()

    def missed(self, bank: Bank, layer: int, misses: Sequence[int], step: int) -> None:
        """See the layer step's misses after placement."""


class SecondMiss(Policy):
    """Promote a miss only if the same expert also missed within the last ``window`` steps."""

    name = "second-miss"

    def __init__(self, window: int = 200) -> None:
        self.window = window
        self.last_miss: list[int] = []

    def params(self) -> dict[str, float]:
        return {"window_steps": self.window}

    def reset(self, bank: Bank) -> None:
        self.last_miss = [-(10**9)] * (bank.layers * bank.experts)

    def victim(self, bank: Bank, layer: int, expert: int, step: int) -> int | None:
        if step - self.last_miss[layer * bank.experts + expert] > self.window:
            return None
        return bank.lru_victim()

    def missed(self, bank: Bank, layer: int, misses: Sequence[int], step: int) -> None:
        base = layer * bank.experts
        for expert in misses:
            self.last_miss[base + expert] = step


class _Decayed(Policy):
    """Per-layer route counts per expert, decayed with a half-life of ``half_life`` steps.

    Decay is applied by weighting each step's routes by ``2 ** (step / half_life)``
    instead of shrinking every count: comparisons at one step are the same.
    """

    def __init__(self, half_life: float = 100.0) -> None:
        self.half_life = half_life
        self.counts: list[float] = []
        self._origin = 0
        self._step = -1
        self._weight = 1.0

    def reset(self, bank: Bank) -> None:
        self.counts = [0.0] * (bank.layers * bank.experts)
        self._origin, self._step, self._weight = 0, -1, 1.0

    def observe(self, bank: Bank, layer: int, lanes: Mapping[int, int], step: int) -> None:
        if step != self._step:
            self._step = step
            self._weight = 2.0 ** ((step - self._origin) / self.half_life)
            if self._weight > 2.0**200:  # rescale before floats overflow
                self.counts = [c / self._weight for c in self.counts]
                self._origin, self._weight = step, 1.0
        base, counts, weight = layer * bank.experts, self.counts, self._weight
        for expert, n in lanes.items():
            counts[base + expert] += n * weight

    def count(self, bank: Bank, row: int) -> float:
        """The decayed count of the expert in ``row`` (-1 for an empty row)."""
        flat = bank.owner[row]
        return self.counts[flat] if flat >= 0 else -1.0


class Frequency(_Decayed):
    """TinyLFU-style admission: promote a miss only if its decayed count exceeds that of
    the expert in the global LRU row (the victim), else stage it."""

    name = "frequency"

    def params(self) -> dict[str, float]:
        return {"half_life_steps": self.half_life}

    def victim(self, bank: Bank, layer: int, expert: int, step: int) -> int | None:
        row = bank.lru_victim()
        if row is None or self.counts[layer * bank.experts + expert] <= self.count(bank, row):
            return None
        return row


class Lfru(_Decayed):
    """Frequency-aware LRU (LFRU-style): every miss is promoted, into the row with the
    lowest decayed count among the ``candidates`` least recently used rows."""

    name = "lfru"

    def __init__(self, half_life: float = 100.0, candidates: int = 32) -> None:
        super().__init__(half_life)
        self.candidates = candidates

    def params(self) -> dict[str, float]:
        return {"half_life_steps": self.half_life, "candidates": self.candidates}

    def victim(self, bank: Bank, layer: int, expert: int, step: int) -> int | None:
        clock, stamp, owner, counts = bank.clock, bank.stamp, bank.owner, self.counts
        best, lowest = None, math.inf
        for row in itertools.islice(bank.lru, self.candidates):
            if stamp[row] >= clock:  # this step's rows come last: none after it is free
                break
            flat = owner[row]
            value = counts[flat] if flat >= 0 else -1.0
            if value < lowest:  # strict: of equal counts, the less recently used
                best, lowest = row, value
        return best


class PlannerFrequency(Policy):
    """Frequency admission as the series' planner builds it (``--moe-expert-pool-admission
    frequency``): :class:`Frequency`'s rule on the planner's integer counts. Each layer
    step multiplies its layer's counts by ``round(2**16 * 2**(-1 / half_life)) / 2**16``
    (rounded down) and adds ``lanes << 8``; other layers' counts wait for their own step,
    so a victim of a later layer is compared one decay short."""

    name = "planner-frequency"
    FRACTION_BITS = 8

    def __init__(self, half_life: float = 25.0) -> None:
        self.half_life = half_life
        self.decay = round(2**16 * 2 ** (-1 / half_life))
        self.counts: Any = None

    def params(self) -> dict[str, float]:
        return {"half_life_steps": self.half_life, "decay_q16": self.decay}

    def reset(self, bank: Bank) -> None:
        import numpy as np

        self.counts = np.zeros(bank.layers * bank.experts, dtype=np.int64)

    def observe(self, bank: Bank, layer: int, lanes: Mapping[int, int], step: int) -> None:
        base = layer * bank.experts
        counts = self.counts[base : base + bank.experts]
        counts *= self.decay
        counts >>= 16
        for expert, n in lanes.items():
            counts[expert] += n << self.FRACTION_BITS

    def victim(self, bank: Bank, layer: int, expert: int, step: int) -> int | None:
        row = bank.lru_victim()
        if row is None:
            return None
        flat = bank.owner[row]
        theirs = int(self.counts[flat]) if flat >= 0 else -1
        return row if int(self.counts[layer * bank.experts + expert]) > theirs else None


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (Policy, SecondMiss, Frequency, Lfru, PlannerFrequency)
}


def make_policy(spec: str) -> Policy:
    """A policy from ``NAME`` (its default parameters) or ``NAME:KEY=VALUE[:KEY=VALUE]``,
    e.g. ``second-miss:window=20`` or ``lfru:candidates=128:half_life=200``.

    Its :attr:`Policy.label` is ``spec`` as given, so variants of one policy can run side
    by side.
    """
    name, *pairs = spec.split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    kwargs: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            kwargs[key] = int(value) if value.isdigit() else float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"policy {spec!r}: expected KEY=NUMBER, not {pair!r}")
    try:
        policy = POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"policy {spec!r}: {exc}") from None
    policy._label = spec
    return policy


# --- runs -----------------------------------------------------------------------------------------


def simulate(trace: Trace, policy: Policy, rows: int, warmup: float = WARMUP) -> Counters:
    """Run ``policy`` on a fresh bank of ``rows`` rows per layer over ``trace``; the
    counters of the steps after the warm-up."""
    bank = Bank(trace.layers, trace.experts, rows, trace.top_k)
    policy.reset(bank)
    start = warmup_steps(trace.steps, warmup)
    for step in range(trace.steps):
        count = step >= start
        for layer, tokens in enumerate(_step_lists(trace.routes, step)):
            bank.layer_step(policy, layer, lanes_per_expert(tokens), step, count)
    return bank.counters


def run(
    rows: Sequence[int] = (22, 32),
    tokens: Sequence[int] = (1, 8),
    *,
    steps: int = 5000,
    seed: int = 0,
    layers: int = 42,
    experts: int = 128,
    top_k: int = 8,
    drift_every: int = DRIFT_EVERY,
    traces: Sequence[str] = TRACES,
    policies: Sequence[str] = tuple(POLICIES),  # make_policy specs
    quiet: bool = False,
) -> dict[str, Any]:
    """Every (trace, tokens, rows, policy) cell; the result file's ``data``.

    ``policies`` are :func:`make_policy` specs; promote-on-miss, the reference of the
    ratios, runs first when they lack it.
    """
    if BASELINE not in policies:
        policies = [BASELINE, *policies]
    measured = steps - warmup_steps(steps)
    cells: list[dict[str, Any]] = []
    oracle: list[dict[str, Any]] = []
    for kind in traces:
        for n in tokens:
            trace = make_trace(
                kind, layers=layers, experts=experts, top_k=top_k, tokens=n, steps=steps,
                seed=seed, drift_every=drift_every,
            )  # fmt: skip
            for r in rows:
                share = static_top_share(trace, r)
                oracle.append({"trace": kind, "tokens": n, "rows": r, "static_top_share": share})
                group: list[dict[str, Any]] = []
                for spec in policies:
                    policy = make_policy(spec)
                    began = time.monotonic()
                    c = simulate(trace, policy, r)
                    seconds = time.monotonic() - began
                    group.append(
                        {
                            "trace": kind,
                            "tokens": n,
                            "rows": r,
                            "policy": policy.label,
                            "params": policy.params(),
                            "hit_rate": c.hits / c.routes if c.routes else 0.0,
                            "misses_per_step": c.misses / measured,
                            "promotions_per_step": c.promotions / measured,
                            "routes_per_step": c.routes / measured,
                            "copied_mib_per_step": c.misses * ROW_MIB / measured,
                            "misses_vs_promote_on_miss": None,
                            "counters": dataclasses.asdict(c),
                            "seconds": round(seconds, 2),
                        }
                    )
                    if not quiet:
                        progress(
                            f"{kind} tokens={n} rows={r} {policy.label}: hit rate "
                            f"{group[-1]['hit_rate']:.1%} ({seconds:.1f} s)"
                        )
                base = next((g for g in group if g["policy"] == BASELINE), None)
                for g in group:
                    if base and base["counters"]["misses"]:
                        ratio = g["counters"]["misses"] / base["counters"]["misses"]
                        g["misses_vs_promote_on_miss"] = ratio
                cells += group
    return {
        "synthetic": SYNTHETIC,
        "parameters": {
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "steps": steps,
            "warmup_steps": warmup_steps(steps),
            "seed": seed,
            "zipf_s": ZIPF_S,
            "drift_every": drift_every,
            "row_mib": ROW_MIB,
            "tolerance": TOLERANCE,
            "rows": list(rows),
            "tokens": list(tokens),
            "traces": list(traces),
        },
        "policies": {spec: make_policy(spec).params() for spec in policies},
        "static_top_share": oracle,
        "cells": cells,
        "verdict": verdict(cells),
    }


def verdict(cells: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy: its misses relative to promote-on-miss on each trace (worst and best
    cell), and whether it loses (more than :data:`TOLERANCE` more misses) on a trace
    other than ``skewed``."""
    out: dict[str, dict[str, Any]] = {}
    for cell in cells:
        ratio = cell["misses_vs_promote_on_miss"]
        if cell["policy"] == BASELINE or ratio is None:
            continue
        entry = out.setdefault(cell["policy"], {"loses_on": []})
        worst = entry.setdefault(f"{cell['trace']}_worst", ratio)
        best = entry.setdefault(f"{cell['trace']}_best", ratio)
        entry[f"{cell['trace']}_worst"] = max(worst, ratio)
        entry[f"{cell['trace']}_best"] = min(best, ratio)
        if cell["trace"] != "skewed" and ratio > 1 + TOLERANCE:
            where = f"{cell['trace']} (tokens {cell['tokens']}, rows {cell['rows']})"
            entry["loses_on"].append(where)
    return out


def markdown(data: Mapping[str, Any]) -> str:
    """The hit-rate table and the misses table of a run's ``data``."""
    policies = list(data["policies"])
    share = {(o["trace"], o["tokens"], o["rows"]): o["static_top_share"]
             for o in data["static_top_share"]}  # fmt: skip
    by = {(c["trace"], c["tokens"], c["rows"], c["policy"]): c for c in data["cells"]}
    keys = sorted(share, key=lambda k: (TRACES.index(k[0]), k[1], k[2]))
    head = "| trace | tokens/step | rows/layer | static top-rows share | "
    lines = [
        "Hit rate (distinct routed experts found in the bank), after the warm-up:",
        "",
        head + " | ".join(policies) + " |",
        "| --- " * (4 + len(policies)) + "|",
    ]
    for k in keys:
        hits = " | ".join(f"{by[(*k, p)]['hit_rate']:.1%}" for p in policies)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {share[k]:.1%} | {hits} |")
    lines += [
        "",
        f"Misses per step (all {data['parameters']['layers']} layers; each copies one row of "
        f"{ROW_MIB} MiB), and relative to {BASELINE}; promotions per step in brackets:",
        "",
        "| trace | tokens/step | rows/layer | " + " | ".join(policies) + " |",
        "| --- " * (3 + len(policies)) + "|",
    ]
    for k in keys:
        cells = []
        for p in policies:
            c = by[(*k, p)]
            ratio = c["misses_vs_promote_on_miss"]
            rel = f" ({ratio:.3f}x)" if p != BASELINE and ratio is not None else ""
            cells.append(f"{c['misses_per_step']:.1f}{rel} [{c['promotions_per_step']:.1f}]")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
    lines += ["", f"Traces: {SYNTHETIC}.", ""]
    for name, v in data["verdict"].items():
        parts = [
            f"{t} {v[f'{t}_best']:.3f}-{v[f'{t}_worst']:.3f}x" for t in TRACES if f"{t}_best" in v
        ]
        loses = "loses on " + ", ".join(v["loses_on"]) if v["loses_on"] else "loses on none"
        lines.append(f"- {name}: misses vs {BASELINE}: {', '.join(parts)}; {loses}")
    return "\n".join(lines) + "\n"


def cpu() -> str:
    """The CPU model (``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def harness_commit(root: Path = REPO) -> tuple[str, str]:
    """The harness checkout's short HEAD, and whether harness/ differs from it."""
    head = git(root, "rev-parse", "--short", "HEAD", check=False).stdout.strip() or "unknown"
    dirty = git(root, "status", "--porcelain", "--", "harness", check=False).stdout.strip()
    return head, ("harness/ has uncommitted changes" if dirty else "clean")


def main(out: Path, argv: Sequence[str] | None = None, **kwargs: Any) -> int:
    """Run :func:`run`, write ``out/bank-sim.json`` and print the tables."""
    began = time.monotonic()
    data = run(**kwargs)
    data["seconds"] = round(time.monotonic() - began, 1)
    command = ["python", "-m", "harness", *(sys.argv[1:] if argv is None else argv)]
    head, tree = harness_commit()
    prov = results.provenance(
        command, cpu=cpu(), cpu_count=str(_cpu_count()), harness_commit=head, harness_tree=tree
    )
    path = results.write(out / "bank-sim.json", "bank-sim", data, prov)
    print(markdown(data), end="")
    print(f"\nwrote {path}")
    return 0


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
