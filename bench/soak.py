"""Soak: many episodes on real environments through the real engine; resident memory and threads must stay flat
and no JVM may be left behind.

The real ``jaxopd.sampler.Engine`` with a random-weight model (``--model``, default the ``tiny`` Qwen3 preset, over
the tokenizer's vocabulary: random weights, so the actions are noise; the soak measures the machinery, not an
agent), the real Qwen3 tokenizer, and
ActFirst-OPD's rollout strategy in its fast-action form (next-action prediction only: the ``no-id`` ablation, one
action-only request of at most ``--fast-tokens`` tokens per turn; ``--full-tokens N`` adds the asynchronous full
responses of N tokens). Two ``jaxopd_envs.pool.EnvPool`` instances over real environments: ALFWorld games (the official
games under ``$ALFWORLD_DATA`` when set, else the games generated from the alfworld wheel's floor plans, cached under
~/.cache/jaxopd/alfworld_games: ALFWorld-format tasks, not the benchmark's splits; worker processes) and
ScienceWorld 1.2.3 (train split, simplification ``easy``; each slot's environment its own JVM, in threads; the JVM
heap is the JVM's default unless ``--jvm-max-heap`` caps it). ``--slots`` runner threads, split between the two by
``--alfworld-share``, play episode after episode (each a new task and sampling seed) in chunks of
``--sample-every`` episodes; after each chunk the runners are idle, the engine drained, garbage collected, and
the process is sampled: resident memory (VmRSS of this process and of its child processes: JVMs, ALFWorld
workers), threads (Python's and the OS's), live JVMs, free KV pages, compiled shapes, Python objects, CPU time,
load average, wall time. A failed episode is counted with its reason and never stops the soak. At the end the
runners, pools and engine are closed, and threads and JVMs are counted again.

Flat: the least-squares slope of this process's RSS against episodes over the samples after the first 20 % of the
episodes (warm-up, compiles and environment start-up excluded), in MiB per 100 episodes, must not exceed
``--max-growth`` (default 2 MiB / 100 episodes: a leak of 20 KiB per episode, about one episode's observations,
prompts and token ids kept alive, reaches it, while allocator noise of a few MiB over a long run stays below it);
it is judged over at least 100 steady-state episodes. The slope with the child processes (JVM heaps grow until
their collector settles) is reported, not judged. The thread counts at the start of the steady state and at the
end must be equal; no JVM may outlive the close; Python's thread count after the close must be back to its count
before the engine and pools were built. Exit code 0 when all hold, 1 otherwise, 2 for bad input.

    python -m bench.soak --episodes 1000 --max-turns 2 --slots 4 --fast-tokens 8 --out results/soak

Writes ``soak.json`` (every sample, the summary, the command, the machine), ``soak.csv``, ``soak.md`` and
``soak.png`` under ``--out``.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import gc
import json
import os
import queue
import random
import re
import resource
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from jaxopd import cli  # noqa: E402
from jaxopd.machine import machine_info  # noqa: E402

KINDS = ("alfworld", "scienceworld")
STEADY_FROM = 0.2                      # samples after this share of the episodes form the steady state
MIN_SLOPE_SPAN = 100                   # episodes of steady state below which a memory slope is not judged
DEFAULT_MAX_GROWTH = 2.0               # MiB per 100 episodes
JVM_WAIT_S = 30.0                      # how long the end waits for JVMs and threads to go


def build_parser():
    p = cli.Parser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=1000, help="episodes in all (default 1000)")
    p.add_argument("--alfworld-share", type=float, default=0.5,
                   help="share of the episodes (and runner slots) on ALFWorld; the rest on ScienceWorld")
    p.add_argument("--max-turns", type=int, default=2, help="interaction limit per episode (default 2)")
    p.add_argument("--slots", type=int, default=4, help="concurrent episodes (runner threads; default 4)")
    p.add_argument("--seed", type=int, default=0, help="task order and the requests' sampling seeds")
    p.add_argument("--sample-every", type=int, default=50, help="episodes per chunk between samples")
    p.add_argument("--model", default="tiny", help="architecture preset of the random model (default tiny)")
    p.add_argument("--fast-tokens", type=int, default=8, help="action-only request limit (default 8)")
    p.add_argument("--full-tokens", type=int, default=0,
                   help="asynchronous full responses of this many tokens per turn (default 0: none)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="prompt budget (default 1024; first prompts are 300-450 tokens)")
    p.add_argument("--jvm-max-heap", default=None, metavar="SIZE",
                   help="cap each ScienceWorld JVM's heap (-Xmx SIZE, e.g. 1g, through $JAVA_TOOL_OPTIONS); default: "
                        "the JVM's own default, a quarter of the machine's memory, as training runs it")
    p.add_argument("--max-growth", type=float, default=DEFAULT_MAX_GROWTH,
                   help="RSS growth allowed in the steady state, MiB per 100 episodes (default 2)")
    p.add_argument("--out", default="results/soak", help="output folder (default results/soak)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args) -> None:
    """Every check of the input, before any model or environment is built (``jaxopd.cli.UsageError``)."""
    for name in ("episodes", "max_turns", "slots", "sample_every", "fast_tokens", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise cli.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.full_tokens < 0 or 0 < args.full_tokens < 4:
        raise cli.UsageError(f"--full-tokens must be 0 (none) or at least 4, got {args.full_tokens}")
    if not 0.0 <= args.alfworld_share <= 1.0:
        raise cli.UsageError(f"--alfworld-share must be in [0, 1], got {args.alfworld_share}")
    if 0.0 < args.alfworld_share < 1.0 and args.slots < 2:
        raise cli.UsageError(f"--slots {args.slots}: both benchmarks need a slot each (--slots >= 2), or set "
                             "--alfworld-share to 0 or 1")
    if not args.max_growth > 0:
        raise cli.UsageError(f"--max-growth must be positive, got {args.max_growth}")
    if args.jvm_max_heap is not None and not re.fullmatch(r"[1-9][0-9]*[kKmMgG]?", args.jvm_max_heap):
        raise cli.UsageError(f"--jvm-max-heap {args.jvm_max_heap!r} is not a JVM memory size (e.g. 1g, 768m)")
    if args.alfworld_share > 0:
        cli.check_alfworld_data()
    cli.check_model_preset("--model", args.model)
    cli.check_out_dir("--out", args.out)


# ------------------------------------------------------------------------------------------ the schedule
def episode_kinds(episodes: int, share: float) -> list[str]:
    """The benchmark of each episode: ALFWorld whenever the running ALFWorld count ``floor(i * share)`` steps up,
    so both kinds are spread evenly through the run (and through every chunk)."""
    return [KINDS[0] if int((i + 1) * share + 1e-9) > int(i * share + 1e-9) else KINDS[1] for i in range(episodes)]


def slot_split(slots: int, share: float) -> dict[str, int]:
    """Runner slots per benchmark, in proportion to ``share``; each benchmark in use gets at least one."""
    if share <= 0:
        return {KINDS[0]: 0, KINDS[1]: slots}
    if share >= 1:
        return {KINDS[0]: slots, KINDS[1]: 0}
    alfworld = min(slots - 1, max(1, round(slots * share)))
    return {KINDS[0]: alfworld, KINDS[1]: slots - alfworld}


# ------------------------------------------------------------------------------------- process sampling
def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command name, CPU seconds of it and its reaped children) of every process in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        close = stat.rfind(")")
        fields = stat[close + 2:].split()
        cpu = sum(int(v) for v in fields[11:15]) / _CLOCK_TICKS       # utime, stime, cutime, cstime
        table[int(entry)] = (int(fields[1]), stat[stat.find("(") + 1:close], cpu)
    return table


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int | None = None) -> list[tuple[int, str, float]]:
    """(pid, command name, CPU seconds) of every process below ``root`` (default: this one)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[tuple[int, str, float]]] = collections.defaultdict(list)
    for pid, (ppid, name, cpu) in _proc_table().items():
        children[ppid].append((pid, name, cpu))
    out, stack = [], [root]
    while stack:
        for pid, name, cpu in children.get(stack.pop(), ()):
            out.append((pid, name, cpu))
            stack.append(pid)
    return out


def cpu_seconds(kids: Sequence[tuple[int, str, float]]) -> tuple[float, float]:
    """CPU seconds (user + system) of this process alone, and with its reaped children and live descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = own.ru_utime + own.ru_stime
    return mine, mine + reaped.ru_utime + reaped.ru_stime + sum(cpu for _, _, cpu in kids)


def rss_kib(pid: int | str = "self") -> int:
    """VmRSS of a process in KiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def is_java(name: str) -> bool:
    return name == "java" or name.startswith("java")


def process_sample() -> dict[str, Any]:
    """Resident memory (MiB), threads and child processes of this process, now."""
    kids = descendants()
    rss = {pid: rss_kib(pid) for pid, _, _ in kids}
    java = [pid for pid, name, _ in kids if is_java(name)]
    cpu_self, cpu_all = cpu_seconds(kids)
    return {"cpu_s": cpu_all, "cpu_self_s": cpu_self, "load_average": os.getloadavg()[0],
            "rss_mib": rss_kib() / 1024, "children_rss_mib": sum(rss.values()) / 1024,
            "java_rss_mib": sum(rss[pid] for pid in java) / 1024, "java_processes": len(java),
            "child_processes": len(kids), "threads_python": threading.active_count(), "threads_os": os_threads()}


# ---------------------------------------------------------------------------------------------- the runners
@dataclasses.dataclass
class _Outcome:
    index: int
    kind: str
    end_reason: str | None = None
    turns: int = 0
    won: bool = False
    error: str | None = None
    seconds: float = 0.0


class Runners:
    """``slots[kind]`` host threads per benchmark that play the episodes put on their kind's queue with that
    kind's strategy, one at a time each, and put every outcome on ``results`` (a failed episode is an outcome
    with its error, never the end of a runner)."""

    def __init__(self, strategies: dict[str, Any], slots: dict[str, int], play):
        self.queues: dict[str, queue.Queue] = {kind: queue.Queue() for kind in strategies}
        self.results: queue.Queue[_Outcome] = queue.Queue()
        self._play = play
        self._threads = [threading.Thread(target=self._loop, args=(kind, strategies[kind], slot), daemon=True,
                                          name=f"soak-{kind}-{slot}")
                         for kind in strategies for slot in range(slots[kind])]
        for thread in self._threads:
            thread.start()

    def submit(self, index: int, kind: str) -> None:
        self.queues[kind].put(index)

    def close(self) -> None:
        for kind, q in self.queues.items():
            for _ in range(sum(t.name.startswith(f"soak-{kind}-") for t in self._threads)):
                q.put(None)
        for thread in self._threads:
            thread.join(timeout=600)

    def _loop(self, kind: str, strategy: Any, slot: int) -> None:
        while True:
            index = self.queues[kind].get()
            if index is None:
                return
            outcome = _Outcome(index, kind)
            start = time.perf_counter()
            try:
                trajectory = self._play(strategy, slot, kind, index)
                outcome.end_reason, outcome.turns, outcome.won = (trajectory.end_reason, trajectory.num_turns,
                                                                  bool(trajectory.won))
            except Exception as error:  # noqa: BLE001 - one failed episode never stops the soak
                outcome.error = f"{type(error).__name__}: {error}"[:300]
            outcome.seconds = time.perf_counter() - start
            self.results.put(outcome)


# ----------------------------------------------------------------------------------------------- the summary
def slope_per_100(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y against x, times 100 (None with fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return 100.0 * sxy / sxx


def summarize(samples: list[dict[str, Any]], final: dict[str, Any], baseline: dict[str, Any], episodes: int,
              max_growth: float, anomalies: Sequence[str] = ()) -> dict[str, Any]:
    """Start/end values, steady-state slopes and the verdicts (see the module docstring)."""
    steady = [s for s in samples if s["episodes"] >= STEADY_FROM * episodes] or samples[-1:]
    first, last, steady_first = samples[0], samples[-1], steady[0]
    out: dict[str, Any] = {"episodes": last["episodes"], "failed": last["failed"], "wall_s": last["wall_s"],
                           "seconds_per_episode": (last["wall_s"] - first["wall_s"]) / max(last["episodes"], 1),
                           "steady_state_from_episode": steady_first["episodes"], "steady_samples": len(steady),
                           "max_growth_mib_per_100": max_growth}
    span = last["episodes"] - steady_first["episodes"]
    if span > 0:      # the cost of an episode in the steady state: wall time here, CPU time anywhere
        out["steady_wall_s_per_episode"] = (last["wall_s"] - steady_first["wall_s"]) / span
        out["steady_cpu_s_per_episode"] = (last["cpu_s"] - steady_first["cpu_s"]) / span
        out["steady_cpu_self_s_per_episode"] = (last["cpu_self_s"] - steady_first["cpu_self_s"]) / span
        out["mean_load_average"] = sum(s["load_average"] for s in steady) / len(steady)
    for key in ("rss_mib", "total_rss_mib", "java_rss_mib", "gc_objects"):
        out[key] = {"start": first[key], "steady_start": steady_first[key], "end": last[key],
                    "slope_per_100_episodes": slope_per_100([(s["episodes"], s[key]) for s in steady])}
    for key in ("threads_python", "threads_os"):
        out[key] = {"baseline": baseline[key], "start": first[key], "steady_start": steady_first[key],
                    "end": last[key], "max_steady": max(s[key] for s in steady), "after_close": final[key]}
    rss_slope = out["rss_mib"]["slope_per_100_episodes"]
    total_slope = out["total_rss_mib"]["slope_per_100_episodes"]
    judged = last["episodes"] - steady_first["episodes"] >= MIN_SLOPE_SPAN   # a short run's slope is noise
    out["verdict"] = {
        "rss_flat": (rss_slope is not None and rss_slope <= max_growth) if judged else None,
        "total_rss_flat": (total_slope is not None and total_slope <= max_growth) if judged else None,
        "threads_flat": (steady_first["threads_python"] == last["threads_python"]
                         and steady_first["threads_os"] == last["threads_os"]),
        "no_jvm_left": final["java_processes"] == 0,
        "threads_back_to_baseline": final["threads_python"] == baseline["threads_python"],
        "kv_pages_free_when_idle": all(s["pages_free"] == s["pages_total"] for s in samples) and not anomalies,
    }
    out["verdict"]["pass"] = all(out["verdict"][k] is not False for k in (
        "rss_flat", "threads_flat", "no_jvm_left", "threads_back_to_baseline", "kv_pages_free_when_idle"))
    out["after_close"] = final
    out["baseline"] = baseline
    return out


def _judged(value: bool | None, yes: str, no: str) -> str:
    return "not judged (too few steady-state episodes)" if value is None else yes if value else no


def _fmt(value: Any, pattern: str = "{:.1f}") -> str:
    return "–" if value is None else pattern.format(value)


def markdown(result: dict[str, Any]) -> str:
    s, cfg = result["summary"], result["config"]
    rss, total, java = s["rss_mib"], s["total_rss_mib"], s["java_rss_mib"]
    tp, to = s["threads_python"], s["threads_os"]
    v = s["verdict"]
    lines = [f"Soak: {s['episodes']} episodes ({cfg['alfworld_episodes']} ALFWorld, {cfg['scienceworld_episodes']} "
             f"ScienceWorld), {cfg['slots']} slots ({cfg['slots_per_benchmark']['alfworld']} + "
             f"{cfg['slots_per_benchmark']['scienceworld']}), max {cfg['max_turns']} turns, model "
             f"`{cfg['model']}` with RANDOM weights, {cfg['strategy']}; ScienceWorld JVM heap: "
             f"{cfg['jvm_max_heap']}; steady state from episode {s['steady_state_from_episode']}.",
             "", "| measure | start | steady start | end | slope (per 100 episodes) |", "|---|---:|---:|---:|---:|",
             f"| RSS, this process (MiB) | {rss['start']:.1f} | {rss['steady_start']:.1f} | {rss['end']:.1f} | "
             f"{_fmt(rss['slope_per_100_episodes'], '{:+.2f}')} |",
             f"| RSS, with child processes (MiB) | {total['start']:.1f} | {total['steady_start']:.1f} | "
             f"{total['end']:.1f} | {_fmt(total['slope_per_100_episodes'], '{:+.2f}')} |",
             f"| RSS, JVMs (MiB) | {java['start']:.1f} | {java['steady_start']:.1f} | {java['end']:.1f} | "
             f"{_fmt(java['slope_per_100_episodes'], '{:+.2f}')} |",
             f"| Python objects | {s['gc_objects']['start']} | {s['gc_objects']['steady_start']} | "
             f"{s['gc_objects']['end']} | {_fmt(s['gc_objects']['slope_per_100_episodes'], '{:+.0f}')} |",
             f"| threads, Python | {tp['start']} | {tp['steady_start']} | {tp['end']} | |",
             f"| threads, OS | {to['start']} | {to['steady_start']} | {to['end']} | |",
             "", "| after close | value |", "|---|---:|",
             f"| JVMs left | {s['after_close']['java_processes']} |",
             f"| child processes left | {s['after_close']['child_processes']} "
             f"({', '.join(s['after_close']['child_names']) or 'none'}) |",
             f"| threads, Python (before the engine and pools: {tp['baseline']}) | {tp['after_close']} |",
             f"| threads, OS (before the engine and pools: {to['baseline']}) | {to['after_close']} |",
             "", "| episodes | failed | wall time | s / episode |", "|---:|---:|---:|---:|",
             f"| {s['episodes']} | {s['failed']} | {s['wall_s']:.0f} s | {s['seconds_per_episode']:.2f} |", "",
             f"Steady state: {_fmt(s.get('steady_wall_s_per_episode'), '{:.2f}')} s wall and "
             f"{_fmt(s.get('steady_cpu_s_per_episode'), '{:.2f}')} CPU-s per episode (this process and its children) "
             f"on {result['machine']['cpu_count']} CPUs at a mean load average of "
             f"{_fmt(s.get('mean_load_average'), '{:.1f}')}.", "",
             f"Failures: {json.dumps(result['failures']) if result['failures'] else 'none'}; end reasons: "
             f"{json.dumps(result['end_reasons'])}.", "",
             f"Verdict ({'PASS' if v['pass'] else 'FAIL'}): RSS of this process "
             f"{_judged(v['rss_flat'], 'flat', 'GROWING')} "
             f"(slope <= {s['max_growth_mib_per_100']} MiB / 100 episodes over at least {MIN_SLOPE_SPAN} steady "
             f"episodes); with children {_judged(v['total_rss_flat'], 'flat', 'growing (reported, not judged)')}; "
             f"threads {'flat' if v['threads_flat'] else 'NOT flat'}; "
             f"{'no JVM left' if v['no_jvm_left'] else 'JVMs LEFT BEHIND'}; Python threads "
             f"{'back to' if v['threads_back_to_baseline'] else 'NOT back to'} the count before the engine and pools; "
             f"KV pages {'all free' if v['kv_pages_free_when_idle'] else 'HELD'} whenever the engine was idle.",
             "", f"Games: {result['games']['alfworld']}; {result['games']['scienceworld']}.", "",
             f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


CSV_COLUMNS = ("episodes", "failed", "wall_s", "rss_mib", "children_rss_mib", "total_rss_mib", "java_rss_mib",
               "java_processes", "child_processes", "threads_python", "threads_os", "pages_free", "pages_total",
               "gc_objects", "recoveries", "compiled_shapes", "cpu_s", "cpu_self_s", "load_average")


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "soak.json", out / "soak.csv", out / "soak.md", out / "soak.png"]
    paths[0].write_text(json.dumps(result, indent=2, default=str) + "\n")
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["samples"])
    paths[2].write_text(markdown(result))
    plot(result, paths[3])
    return paths


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    x = [s["episodes"] for s in samples]
    figure, (own, kids, threads) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    own.plot(x, [s["rss_mib"] for s in samples], "o-", color="C0")
    own.set_ylabel("RSS, this process\n(MiB)")
    kids.plot(x, [s["children_rss_mib"] for s in samples], "s-", color="C1", label="all child processes")
    kids.plot(x, [s["java_rss_mib"] for s in samples], "^-", color="C2", label="JVMs (ScienceWorld)")
    kids.set_ylabel("RSS, children\n(MiB)")
    kids.legend(fontsize=8)
    threads.plot(x, [s["threads_python"] for s in samples], "o-", color="C0", label="Python threads")
    threads.plot(x, [s["threads_os"] for s in samples], "s-", color="C1", label="OS threads")
    threads.set_ylabel("threads")
    threads.set_xlabel("episodes done")
    threads.legend(fontsize=8)
    steady = result["summary"]["steady_state_from_episode"]
    for axis in (own, kids, threads):
        axis.axvline(steady, color="grey", linestyle=":", linewidth=1)
        axis.grid(alpha=0.3)
    slope = result["summary"]["rss_mib"]["slope_per_100_episodes"]
    own.set_title(f"Soak: {result['summary']['episodes']} episodes; this process "
                  f"{_fmt(slope, '{:+.2f}')} MiB / 100 episodes after the dotted line (steady state)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------- the run
def run(args, argv: Sequence[str]) -> dict[str, Any]:
    import tqdm

    from bench.env_throughput import build_model, engine_config, thinking_budget
    from jaxopd_envs.pool import EnvPool
    from jaxopd.methods.benchmarks import GeneratedCounts, resolve_source
    from jaxopd.rollout.strategies import ActFirstStrategy, actfirst_config
    from jaxopd.sampler import Engine

    tqdm.tqdm.monitor_interval = 0             # no tqdm monitor thread: it would count as a thread of the soak
    progress = not args.no_progress
    out = Path(args.out)
    started = time.perf_counter()
    kinds = episode_kinds(args.episodes, args.alfworld_share)
    slots = slot_split(args.slots, args.alfworld_share)
    used = [kind for kind in KINDS if slots[kind]]
    rng = random.Random(args.seed)
    sources, tasks = {}, {}
    for kind in used:
        sources[kind] = resolve_source(kind, "auto", counts=GeneratedCounts(), progress=progress)
        tasks[kind] = sorted(sources[kind].tasks("train"), key=lambda t: t.task_id)
        rng.shuffle(tasks[kind])
    games = {"alfworld": sources["alfworld"].describe() if "alfworld" in sources else "none",
             "scienceworld": sources["scienceworld"].describe() if "scienceworld" in sources else "none"}
    model, tokenizer, model_info = build_model(args.model, None, seed=args.seed)
    full = args.full_tokens > 0
    b_max = args.slots * (2 if full else 1)
    config = engine_config(b_max, args.max_prompt_tokens, max(args.fast_tokens, args.full_tokens))
    rollout = actfirst_config("no-id", full_responses=full, fast_action_max_tokens=args.fast_tokens,
                              max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
                              thinking_budget=thinking_budget(max(args.full_tokens, 4)), seed=args.seed)
    if args.jvm_max_heap:                      # the JVMs started from here on inherit it
        options = os.environ.get("JAVA_TOOL_OPTIONS", "")
        os.environ["JAVA_TOOL_OPTIONS"] = f"{options} -Xmx{args.jvm_max_heap}".strip()
    gc.collect()
    baseline = process_sample()                # before the engine and the pools: what the close must return to
    print(f"soak: {args.episodes} episodes ({kinds.count('alfworld')} ALFWorld, {kinds.count('scienceworld')} "
          f"ScienceWorld) on {args.slots} slots {slots}; model {args.model} (RANDOM weights, "
          f"{model_info['num_params'] / 1e6:.1f}M parameters); baseline RSS {baseline['rss_mib']:.0f} MiB, "
          f"{baseline['threads_python']} Python / {baseline['threads_os']} OS threads", flush=True)

    engine = Engine(model, config, tokenizer=tokenizer)
    engine.start()
    pools: dict[str, Any] = {}
    runners = None
    samples: list[dict[str, Any]] = []
    failures: collections.Counter = collections.Counter()
    failure_examples: dict[str, str] = {}
    anomalies: list[str] = []
    end_reasons: collections.Counter = collections.Counter()
    by_kind: dict[str, collections.Counter] = {kind: collections.Counter() for kind in KINDS}
    done = failed = 0
    try:
        t = time.perf_counter()
        compiled = engine.warmup()
        warmup_s = time.perf_counter() - t
        t = time.perf_counter()
        for kind in used:
            pools[kind] = EnvPool(sources[kind].env_factory, slots[kind])
            pools[kind].warm_up()
        pools_s = time.perf_counter() - t
        strategies = {kind: ActFirstStrategy(engine, pools[kind], tokenizer, rollout) for kind in used}
        backends = ", ".join(f"{kind}: {pool.backend}" for kind, pool in pools.items())
        print(f"engine warm-up {compiled} shapes in {warmup_s:.0f} s; pools ({backends}) built in {pools_s:.0f} s",
              flush=True)

        def play(strategy, slot, kind, index):
            task = tasks[kind][index % len(tasks[kind])]
            return strategy.run_episode(slot, task, None, seed=args.seed * 1_000_003 + index)

        runners = Runners(strategies, slots, play)
        t0 = time.perf_counter()

        def sample() -> None:
            if not engine.wait_idle(timeout=600):
                anomalies.append(f"after {done} episodes: the engine did not drain within 600 s")
            gc.collect()
            record = {"episodes": done, "failed": failed, "wall_s": time.perf_counter() - t0, **process_sample(),
                      "pages_free": engine.scheduler.allocator.num_free,
                      "pages_total": engine.scheduler.allocator.num_pages - 1, "gc_objects": len(gc.get_objects()),
                      "recoveries": sum(p.recoveries for p in pools.values()),
                      "compiled_shapes": engine.compiled_count()}
            record["total_rss_mib"] = record["rss_mib"] + record["children_rss_mib"]
            samples.append(record)

        sample()
        bar = tqdm.tqdm(total=args.episodes, desc="soak", unit="episode", disable=not progress, dynamic_ncols=True)
        for chunk_start in range(0, args.episodes, args.sample_every):
            chunk = range(chunk_start, min(args.episodes, chunk_start + args.sample_every))
            for index in chunk:
                runners.submit(index, kinds[index])
            for _ in chunk:
                outcome = runners.results.get()
                done += 1
                by_kind[outcome.kind]["seconds"] += outcome.seconds
                if outcome.error is not None:
                    failed += 1
                    by_kind[outcome.kind]["failed"] += 1
                    reason = outcome.error.split(":")[0]
                    failures[f"{outcome.kind}: {reason}"] += 1
                    failure_examples.setdefault(f"{outcome.kind}: {reason}", outcome.error)
                else:
                    end_reasons[outcome.end_reason] += 1
                    by_kind[outcome.kind]["episodes"] += 1
                    by_kind[outcome.kind]["turns"] += outcome.turns
                    by_kind[outcome.kind]["won"] += outcome.won
                bar.update(1)
            sample()
            last = samples[-1]
            bar.set_postfix(rss=f"{last['rss_mib']:.0f}M", jvm=last["java_processes"],
                            threads=last["threads_python"], failed=failed)
        bar.close()
    finally:
        if runners is not None:
            runners.close()
        for pool in pools.values():
            pool.close()
        engine.stop()
    runners = strategies = engine = None       # drop the last references before the final count
    pools = {}
    final = wait_for_quiet(baseline)
    result = {
        "benchmark": "soak: resident memory, threads and JVMs over many episodes on real environments",
        "command": "python -m bench.soak " + shlex.join(argv),
        "machine": machine_info(), "model": {**model_info, "note": "random weights: the actions are noise; the soak "
                                                                   "measures the machinery, not an agent"},
        "config": {"episodes": args.episodes, "alfworld_share": args.alfworld_share,
                   "alfworld_episodes": kinds.count("alfworld"), "scienceworld_episodes": kinds.count("scienceworld"),
                   "slots": args.slots, "slots_per_benchmark": slots, "max_turns": args.max_turns,
                   "seed": args.seed, "sample_every": args.sample_every, "model": args.model,
                   "strategy": "actfirst no-id (next-action prediction)" + (
                       f" with asynchronous full responses of {args.full_tokens} tokens" if full else
                       ", no full responses"),
                   "fast_tokens": args.fast_tokens, "full_tokens": args.full_tokens,
                   "max_prompt_tokens": args.max_prompt_tokens, "engine": dataclasses.asdict(config),
                   "jvm_max_heap": args.jvm_max_heap or "the JVM's default (a quarter of the machine's memory)"},
        "games": games, "setup_s": {"warmup": warmup_s, "pools": pools_s, "total_before_episodes": t0 - started},
        "compiled_shapes": compiled, "samples": samples,
        "summary": summarize(samples, final, baseline, args.episodes, args.max_growth, anomalies),
        "failures": dict(failures), "failure_examples": failure_examples, "end_reasons": dict(end_reasons),
        "anomalies": anomalies,
        "per_benchmark": {kind: {**c, "mean_episode_s": c["seconds"] / max(1, c["episodes"] + c["failed"]),
                                 "mean_turns": c["turns"] / max(1, c["episodes"])}
                          for kind, c in by_kind.items() if c},
    }
    paths = write_outputs(result, out)
    print()
    print(markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return result


def wait_for_quiet(baseline: dict[str, Any], timeout_s: float = JVM_WAIT_S) -> dict[str, Any]:
    """After the close: wait (at most ``timeout_s``) until no JVM is left and Python's thread count is back to the
    baseline, then sample once more (what was left then is what is reported)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        now = process_sample()
        quiet = now["java_processes"] == 0 and now["threads_python"] <= baseline["threads_python"]
        if quiet or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    time.sleep(1.0)                            # "wait a little": anything about to exit has exited
    final = process_sample()
    final["child_names"] = sorted({name for _, name, _ in descendants()})
    final["waited_s"] = round(timeout_s - max(0.0, deadline - time.monotonic()), 1)
    return final


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _main(args, argv))


def _main(args, argv: Sequence[str]) -> int:
    check_args(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args, argv)
    return 0 if result["summary"]["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
