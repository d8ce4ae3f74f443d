"""How far the Fig. 18 and Fig. 19 ratios can go on the simulator's cost models, whatever the Parrot policy does:
each bound divides a baseline's *measured* time by a best case for Parrot (a hard floor of the cost
model for the chats; for the map-reduce, the best time measured with the cluster to itself).

    python -m parrot.sim.experiments bounds [--quick]

Fig. 19 (chat at 1 req/s beside 8 map-reduce apps, 4x A6000 LLaMA-7B):

* **chat s/token.** No chat token comes faster than one decode iteration of that chat alone with no context,
  ``decode_s(1, 0)`` of the cost model (the weights streamed once: the floor of every policy). Bound = the
  baseline's chat s/token, measured with the map-reduce apps running, / that floor. The floor ignores the chats'
  own load (several chats decode at once at 1 req/s, each prompt stalls the others once), so beside it: the same
  chats (as many as Parrot served) alone on the same 4 engines under ``parrot`` and ``fifo-latency``, the better
  of the two -- a best measured case like the map-reduce one, not a floor.
* **map-reduce e2e.** The same apps alone on the same 4 engines (no chat) under ``parrot`` and
  ``fifo-throughput``: the map and reduce stages with the whole cluster to themselves, the best either policy
  reaches. Bound = the baseline's map-reduce mean measured beside the chats / the better of the two. Serving the
  chats as well can only add to Parrot's time, so the bound is generous.

Fig. 19 joint bound (:func:`fig19_joint`). The two bounds above hold each objective *separately*: the chats
with the 4 engines to themselves, the apps with the 4 engines to themselves. Both cannot be reached at once when
serving the chats well takes engine time the maps then lack. The joint table measures, with the same workload and
seed, what one family of schedules reaches for both together: k = 1, 2, 3 engines given to the chats exclusively
(the chats alone on k engines, the better of ``parrot`` / ``fifo-latency``) and the other 4 - k to the apps (the
apps alone on 4 - k, the better of ``parrot`` / ``fifo-throughput``); k = 0, "fully shared", is the better of
the measured ``parrot`` and ``fifo-throughput`` mixed runs *for each objective separately* (two different runs:
an optimistic corner, not one schedule). Per row: each objective's share of its separate bound and the ratios
against the baselines it would give; then the row nearest Parrot's measured point (log distance) and the share
of that row Parrot reaches (row / parrot per objective, as "of bound" above; above 100 %: Parrot beats the row).

Its limits. A dedicated split is one family of schedules, not the frontier of all: Parrot itself sits slightly
*above* its row k = 1 (in its run some chat decode rows run on the map engines, not on the chat engine). Sharing an
engine under a per-iteration token budget (the ``parrot`` policy's engines' step budget) lies between rows, and the linear cost model prices it exactly: every map
prompt token riding in a chat's iteration adds ``prefill_token_s`` = 0.145 ms to that iteration, whatever else
is in it (no free compute under the 24.9 ms base). A chat slowdown ``s`` therefore buys ``s * T / 0.145 ms``
map tokens per iteration of ``T`` (the chat iteration alone), i.e. a prefill rate of ``s / (1 + s) / 0.145 ms``
whatever ``T``: at a 10 % slowdown ~18-21 tokens per ~27-31 ms iteration, ~620 tokens/s, ``0.1 / 1.1`` = 9.1 %
of the engine's 6,890 tokens/s marginal peak, or ~9.7 % of a dedicated map engine (which prefills 4 x 1024
tokens per 637 ms iteration, 6,430 tokens/s). So a 10 % chat slowdown moves the maps from 3 engines to ~3.1, and
the maps' last ~10 % (90 % of their bound needs ~0.55 of a fourth engine) would cost the chats ~2x. The table
prints these estimates (map-reduce time interpolated linearly in engines between the 3- and 4-engine apps-alone
runs: an estimate, not a measurement). Time-sharing between rows (an engine moving from chats to maps over
time) reaches roughly the segments between the measured points. The table is measured on the simulator's
linear cost model; a real GPU with spare compute under its memory-bound decode (a roofline ``max`` instead of a
sum) would make riding map tokens cheaper and move the sharing estimates up.

Fig. 18 (multi-agent, 1x A100 LLaMA-13B): Parrot's engine-busy share of its end-to-end time. At ~1 the single
engine never waits for the manager: Parrot's time is its own work on the critical path (the decode iterations of
design, code and three review-and-revise rounds), so the ratio moves only with the baseline's time.

Last, the same ratios with every engine scheduling as vLLM did when the paper ran its baselines (no chunked
prefill: whole prompts first, running decodes wait; ``Scheduler(chunked_prefill=False)``), Parrot's engines too:
what the era's baseline engine alone would change.
"""

from __future__ import annotations

import asyncio
import functools
import math
import statistics

from parrot.common.report import format_table
from parrot.sim import experiments as X
from parrot.sim.cluster import SimCluster
from parrot.sim.cost_model import load_model

PAPER_FIG19 = {("chat", "fifo-latency"): 5.5, ("chat", "fifo-throughput"): 1.23,
               ("map-reduce", "fifo-latency"): 3.7, ("map-reduce", "fifo-throughput"): 1.05}
PAPER_FIG18_VS_LATENCY = 11.7


def map_reduce_alone(policy: str, quick: bool = False, seed: int = 0, engines: int = 4) -> float:
    """Mean end-to-end seconds of Fig. 19's map-reduce apps alone on its cluster (``engines`` of its engines)
    under ``policy`` (no chat)."""
    return _map_reduce_alone(policy, bool(quick), seed, engines)


def chats_alone(policy: str, n_chats: int, quick: bool = False, seed: int = 0, engines: int = 4) -> float:
    """Mean s/token of Fig. 19's first ``n_chats`` chats alone on its cluster (``engines`` of its engines) under
    ``policy`` (no map-reduce)."""
    return _chats_alone(policy, n_chats, bool(quick), seed, engines)


# deterministic runs (virtual time, seeded), cached on their normalized arguments: the joint table reuses the
# 4-engine runs of the bounds table
@functools.lru_cache(maxsize=None)
def _map_reduce_alone(policy: str, quick: bool, seed: int, engines: int) -> float:
    apps = X.mixed_apps(quick, seed)
    mode = "parrot" if policy == "parrot" else "baseline"

    async def body(c: SimCluster) -> float:
        times = await asyncio.gather(*(c.run_app(a, mode, criteria="throughput") for a in apps))
        return statistics.mean(times)

    return X._run(X.mixed_config(policy, seed, engines=engines), body)


@functools.lru_cache(maxsize=None)
def _chats_alone(policy: str, n_chats: int, quick: bool, seed: int, engines: int) -> float:
    return X.mixed_results(quick, seed, policies=(policy,), with_apps=False, min_chats=n_chats,
                           engines=engines)[policy][0]


def fig19_bounds(measured: dict[str, tuple[float, float, int]], quick: bool = False, seed: int = 0) -> str:
    """The Fig. 19 bounds table for ``measured`` (:func:`parrot.sim.experiments.mixed_results`): each ratio of
    Parrot against a baseline beside what any policy could reach (module docstring) and the share reached."""
    floor = load_model("llama7b-a6000").decode_s(1, 0)
    chat = {p: chats_alone(p, measured["parrot"][2], quick, seed) for p in ("parrot", "fifo-latency")}
    alone = {p: map_reduce_alone(p, quick, seed) for p in ("parrot", "fifo-throughput")}
    rows = []
    for metric, idx, best, how in (("chat", 0, floor, "floor"), ("chat", 0, min(chat.values()), "chats alone"),
                                   ("map-reduce", 1, min(alone.values()), "apps alone")):
        ours = measured["parrot"][idx]
        for base in ("fifo-latency", "fifo-throughput"):
            b = measured[base][idx]
            rows.append([f"{metric} vs {base} [{how}]", b, ours, best, f"{b / ours:.3f}", f"{b / best:.3f}",
                         f"{100 * best / ours:.0f} %", PAPER_FIG19[metric, base]])
    return format_table(
        ["ratio", "baseline (measured)", "parrot (measured)", "best any policy", "ours", "bound", "of bound",
         "paper"], rows,
        title="[bounds, Fig. 19] 4x A6000 LLaMA-7B (sim); chat in s/token (floor: one decode iteration alone, "
              f"{floor * 1000:.1f} ms; chats alone: parrot {chat['parrot'] * 1000:.1f} ms / fifo-latency "
              f"{chat['fifo-latency'] * 1000:.1f} ms), map-reduce mean e2e s (best: the apps alone on the cluster, "
              f"parrot {alone['parrot']:.2f} s / fifo-throughput {alone['fifo-throughput']:.2f} s)")


JOINT_CHAT_POLICIES = ("parrot", "fifo-latency")  # the chats alone: the better of the two
JOINT_APP_POLICIES = ("parrot", "fifo-throughput")  # the apps alone: the better of the two
SHARE_SLOWDOWN = 0.10  # the chat slowdown the token-budget estimate spends on map tokens


def fig19_joint_points(measured: dict[str, tuple[float, float, int]], quick: bool = False,
                       seed: int = 0) -> dict:
    """The measured points of the joint bound (module docstring): ``{"separate": (chat, map_reduce),
    "rows": [(k, chat s/token, map-reduce s), ...]}`` -- k = 1, 2, 3: the chats alone on k engines and the apps
    alone on the other 4 - k (each the better of two policies); k = 0: the better of the measured fifo-throughput
    and parrot mixed runs, each objective separately. ``separate``: the chats alone / the apps alone on all 4."""
    n = measured["parrot"][2]
    chat = {k: min(chats_alone(p, n, quick, seed, k) for p in JOINT_CHAT_POLICIES) for k in (1, 2, 3, 4)}
    apps = {m: min(map_reduce_alone(p, quick, seed, m) for p in JOINT_APP_POLICIES) for m in (1, 2, 3, 4)}
    shared = (min(measured[p][0] for p in ("fifo-throughput", "parrot")),
              min(measured[p][1] for p in ("fifo-throughput", "parrot")))
    return {"separate": (chat[4], apps[4]), "chat": chat, "apps": apps,
            "rows": [(0, *shared)] + [(k, chat[k], apps[4 - k]) for k in (1, 2, 3)]}


def fig19_joint(measured: dict[str, tuple[float, float, int]], quick: bool = False, seed: int = 0,
                points: dict | None = None) -> str:
    """The Fig. 19 joint bound table (module docstring): per split of the 4 engines, what the chats and the apps
    reach together, each objective's share of its separate bound, the ratios it gives against the baselines, and
    where Parrot's measured point sits. ``points``: :func:`fig19_joint_points` if already measured."""
    pts = points or fig19_joint_points(measured, quick, seed)
    chat4, map4 = pts["separate"]
    lat, thr, ours = measured["fifo-latency"], measured["fifo-throughput"], measured["parrot"]
    rows = []
    for k, c, m in pts["rows"]:
        label = "0 (shared: best of parrot / fifo-throughput runs)" if k == 0 else f"{k} (apps on {4 - k})"
        rows.append([label, c, f"{100 * chat4 / c:.0f} %", f"{lat[0] / c:.2f}x / {thr[0] / c:.2f}x", m,
                     f"{100 * map4 / m:.0f} %", f"{lat[1] / m:.2f}x / {thr[1] / m:.2f}x"])
    for p in ("parrot", "fifo-throughput"):  # the two measured points the k = 0 row combines
        c, m = measured[p][:2]
        rows.append([f"measured {p} (shared 4)", c, f"{100 * chat4 / c:.0f} %", f"{lat[0] / c:.2f}x / "
                     f"{thr[0] / c:.2f}x", m, f"{100 * map4 / m:.0f} %", f"{lat[1] / m:.2f}x / {thr[1] / m:.2f}x"])
    # Parrot's nearest row (log distance over both objectives) and the share of that row Parrot reaches
    k, c, m = min(pts["rows"], key=lambda r: math.hypot(math.log(ours[0] / r[1]), math.log(ours[1] / r[2])))
    near = (f"  parrot's point (chat {ours[0] * 1000:.1f} ms/token, map-reduce {ours[1]:.2f} s) is closest to row "
            f"k = {k}; it reaches {100 * c / ours[0]:.0f} % of that row's chat and {100 * m / ours[1]:.0f} % of its "
            "map-reduce (row / parrot; above 100 %: better than the row)")
    return format_table(
        ["chat engines k", "chat s/token", "of chat bound", "chat vs lat / thr", "map-reduce s", "of m-r bound",
         "m-r vs lat / thr"], rows,
        title="[joint bound, Fig. 19] both objectives at once: k engines to the chats alone (better of "
              f"{' / '.join(JOINT_CHAT_POLICIES)}), 4 - k to the apps alone (better of "
              f"{' / '.join(JOINT_APP_POLICIES)}); separate bounds: chats alone on 4 {chat4 * 1000:.1f} ms/token, "
              f"apps alone on 4 {map4:.2f} s") + "\n" + near + "\n" + _sharing_estimate(pts)


def _sharing_estimate(pts: dict) -> str:
    """Lines estimating, with the linear cost model, the k = 1 split whose chat engine also runs map prompt
    tokens under a per-iteration budget (module docstring), between row k = 1 and the apps alone on 4; and
    whether 90 % / 90 % is reachable."""
    cost = load_model("llama7b-a6000")
    chat4, map4 = pts["separate"]
    chat1, map3 = pts["chat"][1], pts["apps"][3]
    chunk, budget = X._mixed_size(False)[2], cost.max_batch_tokens
    per, n = min(chunk, budget), max(1, budget // chunk)
    dedicated = n * per * cost.prefill_token_s / cost.iteration_s(n * per, n * per * per / 2, 0, 0)

    def line(s: float, why: str) -> str:
        f = s / (1 + s) / dedicated  # of a dedicated map engine's prefill throughput
        c, m = chat1 * (1 + s), map3 + min(1.0, f) * (map4 - map3)  # map-reduce linear in engines from 3 to 4
        return (f"  estimate, k = 1 sharing its chat engine ({why}): map prompt tokens in the chat iterations at a "
                f"{100 * s:.0f} % chat slowdown (~{s * chat1 / cost.prefill_token_s:.0f} tokens/iteration) give the "
                f"maps {f:.3f} of a dedicated engine -> chat {c * 1000:.1f} ms/token ({100 * chat4 / c:.0f} %), "
                f"map-reduce ~{m:.2f} s ({100 * map4 / m:.0f} %)")

    lines = [line(SHARE_SLOWDOWN, f"{100 * SHARE_SLOWDOWN:.0f} % budget")]
    need = (map3 - map4 / 0.9) / (map3 - map4) if map3 > map4 / 0.9 else 0.0  # engine share for 90 % map-reduce
    if 0 < need * dedicated < 1:
        x = need * dedicated
        lines.append(line(x / (1 - x), "for 90 % map-reduce"))
    both = [k for k, c, m in pts["rows"] if k and chat4 / c >= 0.9 and map4 / m >= 0.9]
    lines.append(f"  90 % / 90 %: {'reached by split k = ' + str(both[0]) if both else 'no dedicated split reaches it'}"
                 f"; the chats alone on 1 engine reach {100 * chat4 / chat1:.0f} % of the chat bound with no map "
                 f"token at all, on 2 {100 * chat4 / pts['chat'][2]:.0f} % (the maps then on 2: "
                 f"{100 * map4 / pts['apps'][2]:.0f} %)")
    return "\n".join(lines)


def bounds(quick: bool = False, seed: int = 0) -> str:
    measured = X.mixed_results(quick, seed)
    fig19 = fig19_bounds(measured, quick, seed) + "\n\n" + fig19_joint(measured, quick, seed)
    files = 8 if quick else 16
    t, _, busy = X._multi_agent_run("parrot", files, seed)
    base, _, _ = X._multi_agent_run("latency-centric", files, seed)
    fig18 = format_table(
        ["files", "parrot e2e s", "engine busy s", "busy share", "latency-centric s", "ratio", "paper"],
        [[files, t, busy, busy / t, base, base / t, PAPER_FIG18_VS_LATENCY]],
        title="[bounds, Fig. 18] 1x A100 LLaMA-13B (sim): Parrot's engine-busy share (1 = no idle time left to "
              "remove; the ratio then moves only with the baseline)")
    return fig19 + "\n\n" + fig18 + "\n\n" + without_chunked_prefill(
        quick, seed, measured, {"parrot": t, "latency-centric": base})


def without_chunked_prefill(quick: bool, seed: int, new: dict[str, tuple[float, float, int]],
                            t_new: dict[str, float]) -> str:
    """The same ratios with every engine scheduling as vLLM did in 2023, the paper's baselines: whole prompts
    first, running decodes waiting for them (no chunked prefill; Parrot's engines too). ``new`` / ``t_new``: the
    chunked-prefill runs' Fig. 19 results and Fig. 18 times (parrot, latency-centric), for the comparison."""
    old = X.mixed_results(quick, seed, chunked_prefill=False)
    rows = []
    for metric, idx in (("chat", 0), ("map-reduce", 1)):
        for base in ("fifo-latency", "fifo-throughput"):
            rows.append([f"Fig. 19 {metric} vs {base}", f"{new[base][idx] / new['parrot'][idx]:.3f}",
                         f"{old[base][idx] / old['parrot'][idx]:.3f}", old[base][idx], old["parrot"][idx],
                         PAPER_FIG19[metric, base]])
    files = 8 if quick else 16
    t_old = {v: X._multi_agent_run(v, files, seed, chunked_prefill=False)[0] for v in ("parrot", "latency-centric")}
    rows.append([f"Fig. 18 ({files} files) vs latency-centric", f"{t_new['latency-centric'] / t_new['parrot']:.3f}",
                 f"{t_old['latency-centric'] / t_old['parrot']:.3f}", t_old["latency-centric"], t_old["parrot"],
                 PAPER_FIG18_VS_LATENCY])
    return format_table(
        ["ratio", "chunked prefill", "2023 scheduler", "baseline (2023)", "parrot (2023)", "paper"], rows,
        title="[bounds, 2023 engines] every engine (Parrot's too) without chunked prefill: whole prompts first, "
              "running decodes wait for them (vLLM's scheduler when the paper ran its baselines)")
