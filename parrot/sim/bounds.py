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

Fig. 18 (multi-agent, 1x A100 LLaMA-13B): Parrot's engine-busy share of its end-to-end time. At ~1 the single
engine never waits for the manager: Parrot's time is its own work on the critical path (the decode iterations of
design, code and three review-and-revise rounds), so the ratio moves only with the baseline's time.

Last, the same ratios with every engine scheduling as vLLM did when the paper ran its baselines (no chunked
prefill: whole prompts first, running decodes wait; ``Scheduler(chunked_prefill=False)``), Parrot's engines too:
what the era's baseline engine alone would change.
"""

from __future__ import annotations

import asyncio
import statistics

from parrot.common.report import format_table
from parrot.sim import experiments as X
from parrot.sim.cluster import SimCluster
from parrot.sim.cost_model import load_model

PAPER_FIG19 = {("chat", "fifo-latency"): 5.5, ("chat", "fifo-throughput"): 1.23,
               ("map-reduce", "fifo-latency"): 3.7, ("map-reduce", "fifo-throughput"): 1.05}
PAPER_FIG18_VS_LATENCY = 11.7


def map_reduce_alone(policy: str, quick: bool = False, seed: int = 0) -> float:
    """Mean end-to-end seconds of Fig. 19's map-reduce apps alone on its cluster under ``policy`` (no chat)."""
    apps = X.mixed_apps(quick, seed)
    mode = "parrot" if policy == "parrot" else "baseline"

    async def body(c: SimCluster) -> float:
        times = await asyncio.gather(*(c.run_app(a, mode, criteria="throughput") for a in apps))
        return statistics.mean(times)

    return X._run(X.mixed_config(policy, seed), body)


def chats_alone(policy: str, n_chats: int, quick: bool = False, seed: int = 0) -> float:
    """Mean s/token of Fig. 19's first ``n_chats`` chats alone on its cluster under ``policy`` (no map-reduce)."""
    return X.mixed_results(quick, seed, policies=(policy,), with_apps=False, min_chats=n_chats)[policy][0]


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


def bounds(quick: bool = False, seed: int = 0) -> str:
    measured = X.mixed_results(quick, seed)
    fig19 = fig19_bounds(measured, quick, seed)
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
